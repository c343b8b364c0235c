"""bfloat16 before Metal 3.1 (macOS 13): metalsim's metal_version="3.0" compiles bfloat16_t as
MLX's portable 16-bit struct (MLX <= 0.29) and rejects the native bfloat types; the project's
kernels run unchanged in that mode with the same numbers as with native bfloat."""


import mlx.core as mx
import numpy as np
import pytest

from attention_cases import Case, check_case, environment, make_arrays
from mlx_flash import flash_attention, metalsim

MIXED = """
uint i = thread_position_in_grid.x;
T a = x[i], b = y[i];
T s = a * b + a;
float f = a * 0.5f + half(1) * b;
T m = metal::max(a, b);
T e = metal::exp(a);
T r = simd_sum(a);
threadgroup T tile[32];
tile[i] = s;
threadgroup_barrier(mem_flags::mem_threadgroup);
T acc = T(0);
acc += tile[31 - i];
acc *= 2;
out[i] = T(float(acc) + f) + m * e - r / T(32) + Limits<T>::finite_min * T(0)
         + (a > b ? T(1) : T(0));
"""


def test_portable_bfloat16_matches_native_bitwise():
    k = metalsim.metal_kernel(name="bf_mixed", input_names=["x", "y"], output_names=["out"],
                              source=MIXED)
    rng = np.random.default_rng(0)
    x, y = (mx.array(rng.standard_normal(32).astype(np.float32)).astype(mx.bfloat16)
            for _ in range(2))
    outs = {}
    for v in ("3.0", "3.1"):
        k.metal_version = v
        outs[v] = k(inputs=[x, y], template=[("T", mx.bfloat16)], grid=(32, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.bfloat16])[0]
    bits = {v: np.array(o.view(mx.uint16)) for v, o in outs.items()}
    assert np.array_equal(bits["3.0"], bits["3.1"])


@pytest.mark.parametrize("name", ["bfloat", "bfloat4", "simdgroup_bfloat8x8"])
def test_native_bfloat_needs_metal_3_1(name):
    src = f"uint i = thread_position_in_grid.x;\n{name} v;\nout[i] = x[i];"
    k = metalsim.metal_kernel(name="bf_native", input_names=["x"], output_names=["out"],
                              source=src, metal_version="3.0")
    with pytest.raises(metalsim.MetalSimLanguageError,
                       match=rf"'bf_native' source line 2: '{name}' \(compiling for Metal 3.0\).*"
                             r"Metal 3.1 \(macOS 14\)"):
        k(inputs=[mx.zeros(4)], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])


def test_metal_version_is_validated():
    with pytest.raises(ValueError, match="metal_version"):
        metalsim.metal_kernel(name="v", input_names=["x"], output_names=["o"], source="",
                              metal_version="13.5")


def _run(case: Case):
    a = make_arrays(case)

    def loss(q, k, v):
        o, lse = flash_attention(q, k, v, mask=a.mask, return_lse=True, backend="metal", **a.kwargs)
        return (o.astype(mx.float32) * a.d_out.astype(mx.float32)).sum() + mx.where(
            mx.isinf(lse), 0.0, lse).sum(), (o, lse)

    (_, (o, lse)), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(a.q, a.k, a.v)
    return [np.array(x.astype(mx.float32)) for x in (o, lse, *grads)]


# A bf16 case of the project's three kernels with an additive bf16 mask (read through
# bfloat16_t), softcap and GQA; one case keeps the six extra compiles (~25 s cold) bounded.
CASES = [
    ("m1", Case(head_dim=33, q_len=20, kv_len=37, dtype="bfloat16", mask="additive", group=2,
                softcap=5.0)),
]


@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-d{c.head_dim}" for f, c in CASES])
def test_our_bf16_kernels_on_metal_3_0(family, case):
    with environment(MLX_FLASH_METAL_SIM="1", MLX_FLASH_METAL_FAMILY=family):
        with environment(MLX_FLASH_METALSIM_METAL_VERSION="3.0"):
            check_case(case, backend="metal")  # against the float64 reference
            portable = _run(case)
        with environment(MLX_FLASH_METALSIM_METAL_VERSION="3.1"):
            native = _run(case)
    for p, n in zip(portable, native):
        np.testing.assert_array_equal(p, n)
