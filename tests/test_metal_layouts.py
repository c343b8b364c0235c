"""The Metal kernels read q, k, v, d_out and the saved output where they lie and write [B, N, H, D].

Run on the Metal simulator (MLX_FLASH_METAL_SIM=1 for this module), which hands a kernel built with
ensure_row_contiguous=False each input's own strides and its data at its offset, as MLX does
(mlx/backend/metal/custom_kernel.cpp: `set_vector_bytes(in.strides())`, `set_input_array` at
`a.offset()`). Checked against the float64 reference: mlx-lm's layouts (transposed [B, N, H, D]
views, the cotangent through `out.transpose(0, 2, 1, 3).reshape(B, N, -1)`), a head dim that is not
the last stride, offset slices, GQA, causal and array masks, each dtype; that out, dq, dk, dv are
[B, H, N, D] views of [B, N, H, D] buffers; and that no input is copied on the way to a kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from metal_compiler import require_metal_compiler  # noqa: E402
require_metal_compiler()

from attention_cases import DTYPES, environment, laid_out, to_numpy  # noqa: E402
from mlx_flash import flash_attention, metalsim, reference  # noqa: E402
from mlx_flash.api import takes_row_contiguous  # noqa: E402
from mlx_flash.backends import metal as metal_backend  # noqa: E402
from mlx_flash.metalsim import kernel as metalsim_kernel  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def simulated_metal():
    # Bounds-checked: a strided read that leaves its view (or an output write that leaves its
    # buffer) raises instead of reading a neighbour's data.
    with environment(MLX_FLASH_METAL_SIM="1", MLX_FLASH_METALSIM_CHECK="bounds", MLX_FLASH_METAL_FAMILY="m3"):
        yield


def make_input(rng, layout: str, b: int, h: int, n: int, d: int, dtype) -> mx.array:
    """A [b, h, n, d] array laid out as `layout` says.

    One of the shared LAYOUTS (tests/attention_cases.py: "row", "token_major" as mlx-lm's q, k, v,
    "columns" with last stride n, "offset" at an odd offset into wider rows), or
    "reversed": a [b, h, n, d] buffer read backwards along n (negative row stride);
    "broadcast": one batch's [1, h, n, d] broadcast over b (batch stride 0).
    """
    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    if layout == "reversed":
        return normal(b, h, n, d)[:, :, ::-1]
    if layout == "broadcast":
        return mx.broadcast_to(normal(1, h, n, d), (b, h, n, d))
    return laid_out(normal(b, h, n, d), layout)


class LayoutCase(NamedTuple):
    dtype: str
    layouts: tuple  # (q, k, v)
    mask: str = "none"  # "none", "causal", "bool", "additive"
    group: int = 1
    head_dim: int = 16
    q_len: int = 37
    kv_len: int = 45
    batch: int = 2
    kv_heads: int = 2
    seed: int = 0


CASES = [
    LayoutCase("float16", ("token_major",) * 3, "causal", group=2),
    LayoutCase("bfloat16", ("token_major",) * 3, "bool", group=2, q_len=45),
    LayoutCase("float32", ("columns", "columns", "columns"), "additive"),
    LayoutCase("float16", ("offset", "offset", "offset"), "none", group=3, kv_heads=1),
    LayoutCase("float32", ("token_major", "columns", "offset"), "causal", group=2, q_len=20),
    LayoutCase("bfloat16", ("columns", "offset", "token_major"), "additive", group=2),
    LayoutCase("float16", ("reversed", "broadcast", "reversed"), "causal", group=2),
    # An uncached head dim whose fp32 accumulators spill into the [B, N, H, D] outputs themselves.
    LayoutCase("float32", ("token_major",) * 3, "causal", group=2, head_dim=320, q_len=19, kv_len=24, batch=1),
]


def case_id(case: LayoutCase) -> str:
    return f"{case.dtype}-{'+'.join(case.layouts)}-{case.mask}-g{case.group}-d{case.head_dim}"


def make_mask(rng, case: LayoutCase, dtype):
    """The case's mask: a [B, 1, Nq, Nk] array made as a transposed view (a strided mask too)."""
    shape = (case.batch, 1, case.kv_len, case.q_len)
    if case.mask == "bool":
        return mx.array(rng.random(shape) < 0.7).transpose(0, 1, 3, 2)
    if case.mask == "additive":
        values = rng.standard_normal(shape).astype(np.float32)
        values[rng.random(shape) < 0.1] = -np.inf
        return mx.array(values).astype(dtype).transpose(0, 1, 3, 2)
    return None if case.mask == "none" else case.mask


def buffer_strides(x: mx.array):
    """The element strides of the buffer an array views (numpy reads MLX's own)."""
    n = np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    return tuple(s // n.itemsize for s in n.strides)


def token_major_strides(b: int, h: int, n: int, d: int):
    """The strides of a [b, h, n, d] view of a row-contiguous [b, n, h, d] buffer."""
    return (n * h * d, d, h * d, 1)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_layouts_match_reference(case: LayoutCase):
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]
    B, Hkv, Hq, Nq, Nk, D = case.batch, case.kv_heads, case.kv_heads * case.group, case.q_len, case.kv_len, \
        case.head_dim
    q = make_input(rng, case.layouts[0], B, Hq, Nq, D, dtype)
    k = make_input(rng, case.layouts[1], B, Hkv, Nk, D, dtype)
    v = make_input(rng, case.layouts[2], B, Hkv, Nk, D, dtype)
    mask = make_mask(rng, case, dtype)
    # mlx-lm's cotangent: of the [B, N, Hq * D] array its attention returns to the output projection.
    cotangent = mx.array(rng.standard_normal((B, Nq, Hq * D)).astype(np.float32)).astype(dtype)

    spec, mask4 = check_inputs(q, k, v, mask=mask)
    np_mask = None if mask4 is None else to_numpy(mask4)
    nq, nk, nv = (to_numpy(x) for x in (q, k, v))
    d_out = to_numpy(cotangent).reshape(B, Nq, Hq, D).transpose(0, 2, 1, 3)
    ref_out, ref_lse = reference.attention_forward(nq, nk, nv, spec, np_mask)
    ref_grads = reference.attention_backward(nq, nk, nv, d_out, spec, np_mask)

    out, lse = flash_attention(q, k, v, mask=mask, return_lse=True, backend="metal")
    assert out.shape == (B, Hq, Nq, D) and out.dtype == dtype
    assert buffer_strides(out) == token_major_strides(B, Hq, Nq, D), "out is not a view of a [B, N, H, D] buffer"
    merged = out.transpose(0, 2, 1, 3).reshape(B, Nq, -1)
    forward_tolerance = reference.FORWARD_TOLERANCE[case.dtype]
    assert reference.relative_error(to_numpy(merged), ref_out.transpose(0, 2, 1, 3).reshape(B, Nq, -1)) \
        < forward_tolerance
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.array(lse)), finite)
    assert reference.relative_error(np.array(lse)[finite], ref_lse[finite]) < forward_tolerance

    def loss(q, k, v):
        # The lse output is asked for and unused: its cotangent is MLX's zeros (a broadcast).
        o, _ = flash_attention(q, k, v, mask=mask, return_lse=True, backend="metal")
        merged = o.transpose(0, 2, 1, 3).reshape(B, Nq, -1)
        return (merged.astype(mx.float32) * cotangent.astype(mx.float32)).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype, name
        error = reference.relative_error(to_numpy(g), r)
        assert error < reference.GRADIENT_TOLERANCE[case.dtype], f"{name}: relative error {error}"


def test_backward_writes_token_major_gradients():
    """dq, dk, dv from the backend are [B, H, N, D] views of [B, N, H, D] buffers, and the dQ
    kernel reads the saved output and d_out through their strides (mlx-lm's layouts)."""
    rng = np.random.default_rng(1)
    B, Hkv, group, N, D = 2, 2, 2, 29, 16
    Hq = Hkv * group
    q, k, v = (make_input(rng, "token_major", B, h, N, D, mx.float16) for h in (Hq, Hkv, Hkv))
    d_out = make_input(rng, "token_major", B, Hq, N, D, mx.float16)
    spec, _ = check_inputs(q, k, v, mask="causal")
    backend = metal_backend.MetalBackend()
    out, lse = backend.forward(q, k, v, None, spec)
    dq, dk, dv, _ = backend.backward(q, k, v, None, out, lse, d_out, None, spec)
    for name, g, h in (("dq", dq, Hq), ("dk", dk, Hkv), ("dv", dv, Hkv)):
        assert buffer_strides(g) == token_major_strides(B, h, N, D), name
    ref = reference.attention_backward(*(to_numpy(x) for x in (q, k, v, d_out)), spec)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert reference.relative_error(to_numpy(g), r) < reference.GRADIENT_TOLERANCE["float16"], name


class Launch(NamedTuple):
    kernel: str
    ensure_row_contiguous: bool
    inputs: dict  # name -> (data address, element strides) as the kernel is handed them
    q_shape: tuple


@pytest.fixture
def launches(monkeypatch):
    """Every simulated launch's inputs: where each one's data lies and its strides."""
    seen = []
    call = metalsim_kernel.MetalKernel.__call__

    def recording(self, *, inputs, **kwargs):
        views = {}
        for name, x in zip(self.input_names, inputs):
            if isinstance(x, mx.array) and x.ndim == 4:
                n = np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
                views[name] = (n.ctypes.data, tuple(s // n.itemsize for s in n.strides))
        seen.append(Launch(self.name, self.ensure_row_contiguous, views, tuple(inputs[0].shape)))
        return call(self, inputs=inputs, **kwargs)

    monkeypatch.setattr(metalsim_kernel.MetalKernel, "__call__", recording)
    return seen


def address(x: mx.array) -> int:
    return np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).ctypes.data


def test_strided_inputs_reach_the_kernels_uncopied(launches):
    """mlx-lm's transposed views are handed to all three kernels as they are: the same data, their
    own strides (no copy by flash_attention, the VJP or the launch)."""
    assert not takes_row_contiguous(metal_backend.BACKEND)
    rng = np.random.default_rng(2)
    B, Hkv, group, N, D = 1, 2, 2, 24, 16
    Hq = Hkv * group
    q, k, v = (make_input(rng, "token_major", B, h, N, D, mx.bfloat16) for h in (Hq, Hkv, Hkv))
    cotangent = mx.array(rng.standard_normal((B, N, Hq * D)).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(q, k, v, cotangent)

    def loss(q, k, v):
        out = flash_attention(q, k, v, mask="causal", backend="metal")
        return (out.transpose(0, 2, 1, 3).reshape(B, N, -1) * cotangent).astype(mx.float32).sum()

    mx.eval(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))
    # (The first-contact guard's own launches, of its own small sizes, are left out.)
    launches = [launch for launch in launches if launch.q_shape == q.shape]
    kernels = {launch.kernel.split("_d")[0] for launch in launches}
    assert kernels == {"mlx_flash_forward", "mlx_flash_backward_query", "mlx_flash_backward_key_value"}
    token_major = {"q": token_major_strides(B, Hq, N, D), "k": token_major_strides(B, Hkv, N, D),
                   "v": token_major_strides(B, Hkv, N, D)}
    for launch in launches:
        assert launch.ensure_row_contiguous is False, launch.kernel
        for name, x in (("q", q), ("k", k), ("v", v)):
            assert launch.inputs[name] == (address(x), token_major[name]), (launch.kernel, name)
        # The cotangent reaches the backward kernels as a view of a [B, N, Hq * D] buffer (that of
        # mlx-lm's reshape), the saved output as the view of the forward's [B, N, Hq, D] buffer.
        for name in ("d_out", "o"):
            if name in launch.inputs:
                strides = launch.inputs[name][1]
                assert strides == token_major["q"], (launch.kernel, name, strides)
    # One cotangent buffer (MLX's product of the loss), read in place by both backward kernels.
    assert len({launch.inputs["d_out"][0] for launch in launches if "d_out" in launch.inputs}) == 1


# -- the simulator hands a kernel MLX's strides and offsets, and its bounds checks hold for views --

STRIDED_READ = """
    uint i = thread_position_in_grid.x;
    uint r = i / inp_shape[1];
    uint c = i % inp_shape[1];
    out[i] = inp[r * inp_strides[0] + c * inp_strides[1] + SHIFT - 1];  // SHIFT 1: the element itself
"""


def test_simulator_reads_views_at_their_offset_and_bounds_checks_them():
    kernel = metalsim.metal_kernel(name="strided_read", input_names=["inp"], output_names=["out"],
                                   source=STRIDED_READ, ensure_row_contiguous=False, check="bounds")
    base = mx.arange(8 * 12, dtype=mx.float32).reshape(8, 12)
    view = base[2:7, 3:9].T  # offset 27 elements, strides (1, 12)

    def run(offset):
        return kernel(inputs=[view], template=[("SHIFT", offset + 1)], grid=(view.size, 1, 1),
                      threadgroup=(32, 1, 1), output_shapes=[view.shape], output_dtypes=[mx.float32])[0]

    np.testing.assert_array_equal(np.array(run(0)), np.array(view))
    # One element past the view's last one (inside the base buffer, so it would read a neighbour's
    # data on a GPU) and one before its first: both outside the view, both caught.
    for offset in (1, -1):
        with pytest.raises(metalsim.MetalSimError, match="inp"):
            run(offset)
