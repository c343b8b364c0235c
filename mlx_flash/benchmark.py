"""Timing harness and metrics shared by `python -m mlx_flash` and benchmarks/bench.py.

What is timed (every MLX implementation alike; nothing is mx.compile'd unless `compiled`, below):
    forward           build the graph of out = attention(q, k, v) and evaluate it.
    forward_backward  out, (dq, dk, dv) = mx.vjp(attention, [q, k, v], [d_out]), all evaluated:
                      graph building, the forward and the backward. In MLX a VJP always runs
                      the forward, so this is what training pays per attention call.
    backward          the same mx.vjp graph, but `out` (and every forward intermediate the
                      gradients depend on) is evaluated untimed first; the timed part is the
                      evaluation of (dq, dk, dv) only. Graph building is not in this number
                      (it is in the two above).
    compiled          (mlx_pass(compiled=True), bench.py --compiled) forward and forward_backward
                      as mx.compile'd functions of (q, k, v[, d_out]), as a compiled training step
                      runs attention: after the first call (the trace, a warm-up) a call replays
                      the traced graph, so Python's graph building is not in the time; MLX's own
                      per-primitive work (building each kernel launch, the CUDA graph) still is.
    back to back      (Call(back_to_back=K), bench.py --back-to-back K) a sample is K calls issued
                      one after another, each handed to the GPU as it is built (MLX:
                      mx.async_eval; torch launches as it goes), then one wait for all of them;
                      the sample is that time / K. Graph building and launching overlap the
                      previous calls' GPU work, and the framework's wait for the GPU is paid once
                      per K calls, as a training step pays it once per step (on the H100
                      machine a synchronized fwd+bwd call of MLX ended 0.19-0.36 ms after its
                      last kernel, torch's 0.04-0.05 ms). Forward and forward_backward only.
Each measured call: inputs already evaluated, mx.synchronize(), start clock, run, mx.eval of
the results, mx.synchronize(), stop clock. Calls that are compared with each other (the
implementations and passes of one size) are timed interleaved, round-robin (each round in an
order of its own: time_calls says why), so that load from other processes falls on all of them
alike; the median and IQR of each call's repetitions are reported. Peak memory comes from a
separate, untimed call (which is also the first warm-up): mx.reset_peak_memory() after recording
the active memory, then mx.get_peak_memory() minus that baseline, i.e. the memory the call needs
on top of the inputs already resident (its outputs and temporaries; for backward, the retained
forward too).

Metrics (B batch, Hq query heads, Nq, Nk lengths, D head dim; causal halves every count):
    TFLOP/s (papers' convention): forward 4·B·Hq·Nq·Nk·D, backward 2.5x, forward+backward 3.5x.
        Kernel-level: backward_query 1.5x (3 products: S, dP, dQ), backward_key_value 2x
        (4 products: S, dV, dP, dK); the split recomputes S, so the two sum to 3.5x, not 2.5x.
    G instructions/s (MFA's work model, one FMA = one instruction), times B·Hq·Nq·Nk:
        forward 2D+5, backward_query 3D+5, backward_key_value 4D+5, backward 7D+10,
        forward_backward 9D+15.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import random
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

PASSES = ("forward", "backward", "forward_backward")
KERNELS = ("forward", "backward_query", "backward_key_value", "backward", "forward_backward")
PASS_LABELS = {"forward": "fwd", "backward": "bwd", "forward_backward": "fwd+bwd",
               "backward_query": "bwd dQ", "backward_key_value": "bwd dK/dV"}

# Multiples of the forward's 4·B·Hq·Nq·Nk·D floating-point operations.
_FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5,
                "backward_query": 1.5, "backward_key_value": 2.0}
# MFA's instruction counts per (query, key) pair: (a·D + b).
_INSTRUCTION_COEFFICIENTS = {"forward": (2, 5), "backward_query": (3, 5), "backward_key_value": (4, 5),
                             "backward": (7, 10), "forward_backward": (9, 15)}

# Kinds of array mask a case may take (BenchCase.array_mask); "none" = no array mask.
ARRAY_MASKS = ("none", "bool", "additive")
# A case's masks: none, causal or an array mask (bench.py --masks).
MASKS = ("none", "causal", "bool", "additive")
# random_mask: the share of keys a query sees, and the additive mask's value for the others.
MASK_KEEP = 0.9
MASK_HIDDEN = -1e4

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16",
                  "half": "float16", "bf16": "bfloat16"}


def dtype_name(name: str) -> str:
    """Canonical dtype name ("float32", "float16", "bfloat16") for a name or alias like "bf16"."""
    canonical = _DTYPE_ALIASES.get(name, name)
    if canonical not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + sorted(_DTYPE_ALIASES)}, got {name!r}.")
    return canonical


@dataclass(frozen=True)
class BenchCase:
    """One attention problem size.

    Attributes:
        batch, q_heads, kv_heads, q_len, kv_len, head_dim: the shapes (q [B, Hq, Nq, D],
            k/v [B, Hkv, Nk, D]); kv_heads < q_heads is GQA.
        dtype: "float32", "float16" or "bfloat16".
        causal: bottom-right aligned causal mask.
        array_mask: "none", or "bool" / "additive": an array mask of shape [1, 1, Nq, Nk]
            (random_mask), shared by every batch and head; not with causal.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    array_mask: str = "none"

    def __post_init__(self):
        for field in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BenchCase.{field} must be a positive int, got {value!r}.")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"BenchCase.q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads}).")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.array_mask not in ARRAY_MASKS:
            raise ValueError(f"BenchCase.array_mask must be one of {ARRAY_MASKS}, got {self.array_mask!r}.")
        if self.causal and self.array_mask != "none":
            raise ValueError(f"BenchCase takes causal or an array mask, not both (array_mask={self.array_mask!r}).")

    @property
    def mask(self) -> str:
        """The case's mask: "none", "causal", "bool" or "additive" (bench.py's --masks)."""
        return "causal" if self.causal else self.array_mask

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def label(self) -> str:
        heads = f"H={self.q_heads}" if self.kv_heads == self.q_heads else f"H={self.q_heads}/{self.kv_heads}"
        length = f"N={self.q_len}" if self.q_len == self.kv_len else f"Nq={self.q_len} Nk={self.kv_len}"
        return (f"B={self.batch} {heads} {length} D={self.head_dim} {self.dtype}"
                f"{'' if self.mask == 'none' else ' ' + self.mask}{' mask' if self.array_mask != 'none' else ''}")


def attention_flops(case: BenchCase, kernel: str) -> float:
    """Floating-point operations of one pass (see the module docstring), halved for causal."""
    if kernel not in _FLOP_FACTOR:
        raise ValueError(f"kernel must be one of {tuple(_FLOP_FACTOR)}, got {kernel!r}.")
    forward = 4.0 * case.batch * case.q_heads * case.q_len * case.kv_len * case.head_dim
    return forward * _FLOP_FACTOR[kernel] * (0.5 if case.causal else 1.0)


def attention_instructions(case: BenchCase, kernel: str) -> float:
    """MFA's work count, (a·D + b)·B·Hq·Nq·Nk, halved for causal."""
    if kernel not in _INSTRUCTION_COEFFICIENTS:
        raise ValueError(f"kernel must be one of {tuple(_INSTRUCTION_COEFFICIENTS)}, got {kernel!r}.")
    a, b = _INSTRUCTION_COEFFICIENTS[kernel]
    pairs = case.batch * case.q_heads * case.q_len * case.kv_len
    return (a * case.head_dim + b) * pairs * (0.5 if case.causal else 1.0)


# The work of one timed sample of calls issued back to back (the main job's and the report's on a
# GPU): 8 forward+backward calls at B=1 H=16 N=4096 D=128, about 8 ms on an H200.
SAMPLE_WORK = 8 * attention_flops(BenchCase(batch=1, q_heads=16, kv_heads=16, q_len=4096, kv_len=4096, head_dim=128,
                                            dtype="bfloat16"), "forward_backward")


def calls_per_sample(case: BenchCase, kernel: str, most: int) -> int:
    """Calls of one timed sample back to back: enough for SAMPLE_WORK, between 1 and `most`."""
    return max(1, min(most, math.ceil(SAMPLE_WORK / attention_flops(case, kernel))))


def tflops_per_second(case: BenchCase, kernel: str, seconds: float) -> float:
    return attention_flops(case, kernel) / seconds / 1e12


def ginstructions_per_second(case: BenchCase, kernel: str, seconds: float) -> float:
    return attention_instructions(case, kernel) / seconds / 1e9


# ---------------------------------------------------------------------------------------------
# Timing and memory


def mlx_launch(result) -> None:
    """Hand `result`'s graph to the GPU without waiting for it (mx.async_eval)."""
    mx.async_eval(result)


def mlx_finish(result) -> None:
    """Block until `result` (any tree of arrays) is computed: eval, then synchronize the stream."""
    if result is not None:
        mx.eval(result)
    mx.synchronize()


@dataclass
class Timing:
    """Wall-clock seconds of the measured repetitions (warm-ups excluded)."""

    samples: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def quantile(self, fraction: float) -> float:
        """Linear-interpolated quantile of the samples (0.25 and 0.75 give the IQR)."""
        ordered = sorted(self.samples)
        position = fraction * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    def summary_ms(self) -> Dict[str, float]:
        return {"median_ms": self.median * 1e3, "q1_ms": self.quantile(0.25) * 1e3,
                "q3_ms": self.quantile(0.75) * 1e3, "min_ms": min(self.samples) * 1e3,
                "max_ms": max(self.samples) * 1e3, "repeats": len(self.samples)}


@dataclass
class Call:
    """One thing to time: run(state) is the timed work, prepare() its untimed per-repetition setup.

    Attributes:
        run: called as run(state) with prepare's result (or None); its result is passed to
            `finish` inside the timed region, so lazy work is really done.
        prepare: optional untimed setup (e.g. evaluate a forward). It must evaluate what it
            wants done untimed itself: its result goes to `run` as is, since it is typically
            the lazy graph whose evaluation is the timed work.
        finish: blocks until a result is computed (MLX: mx.eval + mx.synchronize); with
            back_to_back > 1 it gets the list of the sample's results.
        back_to_back: calls per sample (1: each call waited for; see the module doc). Each call
            reuses prepare's result, so only passes whose run builds new work from it qualify
            (forward, forward_backward).
        launch: with back_to_back > 1, called on each result as it is built (MLX: mx.async_eval;
            a framework that launches eagerly passes a no-op).
    """

    run: Callable[[Any], Any]
    prepare: Optional[Callable[[], Any]] = None
    finish: Callable[[Any], None] = mlx_finish
    back_to_back: int = 1
    launch: Callable[[Any], None] = mlx_launch

    def __post_init__(self):
        if type(self.back_to_back) is not int or self.back_to_back < 1:
            raise ValueError(f"back_to_back must be an int >= 1, got {self.back_to_back!r}.")

    def timed_once(self) -> float:
        """Seconds per call of one sample (see the module doc: one call, or back_to_back calls
        issued one after another and waited for once)."""
        state = self.prepare() if self.prepare is not None else None
        self.finish(None)  # drain anything still queued so it is not billed to `run`
        start = time.perf_counter()
        if self.back_to_back == 1:
            self.finish(self.run(state))
        else:
            results = []
            for _ in range(self.back_to_back):
                results.append(self.run(state))
                self.launch(results[-1])
            self.finish(results)
        return (time.perf_counter() - start) / self.back_to_back


def time_calls(calls: Dict[Any, Call], *, warmup: int = 1, min_repeats: int = 3, max_repeats: int = 10,
               target_seconds: float = 1.0, errors: Optional[Dict[Any, str]] = None,
               progress: Optional[Callable[[Any], None]] = None, order_seed: Optional[int] = 0) -> Dict[Any, Timing]:
    """Wall-clock samples of several calls, interleaved round-robin.

    Interleaving puts the calls being compared in the same time windows, so load from other
    processes or clock changes hit them alike instead of biasing whichever ran during it. Each
    timed round visits the calls in an order of its own, drawn from a generator seeded with
    `order_seed` (None: the given order every round): a call's time depends on what ran just
    before it (on an H200, the call after MLX's unfused D = 512 attention ran 3-7 % slower than
    after another version of itself: benchmarks/ab_versions.py's sample_order), and a fixed
    order would give each call the same neighbour in every round.

    Args:
        calls: what to time, by key.
        warmup: untimed runs of each call first (kernel compilation, allocator caches).
        min_repeats, max_repeats: a call gets repetitions until `target_seconds` of measured
            time is reached, at least min_repeats and at most max_repeats.
        target_seconds: see above; keeps fast calls well sampled and slow ones affordable.
        errors: if given, a call that raises is dropped and its message stored here by key
            (otherwise the exception propagates).
        progress: called with the key after every call (warm-ups included), e.g. to advance
            a progress bar.
        order_seed: the seed of the rounds' orders (the warm-up rounds keep the given order).
    Returns:
        Timing by key, for the calls that did not fail.
    """
    if min_repeats < 1 or max_repeats < min_repeats:
        raise ValueError(f"need 1 <= min_repeats <= max_repeats, got min_repeats={min_repeats}, "
                         f"max_repeats={max_repeats}.")
    samples: Dict[Any, List[float]] = {key: [] for key in calls}
    active = list(calls)

    def attempt(key) -> Optional[float]:
        try:
            return calls[key].timed_once()
        except Exception as error:
            if errors is None:
                raise
            errors[key] = f"{type(error).__name__}: {str(error)[:200]}"
            active.remove(key)
            del samples[key]
            return None
        finally:
            if progress is not None:
                progress(key)

    for _ in range(warmup):
        for key in list(active):
            attempt(key)
    shuffle = random.Random(order_seed).shuffle if order_seed is not None else (lambda keys: None)
    while active:
        keys = list(active)
        shuffle(keys)
        for key in keys:
            elapsed = attempt(key)
            if elapsed is None:
                continue
            samples[key].append(elapsed)
            done = len(samples[key]) >= min_repeats and sum(samples[key]) >= target_seconds
            if done or len(samples[key]) >= max_repeats:
                active.remove(key)
    return {key: Timing(values) for key, values in samples.items()}


def time_call(run: Callable[[Any], Any], *, prepare: Optional[Callable[[], Any]] = None,
              finish: Callable[[Any], None] = mlx_finish, warmup: int = 1, min_repeats: int = 3,
              max_repeats: int = 10, target_seconds: float = 1.0) -> Timing:
    """Samples of one call; see `Call` and `time_calls` for the arguments."""
    return time_calls({0: Call(run, prepare, finish)}, warmup=warmup, min_repeats=min_repeats,
                      max_repeats=max_repeats, target_seconds=target_seconds)[0]


class MLXMemory:
    """Peak-memory probe for MLX: bytes allocated above the active memory at `start`."""

    def start(self) -> None:
        mx.synchronize()
        self.baseline = mx.get_active_memory()
        mx.reset_peak_memory()

    def peak(self) -> int:
        mx.synchronize()
        return max(0, mx.get_peak_memory() - self.baseline)


def peak_memory(run: Callable[[Any], Any], *, prepare: Optional[Callable[[], Any]] = None,
                finish: Callable[[Any], None] = mlx_finish, probe=None) -> Optional[int]:
    """Bytes the call needs above the memory already in use (prepare included: for a backward,
    the retained forward state counts). One untimed call."""
    probe = probe or MLXMemory()
    probe.start()
    state = prepare() if prepare is not None else None
    result = run(state)
    finish(result)
    peak = probe.peak()  # None where the probe cannot measure
    del result, state
    return peak


# ---------------------------------------------------------------------------------------------
# Implementations and passes


def random_inputs(case: BenchCase, seed: int = 0):
    """Evaluated random normal (q, k, v, d_out) for a case, fresh per seed (never all zero)."""
    dtype = DTYPES[case.dtype]
    keys = mx.random.split(mx.random.key(seed), 4)
    shapes = [(case.batch, case.q_heads, case.q_len, case.head_dim),
              (case.batch, case.kv_heads, case.kv_len, case.head_dim),
              (case.batch, case.kv_heads, case.kv_len, case.head_dim),
              (case.batch, case.q_heads, case.q_len, case.head_dim)]
    arrays = [mx.random.normal(shape, key=key).astype(dtype) for shape, key in zip(shapes, keys)]
    mx.eval(arrays)
    return arrays


def random_mask(case: BenchCase, seed: int = 0) -> Optional[mx.array]:
    """The case's evaluated array mask [1, 1, Nq, Nk] (None without one): each key kept with
    probability MASK_KEEP, independently; bool (True = keep) or additive (0 kept, MASK_HIDDEN
    hidden) in the case's dtype. Our kernels and cuDNN read every element of a mask whatever it
    holds (neither skips masked tiles), so its pattern does not change their time."""
    if case.array_mask == "none":
        return None
    keep = mx.random.uniform(shape=(1, 1, case.q_len, case.kv_len), key=mx.random.key(seed + 1)) < MASK_KEEP
    mask = keep if case.array_mask == "bool" else mx.where(keep, 0.0, MASK_HIDDEN).astype(DTYPES[case.dtype])
    mx.eval(mask)
    return mask


def unfused_attention(q, k, v, mask, scale: float):
    """softmax(q k^T * scale + mask) v with plain MLX ops: the N^2 score matrix is materialized.

    `mask`: None, "causal" (bottom-right aligned) or an array mask broadcastable to the scores
    (bool: True = keep; else added to the scaled scores), as mx.fast takes it.
    GQA shares each kv head by broadcasting (q viewed as [B, Hkv, G, N, D]), not by tiling k/v.
    The softmax runs in fp32 (precise=True) like mx.fast's.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    q5 = q.reshape(B, Hkv, group, Nq, D)
    scores = (q5 * scale) @ mx.swapaxes(mx.expand_dims(k, 2), -1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}.")
        mask = mx.arange(Nk)[None, :] <= mx.arange(Nq)[:, None] + (Nk - Nq)
    if mask is not None:
        if mask.ndim == 4:  # [B or 1, Hq or 1, ., .] -> [B or 1, Hkv or 1, G or 1, ., .]
            heads = (Hkv, group) if mask.shape[1] == Hq else (1, 1)
            mask = mask.reshape(mask.shape[0], *heads, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-math.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    probabilities = mx.softmax(scores, axis=-1, precise=True)
    return (probabilities @ mx.expand_dims(v, 2)).reshape(B, Hq, Nq, v.shape[3])


def fast_attention(q, k, v, mask, scale: float):
    """MLX's own attention, mx.fast.scaled_dot_product_attention (`mask` as unfused_attention's)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def flash_attention_with(backend: str) -> Callable:
    """mlx_flash.flash_attention on a given backend, in the (q, k, v, mask, scale) form."""
    from .api import flash_attention

    def attention(q, k, v, mask, scale: float):
        return flash_attention(q, k, v, scale=scale, mask=mask, backend=backend)

    return attention


def mlx_pass(attention: Callable, case: BenchCase, inputs, pass_name: str, compiled: bool = False,
             mask: Optional[mx.array] = None):
    """(prepare, run) of one pass of an MLX attention function (see the module docstring).

    Args:
        attention: (q, k, v, mask, scale) -> out, where mask is None, "causal" or an array.
        case: the problem.
        inputs: (q, k, v, d_out), evaluated.
        pass_name: one of PASSES.
        compiled: run the forward / forward_backward pass as an mx.compile'd function (the
            backward pass is part of a compiled forward_backward and is not timed on its own).
        mask: the case's array mask (random_mask), required exactly when case.array_mask is not
            "none"; an input of the compiled function, never differentiated.
    """
    q, k, v, d_out = inputs
    if (mask is None) != (case.array_mask == "none"):
        raise ValueError(f"mask must be given exactly when the case has an array mask (array_mask="
                         f"{case.array_mask!r}, mask {'given' if mask is not None else 'None'}).")
    extra = [] if mask is None else [mask]

    def attend(q_, k_, v_, *mask_):
        return attention(q_, k_, v_, mask_[0] if mask_ else ("causal" if case.causal else None), case.scale)

    def both(q_, k_, v_, d_, *mask_):
        return mx.vjp(lambda a, b, c: attend(a, b, c, *mask_), [q_, k_, v_], [d_])

    if compiled and pass_name not in ("forward", "forward_backward"):
        raise ValueError(f"compiled timing covers the forward and forward_backward passes, got {pass_name!r}.")
    if pass_name == "forward":
        if compiled:
            forward = mx.compile(attend)
            return None, lambda _: forward(q, k, v, *extra)
        return None, lambda _: attend(q, k, v, *extra)
    if pass_name == "forward_backward":
        if compiled:
            both_compiled = mx.compile(both)
            return None, lambda _: both_compiled(q, k, v, d_out, *extra)
        return None, lambda _: both(q, k, v, d_out, *extra)
    if pass_name == "backward":
        def prepare():
            outputs, gradients = both(q, k, v, d_out, *extra)
            mx.eval(outputs)  # the forward and everything the gradients read from it
            return gradients
        return prepare, lambda gradients: gradients
    raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}.")


@dataclass
class Settings:
    """How hard to measure: see `time_calls`."""

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 10
    target_seconds: float = 1.0


def measure(prepare, run, case: BenchCase, kernel: str, settings: Settings,
            finish=mlx_finish, probe=None) -> Dict[str, Any]:
    """Peak memory (one untimed call, which also warms up) then timing; the metrics as a dict."""
    return measure_many({0: (Call(run, prepare, finish), case, kernel, probe)}, settings, catch=False)[0]


def measure_many(items: Dict[Any, tuple], settings: Settings, catch: bool = True,
                 progress: Optional[Callable[[Any], None]] = None) -> Dict[Any, Dict[str, Any]]:
    """Measure several calls that are to be compared: each one's peak memory (one untimed call
    each, which also warms it up), then all their timings interleaved (`time_calls`).

    Args:
        items: key -> (Call, BenchCase, kernel name for the metrics, memory probe or None).
        settings: repetitions (see `Settings`).
        catch: record a failing call as {"error": message} instead of raising (one
            implementation running out of memory must not lose the others' numbers).
        progress: called with the key after every call (the memory call and each timed or
            warm-up repetition).
    Returns:
        key -> metrics dict (median_ms, q1_ms, q3_ms, min_ms, max_ms, repeats, tflops, ginstrs,
        peak_memory_bytes, samples_ms) or {"error": message}.
    """
    errors: Dict[Any, str] = {}
    memory: Dict[Any, Optional[int]] = {}
    for key, (call, _, _, probe) in items.items():
        try:
            memory[key] = peak_memory(call.run, prepare=call.prepare, finish=call.finish, probe=probe)
        except Exception as error:
            if not catch:
                raise
            errors[key] = f"{type(error).__name__}: {str(error)[:200]}"
        if progress is not None:
            progress(key)
    calls = {key: item[0] for key, item in items.items() if key not in errors}
    timings = time_calls(calls, warmup=settings.warmup, min_repeats=settings.min_repeats,
                         max_repeats=settings.max_repeats, target_seconds=settings.target_seconds,
                         errors=errors if catch else None, progress=progress)
    results: Dict[Any, Dict[str, Any]] = {}
    for key, (_, case, kernel, _) in items.items():
        if key in errors:
            results[key] = {"error": errors[key]}
            continue
        timing = timings[key]
        row = timing.summary_ms()
        row.update(tflops=tflops_per_second(case, kernel, timing.median),
                   ginstrs=ginstructions_per_second(case, kernel, timing.median),
                   peak_memory_bytes=None if memory[key] is None else int(memory[key]),
                   samples_ms=[sample * 1e3 for sample in timing.samples])
        results[key] = row
    return results


# ---------------------------------------------------------------------------------------------
# Environment and tables


def device_description() -> Dict[str, Any]:
    """The default device and what MLX says about it (mx.device_info, or mx.metal's)."""
    device = mx.default_device()
    info: Dict[str, Any] = {}
    for source in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if source is None:
            continue
        try:
            info = dict(source())
            break
        except Exception:  # older MLX or no Metal: try the next source
            continue
    info = {key: (value if isinstance(value, (int, float, str, bool)) else str(value)) for key, value in info.items()}
    if device.type == mx.gpu:  # a CUDA GPU's SMs (the dK/dV head splits plan for them; None elsewhere)
        from .backends.cuda import device_sm_count
        sms = device_sm_count()
        if sms is not None:
            info.setdefault("multiprocessor_count", sms)
    name = info.get("device_name") or platform.processor() or platform.machine()
    return {"device": str(device), "device_type": "gpu" if device.type == mx.gpu else "cpu",
            "device_name": name, "device_info": info}


# Unfused attention keeps ~1.3 (forward) and ~3.7 (forward+backward) score-sized arrays alive
# (measured with mx.get_peak_memory on CPU, fp32 and bf16); the estimate rounds up for margin.
SCORE_ARRAYS = {"forward": 2, "backward": 5, "forward_backward": 5}
# The out-of-memory guards' share of the device's memory: a pass whose estimate passes it is not
# run (bench.py's default, the main job's and the report's). On a Mac, MLX's attention backward is
# unfused: at H=16 N=16384 bf16 its scores need ~40 GB, more than most Macs have, and running out
# of memory there ends the process. Calls timed back to back may overlap in memory; MLX's allocator
# waits on scheduled work once its memory limit (on a Mac 1.5x the recommended working set) is
# passed, and 40 % leaves room for two.
MEMORY_GUARD_FRACTION = 0.4


def mx_fast_is_fused(case: BenchCase, pass_name: str) -> bool:
    """Whether MLX 0.32 runs mx.fast attention fused here (then it needs no N^2 memory).

    Only feeds the out-of-memory estimate. CPU: never. Metal: the forward for the head dims of
    its kernels; any traced gradient runs unfused. CUDA: cuDNN, as backends/fast.py reads MLX's rule
    (fp16 / bf16, D a multiple of 8 up to 128; the backward only where the query rows are a
    multiple of 128)."""
    device = mx.default_device()
    if device.type != mx.gpu:
        return False
    if mx.metal.is_available():
        return pass_name == "forward" and case.head_dim in (64, 72, 80, 96, 128, 192, 256)
    from .backends.fast import cudnn_forward_fuses, cudnn_fuses
    from .spec import AttentionSpec

    spec = AttentionSpec(case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim,
                         case.head_dim, DTYPES[case.dtype], case.head_dim ** -0.5, causal=case.causal)
    return cudnn_forward_fuses(spec) if pass_name == "forward" else cudnn_fuses(spec)


def score_memory_estimate(implementation: str, case: BenchCase, pass_name: str) -> float:
    """Upper estimate of the N^2-sized memory a pass of "unfused" or "mx.fast" needs (0 where
    it runs fused; mlx-flash's is O(N)). The out-of-memory guards of bench.py, the main job and the
    report."""
    if implementation == "unfused" or (implementation == "mx.fast" and not mx_fast_is_fused(case, pass_name)):
        pairs = case.batch * case.q_heads * case.q_len * case.kv_len
        return SCORE_ARRAYS[pass_name] * pairs * DTYPES[case.dtype].size
    return 0.0


def memory_guard_bytes() -> Optional[float]:
    """The main job's and the report's out-of-memory budget: MEMORY_GUARD_FRACTION of the default
    device's memory (None where it is unknown: no guard)."""
    memory = device_memory_bytes()
    return None if memory is None else MEMORY_GUARD_FRACTION * memory


def device_memory_bytes() -> Optional[int]:
    """Memory the default device can use: MLX's memory_size / total_memory; on a CPU, the host
    RAM; None for a GPU that reports neither."""
    description = device_description()
    info = description["device_info"]
    for key in ("memory_size", "total_memory", "max_recommended_working_set_size"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key])
    if description["device_type"] == "gpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def git_commit() -> Dict[str, Any]:
    """The repository's commit and whether the package/benchmark sources differ from it.

    $MLX_FLASH_COMMIT, when set, is taken as given: a copied checkout may have no .git, or a
    .git of an older commit than the tree it was copied from (the GPU machine's copy)."""
    root = Path(__file__).resolve().parent.parent
    given = os.environ.get("MLX_FLASH_COMMIT", "").strip()
    if given:
        return {"git_commit": given, "git_dirty": None}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", "HEAD"],
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        if not re.fullmatch(r"[0-9a-f]{40,64}", commit):
            raise subprocess.SubprocessError(f"not a commit: {commit!r}")
        # Tracked sources only: other people's untracked work in progress is not imported here.
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                "mlx_flash", "kernels", "benchmarks"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return {"git_commit": commit, "git_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def environment(backend_requested: str, backend_resolved: Optional[str]) -> Dict[str, Any]:
    """Everything a recorded result needs to be reproduced and compared."""
    from . import __version__

    env = device_description()
    env.update(git_commit())
    env.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        mlx_version=mx.__version__, mlx_flash_version=__version__,
        backend=backend_resolved, backend_requested=backend_requested,
        platform=platform.platform(), python=platform.python_version(), cpu_count=os.cpu_count(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        device_memory_bytes=device_memory_bytes())
    return env


def format_ms(ms: Optional[float]) -> str:
    """Milliseconds with 3 significant digits, without exponents."""
    if ms is None:
        return "-"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def format_rate(operations_per_second: Optional[float], unit: str) -> str:
    """A rate in the given unit ("GFLOP/s" or "TFLOP/s"), 3 significant digits, no exponent."""
    if operations_per_second is None:
        return "-"
    scale = {"GFLOP/s": 1e9, "TFLOP/s": 1e12}[unit]
    value = operations_per_second / scale
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_bytes(count: Optional[float]) -> str:
    if count is None:
        return "-"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}" if count / size < 100 else f"{count / size:.0f} {unit}"
    return f"{int(count)} B"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def _numeric(text: str) -> bool:
    head = text.split(" ")[0].rstrip("x%")
    try:
        float(head)
        return True
    except ValueError:
        return False


def as_dict(case: BenchCase) -> Dict[str, Any]:
    return dataclasses.asdict(case)


def case_of(row: Dict[str, Any]) -> BenchCase:
    """The BenchCase of a recorded row (as_dict's keys; rows recorded before array masks have none)."""
    return BenchCase(**{f.name: row[f.name] for f in dataclasses.fields(BenchCase) if f.name in row})
