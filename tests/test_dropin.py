"""`mlx_flash.scaled_dot_product_attention` follows `mx.fast.scaled_dot_product_attention`'s rules:
its signature, q/k/v dtype promotion, integer and other mask dtypes, `force_fused`, and the error
types MLX raises. Each case runs both and compares (MLX on the CPU is the oracle)."""
import inspect

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
from mlx_flash import flash_attention, scaled_dot_product_attention

from attention_cases import to_numpy


def rand(*shape, dtype=mx.float32, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


Q, K, V = rand(1, 4, 6, 16, seed=1), rand(1, 2, 9, 16, seed=2), rand(1, 2, 9, 16, seed=3)
F16, BF16 = mx.float16, mx.bfloat16


def both(q, k, v, **kwargs):
    ours = scaled_dot_product_attention(q, k, v, scale=0.25, **kwargs)
    mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, **kwargs)
    return ours, mlx


def test_signature_is_mlx_signature():
    """Same parameters, kinds and defaults as the installed MLX (read from its docstring)."""
    ours = inspect.signature(scaled_dot_product_attention)
    assert list(ours.parameters) == ["q", "k", "v", "scale", "mask", "sinks", "force_fused", "stream"]
    mlx_line = mx.fast.scaled_dot_product_attention.__doc__.split("\n", 1)[0]
    for name, parameter in ours.parameters.items():
        assert f"{name}:" in mlx_line
        if parameter.default is not inspect.Parameter.empty:
            assert f"{name}: " in mlx_line and f"= {parameter.default}" in mlx_line.split(f"{name}:", 1)[1].split(",")[0]


@pytest.mark.parametrize("dtypes", [(F16, mx.float32, mx.float32), (mx.float32, F16, F16), (BF16, F16, F16),
                                    (F16, BF16, F16), (F16, F16, F16)])
def test_mixed_dtypes_promote_as_mlx(dtypes):
    q, k, v = (x.astype(d) for x, d in zip((Q, K, V), dtypes))
    ours, mlx = both(q, k, v, mask="causal")
    assert ours.dtype == mlx.dtype
    assert np.allclose(to_numpy(ours), to_numpy(mlx), atol=1e-2 if ours.dtype != mx.float32 else 1e-5)


def test_mixed_dtypes_gradient_comes_back_in_each_input_dtype():
    q, k, v = Q.astype(mx.float32), K.astype(F16), V.astype(F16)
    grads = mx.grad(lambda q_, k_, v_: scaled_dot_product_attention(q_, k_, v_, scale=0.25).sum(),
                    argnums=(0, 1, 2))(q, k, v)
    assert [g.dtype for g in grads] == [mx.float32, F16, F16]


@pytest.mark.parametrize("dtype, mask_dtype", [(mx.float32, mx.int32), (mx.float32, mx.uint8), (F16, mx.int8),
                                               (F16, mx.int64), (mx.float32, F16), (BF16, BF16)])
def test_integer_and_other_mask_dtypes_are_additive_as_mlx(dtype, mask_dtype):
    mask = mx.array(np.random.default_rng(4).integers(-3, 3, (6, 9))).astype(mask_dtype)
    ours, mlx = both(Q.astype(dtype), K.astype(dtype), V.astype(dtype), mask=mask)
    assert ours.dtype == mlx.dtype
    assert np.allclose(to_numpy(ours), to_numpy(mlx), atol=1e-5 if dtype == mx.float32 else 2e-2)


@pytest.mark.parametrize("force_fused", [False, True])
def test_force_fused_is_accepted(force_fused):
    ours = scaled_dot_product_attention(Q, K, V, scale=0.25, force_fused=force_fused)
    assert np.allclose(np.array(ours), np.array(mx.fast.scaled_dot_product_attention(Q, K, V, scale=0.25)), atol=1e-5)


@pytest.mark.parametrize("args, kwargs", [
    ((Q.astype(mx.int32), K.astype(mx.int32), V.astype(mx.int32)), {}),           # non-floating
    ((Q.astype(F16), K.astype(F16), V.astype(F16)), {"mask": mx.zeros((6, 9))}),   # mask dtype
    ((Q, K, V), {"mask": mx.zeros((6, 9), mx.complex64)}),
    ((Q.astype(F16), K.astype(F16), V.astype(F16)), {"sinks": mx.zeros((4,))}),    # sinks dtype
    ((Q, K, V), {"sinks": mx.zeros((5,))}),
    ((Q, K, V), {"sinks": mx.zeros(())}),
    ((Q, K, V), {"mask": "upper"}),
    ((Q, K, V), {"mask": mx.zeros((1, 1, 1, 6, 9))}),
    ((Q, K, V), {"mask": mx.zeros((3, 6, 9))}),
    ((Q[0], K, V), {}),
    ((Q, K[..., :8], V), {}),
    ((rand(1, 3, 6, 16), K, V), {}),
    ((rand(2, 4, 6, 16), K, V), {}),
    ((Q, K, V), {"sinks": [0.0] * 4}),
    ((np.zeros((1, 4, 6, 16), np.float32), K, V), {}),
])
def test_errors_have_mlx_types(args, kwargs):
    """Whatever MLX raises for a call, we raise the same exception type."""
    with pytest.raises(Exception) as theirs:
        mx.eval(mx.fast.scaled_dot_product_attention(*args, scale=0.25, **kwargs))
    with pytest.raises(theirs.type):
        scaled_dot_product_attention(*args, scale=0.25, **kwargs)


@pytest.mark.usefixtures("on_cpu")  # MLX runs float64 on the CPU only (on a GPU both raise MLX's error)
def test_float64_is_handed_to_mlx_and_counted():
    mlx_flash.reset_fallback_counts()
    with pytest.warns(mlx_flash.FallbackWarning):
        ours = scaled_dot_product_attention(Q.astype(mx.float64), K, V, scale=0.25)
    assert ours.dtype == mx.float64 and sum(mlx_flash.fallback_counts().values()) == 1
    mlx_flash.reset_fallback_counts()


def test_flash_attention_keeps_strict_checks():
    """Where MLX is lenient, flash_attention asks for what is meant: one dtype, bool or float masks."""
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(Q, K.astype(F16), V)
    with pytest.raises(TypeError, match="mask"):
        flash_attention(Q, K, V, mask=mx.zeros((6, 9), mx.int32))


@pytest.mark.parametrize("head_dim", [72, 96, 256])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_head_dims_and_caches_sliced_as_mlx_lm_hands_them_over(head_dim, mask):
    """K/V sliced out of a longer preallocated cache (strided views, what mlx-lm passes), ragged
    lengths, the head dims MLX has fused kernels for, each mask kind: equal to MLX."""
    rng = np.random.default_rng(head_dim)
    q_len, kv_len, cache_len = 19, 33, 48
    q = mx.array(rng.standard_normal((1, 4, q_len, head_dim)).astype(np.float32))
    k_cache, v_cache = (mx.array(rng.standard_normal((1, 2, cache_len, head_dim)).astype(np.float32) * 100)
                        for _ in range(2))
    k_cache[:, :, :kv_len] = rand(1, 2, kv_len, head_dim, seed=1)
    v_cache[:, :, :kv_len] = rand(1, 2, kv_len, head_dim, seed=2)
    k, v = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    if mask == "bool":
        mask = mx.array(rng.random((1, 4, q_len, kv_len)) < 0.7)
    elif mask == "additive":
        mask = mx.array(rng.standard_normal((q_len, kv_len)).astype(np.float32))
    ours, mlx = both(q, k, v, mask=mask)
    assert np.allclose(np.array(ours), np.array(mlx), atol=1e-5)
