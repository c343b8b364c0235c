"""Float64 NumPy reference of exactly the semantics mlx-flash implements.

Used by the tests and by `python -m mlx_flash` to check a backend. It materializes the
full score matrix, so keep it to test sizes.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from .spec import AttentionSpec

# Relative Frobenius error allowed against this reference, by input dtype (the test suite's,
# `python -m mlx_flash`'s and the first-use self-check's limits): fp32 arithmetic lands far below
# 1e-4; fp16/bf16 round inputs, P and dS to 11 / 8 mantissa bits.
FORWARD_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
GRADIENT_TOLERANCE = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 6e-2}

# MLX runs float32 matmul-family operations at reduced precision by default where the hardware has
# matrix units for it (MLX_ENABLE_TF32, default 1: TF32 on NVIDIA tensor cores, M5's neural
# accelerators; MLX's docs, "Numerical Precision"). A float32 result computed through them (the
# "mlx" backend, mx.fast's fallback, MLX's unfused attention) carries their 10-bit mantissa, as
# fp16 does: on an H200 the "mlx" backend's float32 output is 4e-4 from this reference, 4x
# float32's limit. Such a result is held to float16's limits (limits(); the caller says whether
# its path computed through MLX's matmuls, float32_matmuls_reduced() whether they round here).
REDUCED_FLOAT32_LIMITS = "float16"


def limits(dtype: str, through_reduced_matmuls: bool = False) -> Tuple[float, float]:
    """(forward, gradient) relative-error limits for results of input dtype `dtype` (a name:
    "float32", "float16", "bfloat16"); through_reduced_matmuls: a float32 result computed
    through matrix products that round to fewer bits (see REDUCED_FLOAT32_LIMITS)."""
    key = REDUCED_FLOAT32_LIMITS if dtype == "float32" and through_reduced_matmuls else dtype
    return FORWARD_TOLERANCE[key], GRADIENT_TOLERANCE[key]


def reduced_float32(dtype: str, through_mlx_operations: bool) -> bool:
    """Whether a result of input dtype `dtype` is float32 computed through reduced-precision
    matmuls: its path ran MLX's own operations (the "mlx" backend, a fallback to it or to
    mx.fast: the caller knows) on the default device, whose float32 matmuls round to fewer bits."""
    return dtype == "float32" and through_mlx_operations and float32_matmuls_reduced()


_REDUCED: dict = {}


def float32_matmuls_reduced(device=None) -> bool:
    """Whether MLX's float32 matrix products round to fewer bits than float32 on `device` (default:
    the default device), measured once per device and process: a batched product of unit normals
    (4 x 64 x 128 by 4 x 128 x 64) against float64, relative error above 1e-5 (float32: ~1e-7;
    TF32: ~3e-4)."""
    import mlx.core as mx

    device = mx.default_device() if device is None else device
    key = str(device)
    if key not in _REDUCED:
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((4, 64, 128)), rng.standard_normal((4, 128, 64))
        with mx.stream(device):
            product = mx.matmul(mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32)))
            mx.eval(product)
        _REDUCED[key] = relative_error(np.array(product), a.astype(np.float32).astype(np.float64)
                                       @ b.astype(np.float32).astype(np.float64)) > 1e-5
    return _REDUCED[key]


def relative_error(x, ref) -> float:
    """||x - ref|| / max(||ref||, 0.01 sqrt(size)) in float64 over the reference's finite entries.

    The floor is 1% of the norm of an all-ones array: inputs are unit-scale normals, so a
    reference that is exactly zero (dQ where each row sees one key) is judged by the RMS of the
    absolute error instead of dividing by ~0. A non-finite pattern (NaN, inf) that differs from
    the reference's is inf.
    """
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if x.shape != ref.shape or not np.array_equal(np.isfinite(x), finite):
        return math.inf
    x, ref = x[finite], ref[finite]
    if x.size == 0:
        return 0.0
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 0.01 * np.sqrt(x.size)))


def visible(spec: AttentionSpec) -> np.ndarray:
    """Bool [Nq, Nk]: which keys each query may see under causal / window (True = visible)."""
    i = np.arange(spec.q_len)[:, None] + spec.diagonal
    j = np.arange(spec.kv_len)[None, :]
    keep = np.ones((spec.q_len, spec.kv_len), dtype=bool)
    if spec.causal:
        keep &= j <= i
    if spec.window is not None:
        left, right = spec.window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    return keep


def _scores(q, k, spec, mask):
    """Returns (final scores S [B,Hq,Nq,Nk] with -inf where masked, tanh of softcap or None)."""
    group = spec.group
    kk = np.repeat(k, group, axis=1) if group > 1 else k
    s = np.einsum("bhid,bhjd->bhij", q, kk) * spec.scale
    t = None
    if spec.softcap is not None:
        t = np.tanh(s / spec.softcap)
        s = spec.softcap * t
    keep = np.broadcast_to(visible(spec), s.shape)
    if mask is not None:
        if mask.dtype == np.bool_:
            keep = keep & np.broadcast_to(mask, s.shape)
        else:
            s = s + mask
    s = np.where(keep, s, -np.inf)
    return s, t


def _softmax(s, sinks=None):
    """Row softmax P and lse of scores with -inf where masked; rows with no key: P = 0, lse = -inf.

    sinks ([Hq] or None): one extra score per head with no value, as MLX concatenates it to the
    scores; P then covers the keys only (its rows sum to 1 - p_sink) and lse includes the sink.
    """
    if sinks is not None:
        column = np.broadcast_to(sinks[None, :, None, None], (*s.shape[:-1], 1))
        p, lse = _softmax(np.concatenate([column, s], axis=-1))
        return p[..., 1:], lse
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = s.max(axis=-1, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m_safe)
        l = p.sum(axis=-1, keepdims=True)
        seen = l > 0
        lse = np.where(seen, np.log(np.where(seen, l, 1.0)) + m_safe, -np.inf)[..., 0]
        return np.where(seen, p / np.where(seen, l, 1.0), 0.0), lse


def _to64(x):
    return None if x is None else np.asarray(x).astype(np.float64) if np.asarray(x).dtype != np.bool_ else np.asarray(x)


def attention_forward(q, k, v, spec: AttentionSpec, mask=None, sinks=None):
    """Returns (out [B,Hq,Nq,Dv], lse [B,Hq,Nq]) in float64. Inputs: numpy arrays of any float dtype.

    sinks: optional [Hq] sink logits (see `_softmax`).
    """
    q, k, v, mask, sinks = _to64(q), _to64(k), _to64(v), _to64(mask), _to64(sinks)
    s, _ = _scores(q, k, spec, mask)
    p, lse = _softmax(s, sinks)
    group = spec.group
    vv = np.repeat(v, group, axis=1) if group > 1 else v
    out = np.einsum("bhij,bhjd->bhid", p, vv)
    return out, lse


def attention_backward(q, k, v, d_out, spec: AttentionSpec, mask=None, d_lse=None, sinks=None):
    """Analytic gradients (dq, dk, dv) in float64, with GQA heads summed onto their kv head;
    (dq, dk, dv, d_sinks) when sinks are given.

    d_lse, if given, is the cotangent of the lse output (dlse/ds = softmax). With sinks, the
    sink is one more softmax column with no value: its score gradient is p_sink (0 - D_i), and
    the sink logit of head h collects it over every row of h (batches and queries).
    """
    q, k, v, d_out, mask, sinks = _to64(q), _to64(k), _to64(v), _to64(d_out), _to64(mask), _to64(sinks)
    s, t = _scores(q, k, spec, mask)
    p, lse = _softmax(s, sinks)
    group = spec.group
    kk = np.repeat(k, group, axis=1) if group > 1 else k
    vv = np.repeat(v, group, axis=1) if group > 1 else v
    out = np.einsum("bhij,bhjd->bhid", p, vv)
    dv = np.einsum("bhij,bhid->bhjd", p, d_out)
    dp = np.einsum("bhid,bhjd->bhij", d_out, vv)
    row = (d_out * out).sum(-1, keepdims=True)
    if d_lse is not None:
        row = row - _to64(d_lse)[..., None]
    ds = p * (dp - row)
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = np.einsum("bhij,bhjd->bhid", ds, kk) * spec.scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * spec.scale
    if group > 1:
        B, Hq = dk.shape[:2]
        dk = dk.reshape(B, Hq // group, group, *dk.shape[2:]).sum(2)
        dv = dv.reshape(B, Hq // group, group, *dv.shape[2:]).sum(2)
    if sinks is None:
        return dq, dk, dv
    p_sink = np.exp(sinks[None, :, None] - lse)
    d_sinks = -(p_sink * row[..., 0]).sum(axis=(0, 2))
    return dq, dk, dv, d_sinks
