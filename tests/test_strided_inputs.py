"""Strided q / k / v / d_out (mlx-lm's layouts) on backends that read row-contiguous arrays only.

The shipped backends read their inputs where they lie (the kernels through the strides MLX passes
them: tests/test_cuda.py and tests/test_metal_layouts.py check that). A backend that declares
`row_contiguous_inputs` (kernels launched with ensure_row_contiguous=True, which copies a strided
input at every launch) is handed q, k, v made contiguous once, and its VJP gets d_out made
contiguous once, so the forward and the three backward launches share one copy.
Checked here with stand-ins on the CPU: a backend wrapping "mlx" that declares row-contiguous
inputs (gradients against the float64 reference), and kernel stubs that copy per launch as
ensure_row_contiguous does (peak memory of a backward with mlx-lm's layouts).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import flash_attention, reference
from mlx_flash.api import takes_row_contiguous
from mlx_flash.backends import get_backend
from mlx_flash.spec import check_inputs

B, HQ, HKV, N, D = 1, 4, 1, 64, 32
# A model of the kernels on the CPU device (stand-ins and stubs): on a CUDA machine "auto" would
# pick the GPU, whose fp32 matmuls round through tf32 and whose buffers are freed on another clock.
pytestmark = pytest.mark.usefixtures("on_cpu")


class RowContiguousMLX:
    """The "mlx" backend, declared to read row-contiguous inputs only (as the kernels do)."""

    name = "row-contiguous-mlx"
    row_contiguous_inputs = True

    def __init__(self):
        self._inner = get_backend("mlx")

    def unavailable_reason(self, device):
        return None

    def unsupported_reason(self, spec):
        return None

    def forward(self, *args, **kwargs):
        return self._inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._inner.backward(*args, **kwargs)


def mlx_lm_layouts(dtype=mx.float32, n=N, hq=HQ, hkv=HKV, d=D, seed=0):
    """q, k row-contiguous [B, H, N, D] (as RoPE leaves them on the GPU), v a transposed view of a
    [B, N, H, D] projection (as mlx-lm passes it), and the cotangent's [B, N, Hq * D] buffer."""
    key = mx.random.key(seed)
    kq, kk, kv, kc = mx.random.split(key, 4)
    q = mx.random.normal((B, hq, n, d), key=kq).astype(dtype)
    k = mx.random.normal((B, hkv, n, d), key=kk).astype(dtype)
    v = mx.random.normal((B, n, hkv, d), key=kv).astype(dtype).transpose(0, 2, 1, 3)
    cotangent = mx.random.normal((B, n, hq * d), key=kc).astype(dtype)
    return q, k, v, cotangent


def block_loss(backend):
    """The attention part of an mlx-lm Llama block: attention, then mlx-lm's transpose + reshape."""

    def loss(q, k, v, cotangent):
        out = flash_attention(q, k, v, mask="causal", backend=backend)
        return (out.transpose(0, 2, 1, 3).reshape(B, out.shape[2], -1) * cotangent).sum()

    return loss


def test_takes_row_contiguous_rule():
    for name in ("mlx", "metal", "cuda"):
        assert not takes_row_contiguous(get_backend(name)), name
    assert takes_row_contiguous(RowContiguousMLX())
    undeclared = type("Undeclared", (), {"name": "custom"})()
    assert not takes_row_contiguous(undeclared)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_gradients_match_reference(causal):
    q, k, v, cotangent = mlx_lm_layouts()
    mask = "causal" if causal else None
    spec, _ = check_inputs(q, k, v, mask=mask)
    d_out = cotangent.reshape(B, N, HQ, D).transpose(0, 2, 1, 3)

    def loss(q, k, v):
        out = flash_attention(q, k, v, mask=mask, backend=RowContiguousMLX())
        return (out.transpose(0, 2, 1, 3).reshape(B, N, -1) * cotangent).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    out = flash_attention(q, k, v, mask=mask, backend=RowContiguousMLX())
    ref_out, _ = reference.attention_forward(np.array(q), np.array(k), np.array(v), spec)
    ref_grads = reference.attention_backward(np.array(q), np.array(k), np.array(v), np.array(d_out), spec)
    assert reference.relative_error(np.array(out), ref_out) < 1e-5
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        assert reference.relative_error(np.array(g), r) < 1e-5, name


class KernelStubs:
    """Kernels that allocate exactly their outputs (values are placeholders), with the copies
    ensure_row_contiguous=True makes of strided inputs at every launch when `copies` is True."""

    name = "kernel-stubs"

    def __init__(self, copies: bool, row_contiguous_inputs: bool):
        self.copies = copies
        self.row_contiguous_inputs = row_contiguous_inputs

    def unavailable_reason(self, device):
        return None

    def unsupported_reason(self, spec):
        return None

    def _launch(self, inputs, shapes, dtypes):
        if self.copies:
            inputs = [mx.contiguous(x) for x in inputs]
        # Each output depends on every input (so a copy lives until its launch), through one element.
        dep = sum(x[(0,) * (x.ndim - 1)][:1].astype(mx.float32).sum() for x in inputs) * 0
        return [mx.contiguous(mx.broadcast_to(dep.astype(d), s)) for s, d in zip(shapes, dtypes)]

    def forward(self, q, k, v, mask, spec, sinks=None):
        return tuple(self._launch([q, k, v], [q.shape, q.shape[:3]], [q.dtype, mx.float32]))

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=None):
        delta, lse2 = self._launch([out, d_out, lse], [lse.shape] * 2, [mx.float32] * 2)
        dq, = self._launch([q, k, v, d_out, lse2, delta], [q.shape], [q.dtype])
        dk, dv = self._launch([q, k, v, d_out, lse2, delta], [k.shape, v.shape], [k.dtype, v.dtype])
        return dq, dk, dv, None


def step_peak(backend, n=1024) -> int:
    """Peak memory above the inputs of value_and_grad of `block_loss` (bf16, mlx-lm layouts)."""
    q, k, v, cotangent = mlx_lm_layouts(mx.bfloat16, n=n, hq=16, hkv=4, d=128)
    mx.eval(q, k, v, cotangent)
    step = mx.value_and_grad(block_loss(backend), argnums=(0, 1, 2))
    mx.eval(step(q, k, v, cotangent))  # warm up
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(step(q, k, v, cotangent))
    return mx.get_peak_memory() - base


def test_one_copy_of_strided_inputs_per_call():
    """With per-launch copies the backward held two copies of the strided d_out (and of v) at once
    (measured: 24.1 MiB above the inputs here); made contiguous once, 19.1 MiB: that of kernels
    that take strides (18.1 MiB) plus the one copy of v, whose strided buffer this test keeps
    alive (in mlx-lm nothing else holds it, and the copy takes its place). The CPU stream frees
    buffers when its worker finishes a task, so one run's peak takes one of two values, the lower
    when buffers were freed early (seen, 6 runs each: per launch 23.1-24.1, once 14.0-19.1, strided
    14.0-18.1 MiB; which one is more frequent changes with the machine's load: a later 15
    runs gave once 19.1 x 11, 18.1 x 3, 14.1 x 1 and strided 18.1 x 14, 14.1 x 1). So neither the
    lowest nor the highest of 6 runs alone compares like with like: each failed once, when one
    kind never met the mode the other met. Once against strided holds if it holds for the lowest
    or for the highest of the runs; a copy too many (2 MiB and more) breaks both."""
    per_launch, once, strided = ([step_peak(KernelStubs(copies, contiguous)) for _ in range(6)]
                                 for copies, contiguous in ((True, False), (True, True), (False, False)))
    d_out_bytes, v_bytes = 16 * 1024 * 128 * 2, 4 * 1024 * 128 * 2
    slack = v_bytes + d_out_bytes // 4
    assert min(once) <= min(strided) + slack or max(once) <= max(strided) + slack, (once, strided)
    assert min(per_launch) >= min(once) + d_out_bytes // 2, (per_launch, once)


def test_strided_inputs_under_compile_and_grad():
    """The contiguous copies and the VJP's d_out copy trace under mx.compile (mlx-lm's training step)."""
    q, k, v, cotangent = mlx_lm_layouts()
    backend = RowContiguousMLX()

    def loss(q, k, v):
        out = flash_attention(q, k, v, mask="causal", backend=backend)
        return (out.transpose(0, 2, 1, 3).reshape(B, N, -1) * cotangent).sum()

    compiled = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    eager = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for c, e in zip(compiled, eager):
        assert mx.array_equal(c, e)
