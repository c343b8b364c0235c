"""First contact: a kernel variant is built, run and (optionally) checked once per process
before any call of the user's uses it.

Why: the Metal kernels have met Apple's compiler only through our simulator, and the CUDA
kernels only an H100. A kernel that the user's compiler rejects, that fails to launch on the
user's GPU, or that computes wrong numbers there (a lane-layout or barrier assumption that holds
on the machines we have) must neither crash their training inside `mx.eval` nor train on garbage.

How: the first call that needs a set of kernel variants (the forward, dQ and dK/dV kernels one
call uses: `backend.variant_key(spec)`) runs that set eagerly, outside the user's graph, on a
small random problem with the same compile-time constants (`probe_spec`). A failure to compile
or to run is caught. With the self-check on, the results are compared with the "mlx" backend in
float32 on the same rounded inputs, computed on the CPU (whose float32 matmuls are float32's). A
failure becomes the reason string that the backend's `unsupported_reason` returns, so
`select_backend` serves the call (and every later call that needs the same variants) on the
fallback path, with one FallbackWarning and a count per call.

The probe runs in plain Python at call time, which is before `mx.custom_function` adds the
call to the user's graph; it evaluates only arrays it made itself, which MLX allows under
`mx.grad`, `mx.vjp`, `mx.compile` and `mx.checkpoint` alike.

Cost, once per variant set per process (a training run usually needs one or two sets). Through
the Metal simulator on a 2-core CPU (load 7-10; the simulator's figures, not a GPU's): building
the three kernels takes 8 s (D=64 fp32) to 47 s (D=128 bf16) with the compile cache cold (a build
the first call would pay anyway; cached on disk after), running them on the probe problem
0.1-0.35 s, the self-check 0.03-0.27 s more (D=64..256). On a Mac the Metal compile is likewise
the one the first call would do; the probe adds three launches on a 67 x 83 problem of at most
two heads, the "mlx" backend's float32 result of the same size and a few synchronizations (an
estimate of a few to ~20 ms, not yet measured on a Mac: `python -m mlx_flash report` lists each
first contact's seconds).

Environment:
    MLX_FLASH_SELF_CHECK: unset -> self-check on for "metal", off for "cuda" (compile and run
    only); "0" -> off everywhere; "1" -> on everywhere.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from types import MappingProxyType
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import call_cache, reference

# The probe's problem: lengths that give several parallel and traversal blocks, partial last
# blocks and (with Nq != Nk) an off-centre causal diagonal, at a fraction of a second per
# variant on the CPU simulators.
PROBE_QUERIES = 67
PROBE_KEYS = 83
SELF_CHECK_DEFAULT = MappingProxyType({"metal": True})
REPORT_HINT = ("please run `python -m mlx_flash report --out DIR` and send us DIR/report.md "
               "(see the README)")


def self_check_enabled(backend_name: str) -> bool:
    """Whether a first contact also compares results (MLX_FLASH_SELF_CHECK, see the module doc)."""
    value = os.environ.get("MLX_FLASH_SELF_CHECK", "").strip()
    if value == "":
        return SELF_CHECK_DEFAULT.get(backend_name, False)
    if value not in ("0", "1"):
        raise ValueError(f"[flash_attention] MLX_FLASH_SELF_CHECK must be 0 or 1, got {value!r}.")
    return value == "1"


def probe_spec(spec):
    """A small problem with the same compile-time constants as `spec`: one batch entry, one kv
    head and up to two of its query heads, PROBE_QUERIES x PROBE_KEYS; D, dtype, scale, masks,
    window, softcap and sinks as in `spec`."""
    q_heads = min(spec.group, 2) if spec.kv_heads else 1
    mask_shape = None
    if spec.mask_shape is not None:
        mask_shape = (1, q_heads if spec.mask_shape[1] > 1 else 1,
                      PROBE_QUERIES if spec.mask_shape[2] > 1 else 1, PROBE_KEYS if spec.mask_shape[3] > 1 else 1)
    return dataclasses.replace(spec, batch=1, q_heads=q_heads, kv_heads=1, q_len=PROBE_QUERIES,
                               kv_len=PROBE_KEYS, mask_shape=mask_shape)


@dataclasses.dataclass
class ProbeInputs:
    q: mx.array
    k: mx.array
    v: mx.array
    d_out: mx.array
    mask: Optional[mx.array]
    sinks: Optional[mx.array]


def probe_inputs(spec, mask_dtype: Optional[mx.Dtype], seed: int = 0) -> ProbeInputs:
    """Random inputs for a probe spec, from numpy's generator (MLX's global key is left alone)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=spec.dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    B, Hq, Hkv, Nq, Nk = spec.batch, spec.q_heads, spec.kv_heads, spec.q_len, spec.kv_len
    mask = None
    if spec.mask_kind == "bool":
        keep = rng.random(spec.mask_shape) < 0.8
        mask = mx.array(keep)
    elif spec.mask_kind == "additive":
        mask = normal(*spec.mask_shape, dtype=mask_dtype or spec.dtype)
    sinks = normal(Hq, dtype=spec.dtype) if getattr(spec, "has_sinks", False) else None
    inputs = ProbeInputs(q=normal(B, Hq, Nq, spec.head_dim), k=normal(B, Hkv, Nk, spec.head_dim),
                         v=normal(B, Hkv, Nk, spec.value_dim), d_out=normal(B, Hq, Nq, spec.value_dim),
                         mask=mask, sinks=sinks)
    # Evaluated here, so that an evaluation that fails in the probe holds the kernel alone (no
    # half-encoded conversions of the inputs are left behind on the stream).
    mx.eval([a for a in (getattr(inputs, f.name) for f in dataclasses.fields(inputs)) if a is not None])
    return inputs


_UNKNOWN = object()


class FirstContact:
    """Per-process verdicts on kernel-variant sets: None (works) or the reason it does not.

    Thread-safe; a verdict is never revisited within the process (a kernel that failed once is
    not tried again on the user's data).
    """

    def __init__(self):
        self._verdicts: Dict[Hashable, Optional[str]] = {}
        self._lock = threading.Lock()
        self.probe_seconds: Dict[Hashable, float] = {}
        self._labels: Dict[Hashable, str] = {}
        self._details: Dict[Hashable, Optional[str]] = {}  # a build failure's whole message

    def verdict(self, backend, spec, mask_dtype: Optional[mx.Dtype] = None) -> Optional[str]:
        """None when the variants serving `spec` on `backend` work here, else why not.

        Args:
            backend: a kernel backend with `name`, `variant_key(spec, mask_dtype)`, `forward` and
                `backward` (see mlx_flash.backends).
            spec: the call's AttentionSpec.
            mask_dtype: the array mask's dtype (part of the compiled variant), or None.
        """
        if min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len, spec.head_dim) == 0:
            return None  # an empty call runs no kernel
        key = (backend.name, backend.variant_key(spec, mask_dtype))
        known = self._verdicts.get(key, _UNKNOWN)  # every call after the first: one lookup, no lock
        if known is not _UNKNOWN:
            return known
        with self._lock:
            if key in self._verdicts:  # another thread probed it meanwhile
                return self._verdicts[key]
            start = time.perf_counter()
            reason, detail = self._probe(backend, spec, mask_dtype)
            self.probe_seconds[key] = time.perf_counter() - start
            self._verdicts[key] = reason
            self._labels[key] = _variant_set_label(backend, spec, mask_dtype)
            self._details[key] = detail
            return reason

    def records(self) -> List[Dict[str, object]]:
        """Every verdict of this process: backend, variants (readable), probe seconds (build, run
        and self-check), verdict (None = works) and, for a build or run failure, the error's whole
        text (the verdict shortens it), in the order they were reached."""
        with self._lock:
            return [{"backend": key[0], "variants": self._labels[key], "seconds": self.probe_seconds[key],
                     "verdict": reason, "detail": self._details[key]} for key, reason in self._verdicts.items()]

    def forget(self) -> None:
        """Drop every verdict (tests use this), and the call decisions made from them (call_cache)."""
        with self._lock:
            self._verdicts.clear()
            self.probe_seconds.clear()
            self._labels.clear()
            self._details.clear()
        call_cache.forget()

    def _probe(self, backend, spec, mask_dtype) -> Tuple[Optional[str], Optional[str]]:
        """(verdict, the failure's whole message or None)."""
        small = probe_spec(spec)
        x = probe_inputs(small, mask_dtype)
        call_args = {"sinks": x.sinks} if x.sinks is not None else {}
        if getattr(backend, "pins_variants", False):
            # The call's own kernels, which its size chose (the CUDA backend's fused dQ from a length,
            # its dK/dV kernel's head splits where a call has few CTAs), not the small problem's.
            call_args["variants"] = backend.variants(spec, mask_dtype)
        stage = "forward"
        try:
            out, lse = backend.forward(x.q, x.k, x.v, x.mask, small, **call_args)
            mx.eval(out, lse)
            stage = "backward"
            grads = backend.backward(x.q, x.k, x.v, x.mask, out, lse, x.d_out, None, small, **call_args)
            stage = "backward_query"
            mx.eval(grads[0])
            stage = "backward_key_value"
            mx.eval(grads[1:3])
            stage = "backward"
            mx.eval(grads)
        except Exception as e:  # the compiler's or the launcher's message, whatever its type
            message = " ".join(str(e).split())
            if len(message) > 600:
                message = message[:600] + " ..."
            if stage == "backward":  # both kernels were built in one call: the message may say which
                stage = next((kernel for kernel in ("backward_query", "backward_key_value")
                              if _names_kernel(backend, kernel, spec, mask_dtype, message)), stage)
            return (f"{backend.name} {_variant_name(backend, stage, spec, mask_dtype)} failed to compile or "
                    f"run on this device: {type(e).__name__}: {message}"), f"{type(e).__name__}: {e}"
        if not self_check_enabled(backend.name):
            return None, None
        return self._compare(backend, small, x, (out, lse) + tuple(grads), spec, mask_dtype), None

    def _compare(self, backend, small, x: ProbeInputs, results, spec, mask_dtype) -> Optional[str]:
        from . import get_backend  # the "mlx" backend: blocked MLX ops, float32

        reference_backend = get_backend("mlx")
        ref_spec = dataclasses.replace(small, dtype=mx.float32)
        mask = x.mask
        # On the CPU: there MLX's float32 matmuls are float32's. On a GPU they may round to fewer
        # bits (reference.float32_matmuls_reduced: TF32 on CUDA, an M5's accelerators), and a
        # correct float32 kernel would then differ from this reference by ~4e-4, past float32's limit.
        with mx.stream(mx.cpu):
            f32 = [None if a is None else a.astype(mx.float32) for a in (x.q, x.k, x.v, x.d_out)]
            sink_args = {"sinks": x.sinks.astype(mx.float32)} if x.sinks is not None else {}
            ref_out, ref_lse = reference_backend.forward(f32[0], f32[1], f32[2], mask, ref_spec, **sink_args)
            ref_grads = reference_backend.backward(f32[0], f32[1], f32[2], mask, ref_out, ref_lse, f32[3], None,
                                                   ref_spec, **sink_args)
            mx.eval(ref_out, ref_lse, *[g for g in ref_grads if g is not None])
        names = ("out", "lse", "dq", "dk", "dv", "d_sinks")
        dtype = str(spec.dtype).split(".")[-1]
        stages = {"out": "forward", "lse": "forward", "dq": "backward_query", "d_sinks": "backward_query",
                  "dk": "backward_key_value", "dv": "backward_key_value"}
        for name, got, want in zip(names, results, (ref_out, ref_lse) + tuple(ref_grads)):
            if got is None or want is None:
                continue
            limit = (reference.FORWARD_TOLERANCE if name in ("out", "lse") else reference.GRADIENT_TOLERANCE)[dtype]
            error = reference.relative_error(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))
            if not error <= limit:
                return (f"{backend.name} {_variant_name(backend, stages[name], spec, mask_dtype)} failed its "
                        f"first-use self-check: {name} differs from the 'mlx' backend by relative error "
                        f"{error:.3g} (limit {limit:g} for {dtype}); {REPORT_HINT}")
        return None


def _variant_set_label(backend, spec, mask_dtype) -> str:
    """The variant names of one call's kernels, or a description of the call when the backend
    cannot name them."""
    namer: Optional[Callable] = getattr(backend, "variant_name", None)
    if namer is not None:
        try:
            return ", ".join(namer(kernel, spec, mask_dtype)
                             for kernel in ("forward", "backward_query", "backward_key_value"))
        except Exception:  # a backend whose kernels are not these three: describe the call instead
            pass
    return (f"D={spec.head_dim} {str(spec.dtype).split('.')[-1]} mask={spec.mask_kind} causal={spec.causal} "
            f"mask_dtype={mask_dtype}")


def _names_kernel(backend, kernel: str, spec, mask_dtype, message: str) -> bool:
    """Whether an error message names `kernel`'s variant (compilers name the function)."""
    namer: Optional[Callable] = getattr(backend, "variant_name", None)
    return namer is not None and namer(kernel, spec, mask_dtype) in message


def _variant_name(backend, stage: str, spec, mask_dtype) -> str:
    """The readable name of the kernel variant a stage ran, when the backend can tell."""
    namer: Optional[Callable] = getattr(backend, "variant_name", None)
    if namer is None or stage == "backward":
        return f"{stage} kernels"
    return f"kernel {namer(stage, spec, mask_dtype)}"


GUARD = FirstContact()
