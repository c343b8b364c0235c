"""Attention test cases shared by every backend's tests: strategies and the reference check.

A `Case` is everything needed to build one random attention call. `check_case` runs it
through `mlx_flash.flash_attention` on a chosen backend, forward and backward (with a random
cotangent for out and, optionally, for lse), and compares O, lse, dQ, dK, dV against the
float64 reference at per-dtype tolerances.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from mlx_flash import flash_attention, reference
from mlx_flash.spec import check_inputs

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MASK_KINDS = ("none", "causal", "window", "causal_window", "bool", "additive")
# Memory layouts of the [B, H, N, D] inputs (the values are the same): row-contiguous; mlx-lm's
# (transposed views of [B, N, H, D] buffers); the last dim strided (views of [B, H, D, N] buffers);
# offset (views at an odd element offset into wider rows: misaligned, element-wise loads).
LAYOUTS = ("row", "token_major", "columns", "offset")


def laid_out(x: mx.array, layout: str) -> mx.array:
    """x's values in one of LAYOUTS."""
    if layout == "token_major":
        return mx.contiguous(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "columns":
        return mx.contiguous(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    if layout == "offset":
        wide = mx.concatenate([x[..., :1], x, x[..., :2]], axis=-1)
        return mx.contiguous(wide)[..., 1:x.shape[-1] + 1]
    if layout != "row":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return x

# Relative Frobenius error allowed, per dtype (shared with the self-check and the main job).
FORWARD_TOLERANCE, GRADIENT_TOLERANCE = reference.FORWARD_TOLERANCE, reference.GRADIENT_TOLERANCE


@contextlib.contextmanager
def environment(**values):
    """Set environment variables for the duration of the block."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class Case:
    batch: int = 1
    kv_heads: int = 1
    group: int = 1
    q_len: int = 16
    kv_len: int = 16
    head_dim: int = 16
    dtype: str = "float32"
    mask: str = "none"              # one of MASK_KINDS
    window: Tuple[int, int] = (-1, -1)
    softcap: Optional[float] = None
    mask_shape: Tuple[bool, bool, bool, bool] = (True, True, True, True)  # which dims are full (else 1)
    lse_gradient: bool = False      # also backpropagate a random cotangent through lse
    sinks: bool = False             # per-head attention sinks (a learnable logit, gradient checked)
    seed: int = 0
    layout: str = "row"             # how q, k, v and d_out lie in memory: one of LAYOUTS
    scale: Optional[float] = None   # None: 1 / sqrt(D); zero and negative scales are valid too

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group


def cases(max_batch=3, max_kv_heads=4, max_group=4, max_len=300, max_head_dim=320,
          dtypes=tuple(DTYPES), mask_kinds=MASK_KINDS, head_dims=None, sinks=(False, True), layouts=("row",)):
    """Hypothesis strategy over `Case`s (lengths and head dims drawn independently).

    head_dims: optional explicit list of head dims to sample from instead of 1..max_head_dim
    (kernel backends use it to bound the number of compiled variants).
    sinks: the choices of `Case.sinks` to draw from.
    layouts: the choices of `Case.layout` to draw from (LAYOUTS).
    """
    head_dim = st.sampled_from(head_dims) if head_dims else st.integers(1, max_head_dim)

    @st.composite
    def build(draw):
        mask = draw(st.sampled_from(mask_kinds))
        window = (-1, -1)
        if mask in ("window", "causal_window"):
            window = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
        return Case(
            batch=draw(st.integers(1, max_batch)),
            kv_heads=draw(st.integers(1, max_kv_heads)),
            group=draw(st.integers(1, max_group)),
            q_len=draw(st.integers(1, max_len)),
            kv_len=draw(st.integers(1, max_len)),
            head_dim=draw(head_dim),
            dtype=draw(st.sampled_from(dtypes)),
            mask=mask,
            window=window,
            softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 30.0]))),
            mask_shape=tuple(draw(st.booleans()) for _ in range(4)),
            lse_gradient=draw(st.booleans()),
            sinks=draw(st.sampled_from(sinks)),
            seed=draw(st.integers(0, 2**31 - 1)),
            layout=draw(st.sampled_from(layouts)),
            # a zero scale (uniform attention), a negative one (the row maximum of the scaled scores
            # is the minimum of the raw ones) and a large one (peaked rows)
            scale=draw(st.one_of(st.none(), st.sampled_from([0.0, -0.7, 2.0]))),
        )

    return build()


@dataclass
class Arrays:
    q: mx.array
    k: mx.array
    v: mx.array
    d_out: mx.array
    d_lse: mx.array
    mask: object = None
    sinks: object = None
    kwargs: dict = field(default_factory=dict)


def make_arrays(case: Case) -> Arrays:
    """Random inputs for a case (never all zeros), in the case's dtype."""
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]
    B, Hq, Hkv, Nq, Nk, D = case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    mask = None
    kwargs = {}
    if case.mask in ("causal", "causal_window"):
        mask = "causal"
    if case.mask in ("window", "causal_window"):
        kwargs["window_size"] = case.window
    full = (B, Hq, Nq, Nk)
    shape = tuple(n if keep else 1 for n, keep in zip(full, case.mask_shape))
    if case.mask == "bool":
        # Mostly kept, some rows or columns fully dropped (rows that see no key must give 0).
        mask = mx.array(rng.random(shape) < rng.uniform(0.3, 0.95))
    elif case.mask == "additive":
        values = rng.standard_normal(shape).astype(np.float32) * 2
        values[rng.random(shape) < 0.1] = -np.inf
        mask = mx.array(values).astype(dtype)
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.scale is not None:
        kwargs["scale"] = case.scale
    # Sinks of a few units, as learned ones are: comparable to the scores, so p_sink spans (0, 1).
    sinks = normal(Hq) * 2 if case.sinks else None
    q, k, v, d_out = (laid_out(normal(B, h, n, D), case.layout)
                      for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk), (Hq, Nq)))
    return Arrays(q=q, k=k, v=v, d_out=d_out, d_lse=mx.array(rng.standard_normal((B, Hq, Nq)).astype(np.float32)),
                  mask=mask, sinks=sinks, kwargs=kwargs)


def cotangent_loss(out: mx.array, d_out: mx.array, layout: str) -> mx.array:
    """sum(out * d_out) in fp32, arranged so that out's cotangent (d_out) reaches the attention's
    backward in `layout`: the product is taken on the layout's buffer, whose VJP gives back a view."""
    f32 = mx.float32
    if layout == "token_major":
        return (out.transpose(0, 2, 1, 3).astype(f32) * d_out.transpose(0, 2, 1, 3).astype(f32)).sum()
    if layout == "columns":
        return (out.transpose(0, 1, 3, 2).astype(f32) * d_out.transpose(0, 1, 3, 2).astype(f32)).sum()
    if layout == "offset":
        def wide(x):
            return mx.concatenate([mx.zeros(x.shape[:-1] + (1,), x.dtype), x,
                                   mx.zeros(x.shape[:-1] + (2,), x.dtype)], axis=-1)
        return (wide(out).astype(f32) * wide(d_out).astype(f32)).sum()
    return (out.astype(f32) * d_out.astype(f32)).sum()


def relative_error(x: np.ndarray, ref: np.ndarray) -> float:
    """mlx_flash.reference.relative_error, with the shape and NaN checks failing the test loudly."""
    x = np.asarray(x, dtype=np.float64)
    assert x.shape == ref.shape, f"shape {x.shape} != reference {ref.shape}"
    assert not np.isnan(x).any(), "NaN in result"
    return reference.relative_error(x, ref)

def to_numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if x.dtype != mx.bool_ else np.array(x)


def check_case(case: Case, backend: str = "mlx", gradients: bool = True,
               forward_tolerance=None, gradient_tolerance=None) -> dict:
    """Run `case` on `backend` and assert O, lse (and dQ, dK, dV, d_sinks) match the float64 reference.

    Returns the measured relative errors by name.
    """
    a = make_arrays(case)
    spec, mask4 = check_inputs(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, **a.kwargs)
    np_mask = None if mask4 is None else to_numpy(mask4)
    np_sinks = None if a.sinks is None else to_numpy(a.sinks)
    q, k, v = (to_numpy(x) for x in (a.q, a.k, a.v))
    ref_out, ref_lse = reference.attention_forward(q, k, v, spec, np_mask, sinks=np_sinks)
    f_tol = forward_tolerance or FORWARD_TOLERANCE[case.dtype]
    g_tol = gradient_tolerance or GRADIENT_TOLERANCE[case.dtype]

    out, lse = flash_attention(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, return_lse=True, backend=backend,
                               **a.kwargs)
    assert out.dtype == a.q.dtype and out.shape == a.q.shape
    assert lse.dtype == mx.float32 and lse.shape == a.q.shape[:3]
    errors = {"out": relative_error(to_numpy(out), ref_out)}
    lse_np = np.array(lse)
    assert np.array_equal(np.isneginf(lse_np), np.isneginf(ref_lse)), "rows with no visible key differ"
    finite = np.isfinite(ref_lse)
    errors["lse"] = relative_error(lse_np[finite], ref_lse[finite]) if finite.any() else 0.0
    if gradients:
        d_lse = mx.where(mx.isinf(lse), 0.0, a.d_lse) if case.lse_gradient else None

        def loss(q_, k_, v_, sinks_=None):
            o, l = flash_attention(q_, k_, v_, mask=a.mask, sinks=sinks_, return_lse=True, backend=backend,
                                   **a.kwargs)
            total = cotangent_loss(o, a.d_out, case.layout)
            if d_lse is not None:
                total = total + (mx.where(mx.isinf(l), 0.0, l) * d_lse).sum()
            return total

        if a.sinks is None:
            grads = mx.grad(loss, argnums=(0, 1, 2))(a.q, a.k, a.v)
        else:
            grads = mx.grad(loss, argnums=(0, 1, 2, 3))(a.q, a.k, a.v, a.sinks)
        ref_grads = reference.attention_backward(q, k, v, to_numpy(a.d_out), spec, np_mask,
                                                 d_lse=None if d_lse is None else np.array(d_lse),
                                                 sinks=np_sinks)
        for name, g, r in zip(("dq", "dk", "dv", "d_sinks"), grads, ref_grads):
            assert g.dtype == a.q.dtype
            errors[name] = relative_error(to_numpy(g), r)
    limits = {n: (f_tol if n in ("out", "lse") else g_tol) for n in errors}
    bad = {n: e for n, e in errors.items() if not e <= limits[n]}
    assert not bad, f"{case} on backend {backend!r}: errors {bad} over tolerance (all: {errors})"
    return errors
