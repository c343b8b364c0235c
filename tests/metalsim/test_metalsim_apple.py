"""Apple's own Metal kernels (MLX's shipped headers, unchanged) through metalsim, against numpy.

These check the simulator's fidelity on code known to compile and run on Apple GPUs: the
simdgroup_matrix GEMM and flash-attention forward (steel), sdpa_vector, softmax, logsumexp and
the all-reduce with SIMD shuffles and threadgroup memory.
"""

import mlx.core as mx
import numpy as np
import pytest

import apple_kernels as ak
from mlx_flash import metalsim
from mlx_flash.metalsim import includes

pytestmark = pytest.mark.skipif(includes.mlx_include_dir() is None,
                                reason="the installed mlx ships no Metal headers")


def f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def attention_ref(q, k, v, scale, causal=False):
    q, k, v = f64(q), f64(k), f64(v)
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        qL, kL = s.shape[-2:]
        s = np.where(np.arange(kL)[None] <= np.arange(qL)[:, None] + kL - qL, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def softmax_ref(x):
    x = f64(x)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype,looped,order,tol", [
    (mx.float32, False, "reversed", 1e-6), (mx.bfloat16, True, "forward", 1e-2)])
def test_softmax(rng, dtype, looped, order, tol):
    x = mx.array(rng.standard_normal((2, 4500 if looped else 500)) * 3).astype(dtype)
    y = ak.softmax(x, looped=looped, thread_order=order)
    np.testing.assert_allclose(f64(y), softmax_ref(x), atol=tol, rtol=tol)


def test_logsumexp(rng):
    x = mx.array(rng.standard_normal((4, 300)) * 3).astype(mx.float16)
    xf = f64(x)
    ref = np.log(np.exp(xf - xf.max(-1, keepdims=True)).sum(-1)) + xf.max(-1)
    np.testing.assert_allclose(f64(ak.logsumexp(x)), ref, rtol=2e-3)


@pytest.mark.parametrize("dtype,out_dtype", [(mx.int32, mx.int64), (mx.float32, mx.float32)])
def test_all_reduce(rng, dtype, out_dtype):
    x = rng.integers(-1000, 1000, size=(3, 1000)).astype(np.int32)
    y = ak.all_reduce_sum(mx.array(x).astype(dtype), out_dtype)
    np.testing.assert_array_equal(np.array(y), x.sum(1))


def test_sdpa_vector_gqa_bounds_checked(rng):
    q = mx.array(rng.standard_normal((1, 4, 1, 64)), mx.float32)
    k = mx.array(rng.standard_normal((1, 2, 70, 64)), mx.float32)
    v = mx.array(rng.standard_normal((1, 2, 70, 64)), mx.float32)
    o = ak.sdpa_vector(q, k, v, 0.125, check="bounds")
    np.testing.assert_allclose(f64(o), attention_ref(q, k, v, 0.125), atol=1e-5)


@pytest.mark.parametrize("dtype,qL,kL,causal,tol", [
    (mx.float16, 40, 70, True, 2e-3), (mx.float32, 32, 64, False, 1e-5)])
def test_steel_attention(rng, dtype, qL, kL, causal, tol):
    D = 64
    q = mx.array(rng.standard_normal((1, 2, qL, D))).astype(dtype)
    k = mx.array(rng.standard_normal((1, 1, kL, D))).astype(dtype)
    v = mx.array(rng.standard_normal((1, 1, kL, D))).astype(dtype)
    if dtype == mx.float32:  # 32 KB of threadgroup memory: MLX's float32 tiles are BK = 16
        o = ak.steel_attention(q, k, v, D ** -0.5, causal=causal, bk=16)
    else:
        o = ak.steel_attention(q, k, v, D ** -0.5, causal=causal)
    np.testing.assert_allclose(f64(o), attention_ref(q, k, v, D ** -0.5, causal), atol=tol)


@pytest.mark.parametrize("dtype,shape,tol", [
    (mx.float32, (50, 40, 70), 1e-5), (mx.bfloat16, (64, 32, 64), 5e-2)])
def test_steel_gemm(rng, dtype, shape, tol):
    M, Kd, N = shape
    a = mx.array(rng.standard_normal((M, Kd))).astype(dtype)
    b = mx.array(rng.standard_normal((Kd, N))).astype(dtype)
    d = ak.steel_gemm(a, b)
    ref = f64(a) @ f64(b)
    np.testing.assert_allclose(f64(d), ref, atol=tol * np.abs(ref).max())


def test_unknown_include_names_kernel_and_line():
    k = metalsim.metal_kernel(name="inc", input_names=["a"], output_names=["o"],
                              header='\n#include "mlx/backend/metal/kernels/nope.h"\n',
                              source="o[0] = a[0];")
    with pytest.raises(metalsim.MetalSimUnsupportedError,
                       match=r"'inc' header line 2: cannot find"):
        k(inputs=[mx.zeros(1)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
          output_dtypes=[mx.float32])


def test_missing_function_constant_names_it():
    with pytest.raises(metalsim.MetalSimUnsupportedError,
                       match=r"sdpa_vector.h line \d+: function constant 'has_mask' has no value"):
        ak.sdpa_vector(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 4, 32)), mx.zeros((1, 1, 4, 32)),
                       1.0, function_constants={})


def test_unknown_function_constant_is_an_error():
    with pytest.raises(ValueError, match=r"function_constants \['nope'\] are not declared"):
        ak.softmax(mx.zeros((1, 32)), function_constants={"nope": True})
