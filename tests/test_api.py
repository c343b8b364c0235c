"""The public API: argument errors, edge cases and MLX transformations (grad, compile, checkpoint)."""
import math
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_flash
from mlx_flash import flash_attention, reference
from mlx_flash.fallback import record_fallback
from mlx_flash.spec import check_inputs


def rand(*shape, dtype=mx.float32, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


Q, K, V = rand(2, 4, 8, 16, seed=1), rand(2, 2, 10, 16, seed=2), rand(2, 2, 10, 16, seed=3)


# --- bad input: every case raises a clear error naming the argument --------------------------------

@pytest.mark.parametrize("kwargs, q, k, v, error, words", [
    ({}, rand(4, 8, 16), K, V, ValueError, ["q", "rank 4", "(4, 8, 16)"]),
    ({}, Q, rand(2, 2, 10, 16, 1), V, ValueError, ["k", "rank 4"]),
    ({}, Q, K, rand(3, 2, 10, 16), ValueError, ["batch", "(3, 2, 10, 16)"]),
    ({}, Q, rand(2, 2, 10, 8), rand(2, 2, 10, 8), ValueError, ["head_dim", "16", "8"]),
    ({}, Q, K, rand(2, 2, 11, 16), ValueError, ["k and v", "(2, 2, 11, 16)"]),
    ({}, rand(2, 3, 8, 16), K, V, ValueError, ["multiple", "3", "2"]),
    ({}, Q, K.astype(mx.float16), V, TypeError, ["dtype", "float16"]),
    ({}, Q.astype(mx.int32), K.astype(mx.int32), V.astype(mx.int32), TypeError, ["q", "int32"]),
    ({}, np.zeros((2, 4, 8, 16)), K, V, TypeError, ["q", "mx.array"]),
    ({"mask": "upper"}, Q, K, V, ValueError, ["mask", "'upper'"]),
    ({"mask": mx.zeros((2, 4, 8, 7))}, Q, K, V, ValueError, ["mask", "broadcastable", "(2, 4, 8, 7)"]),
    ({"mask": mx.zeros((1, 1, 1, 8, 10))}, Q, K, V, ValueError, ["mask", "rank 5"]),
    ({"mask": mx.zeros((8, 10), mx.int32)}, Q, K, V, TypeError, ["mask", "int32"]),
    ({"mask": mx.zeros((8, 10), mx.float32)}, Q.astype(mx.float16), K.astype(mx.float16),
     V.astype(mx.float16), TypeError, ["additive mask", "float32"]),
    ({"mask": [[True]]}, Q, K, V, TypeError, ["mask", "list"]),
    ({"scale": float("nan")}, Q, K, V, ValueError, ["scale", "nan"]),
    ({"scale": float("inf")}, Q, K, V, ValueError, ["scale", "inf"]),
    ({"scale": "big"}, Q, K, V, TypeError, ["scale", "'big'"]),
    ({"scale": "0.1"}, Q, K, V, TypeError, ["scale", "'0.1'"]),  # a numeric string is still a string
    ({"softcap": 0.0}, Q, K, V, ValueError, ["softcap", "0.0"]),
    ({"softcap": -2}, Q, K, V, ValueError, ["softcap", "-2"]),
    ({"window_size": (-2, 3)}, Q, K, V, ValueError, ["window_size", "left", "-2"]),
    ({"window_size": (3, -5)}, Q, K, V, ValueError, ["window_size", "right", "-5"]),
    ({"window_size": 4}, Q, K, V, ValueError, ["window_size", "pair"]),
    ({"window_size": (1.5, 2)}, Q, K, V, TypeError, ["window_size", "1.5"]),
    ({"backend": "triton"}, Q, K, V, ValueError, ["backend", "'triton'"]),
    ({"return_lse": "yes"}, Q, K, V, TypeError, ["return_lse"]),
    ({"stream": "gpu"}, Q, K, V, TypeError, ["stream"]),
])
def test_bad_input_is_a_clear_error(kwargs, q, k, v, error, words):
    with pytest.raises(error) as info:
        flash_attention(q, k, v, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_unavailable_backend_named_explicitly_raises():
    """A GPU backend named on a machine without that GPU (Metal on a CUDA machine, else CUDA)."""
    missing = "metal" if hasattr(mx, "cuda") and mx.cuda.is_available() else "cuda"
    if missing == "cuda" and mx.metal.is_available():
        pytest.skip("a Metal GPU is present")
    with pytest.raises(ValueError, match=f"backend '{missing}' is not available"):
        flash_attention(Q, K, V, backend=missing)


# --- edge cases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape_q, shape_kv", [((0, 4, 8, 16), (0, 2, 10, 16)), ((2, 4, 0, 16), (2, 2, 10, 16)),
                                               ((2, 4, 8, 16), (2, 2, 0, 16)), ((2, 0, 8, 16), (2, 0, 10, 16))])
def test_zero_size_returns_empty_results(shape_q, shape_kv):
    q, k, v = mx.zeros(shape_q), mx.zeros(shape_kv), mx.zeros(shape_kv)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert out.shape == shape_q and lse.shape == shape_q[:3]
    assert np.all(np.array(out) == 0) and np.all(np.isneginf(np.array(lse)))
    grads = mx.grad(lambda q, k, v: flash_attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [shape_q, shape_kv, shape_kv]


def test_rows_that_see_no_key_give_zero_output_gradient_and_minus_inf_lse():
    q, k, v = rand(1, 1, 6, 8), rand(1, 1, 6, 8, seed=4), rand(1, 1, 6, 8, seed=5)
    mask = mx.array(np.array([[True] * 6, [False] * 6] * 3))
    out, lse = flash_attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(np.array(out)[0, 0, 1::2] == 0) and np.all(np.isneginf(np.array(lse)[0, 0, 1::2]))
    assert np.all(np.abs(np.array(out)[0, 0, 0::2]) > 0)
    dq = mx.grad(lambda q: flash_attention(q, k, v, mask=mask).sum())(q)
    assert np.all(np.array(dq)[0, 0, 1::2] == 0) and np.isfinite(np.array(dq)).all()
    # A window that excludes every key from some rows behaves the same.
    out = flash_attention(q, k[:, :, :2], v[:, :, :2], window_size=(-1, 0))  # key j <= i - 4
    assert np.all(np.array(out)[0, 0, :4] == 0)


def test_nan_and_inf_inputs_do_not_crash():
    q = mx.array(np.where(np.arange(8 * 16).reshape(1, 1, 8, 16) % 7 == 0, np.nan, 1.0).astype(np.float32))
    k = mx.full((1, 1, 8, 16), math.inf)
    out = flash_attention(q, k, k)
    grads = mx.grad(lambda q, k: flash_attention(q, k, k).sum(), argnums=(0, 1))(q, k)
    mx.eval(out, grads)
    assert out.shape == q.shape


def test_scale_accepts_array_and_int():
    a = flash_attention(Q, K, V, scale=mx.array(0.5))
    b = flash_attention(Q, K, V, scale=0.5)
    c = flash_attention(Q, K, V, scale=1)
    d = flash_attention(Q, K, V, scale=1.0)
    e = flash_attention(Q, K, V, scale=np.float32(0.5))
    assert mx.array_equal(a, b) and mx.array_equal(c, d) and mx.array_equal(a, e)


# --- the drop-in matches MLX's own attention --------------------------------------------------------

@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_scaled_dot_product_attention_matches_mlx(mask):
    q, k, v = rand(2, 4, 9, 32, seed=7), rand(2, 2, 13, 32, seed=8), rand(2, 2, 13, 32, seed=9)
    if mask == "bool":
        mask = mx.array(np.random.default_rng(0).random((9, 13)) > 0.3)
    elif mask == "additive":
        mask = rand(2, 1, 9, 13, seed=10)
    ours = mlx_flash.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-5)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, scale=0.3, mask=mask) ** 2).sum()

    ours = mx.grad(loss(mlx_flash.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=5e-5)


# --- MLX transformations ----------------------------------------------------------------------------

def _reference_grads(q, k, v, mask=None):
    spec, m = check_inputs(q, k, v, mask=mask)
    d_out = np.ones(q.shape)
    return reference.attention_backward(np.array(q), np.array(k), np.array(v), d_out, spec,
                                        None if m is None else np.array(m))


def _close(got, want, tol=1e-4):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), w, atol=tol, rtol=tol)


def test_value_and_grad_and_vjp():
    f = lambda q, k, v: flash_attention(q, k, v, mask="causal").sum()
    value, grads = mx.value_and_grad(f, argnums=(0, 1, 2))(Q, K, V)
    _close(grads, _reference_grads(Q, K, V, "causal"))
    out, lse = flash_attention(Q, K, V, mask="causal", return_lse=True)
    assert abs(value.item() - np.array(out).sum()) < 1e-3
    (o,), vjps = mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal"), [Q, K, V], [mx.ones(Q.shape)])
    _close(vjps, _reference_grads(Q, K, V, "causal"))


def test_compile():
    f = mx.compile(mx.grad(lambda q, k, v: flash_attention(q, k, v, mask="causal").sum(), argnums=(0, 1, 2)))
    _close(f(Q, K, V), _reference_grads(Q, K, V, "causal"))
    # A second call with new values reuses the compiled graph and is still right.
    q2 = Q * 0.5
    _close(f(q2, K, V), _reference_grads(q2, K, V, "causal"))


def test_checkpoint():
    f = mx.checkpoint(lambda q, k, v: flash_attention(q, k, v, mask="causal"))
    grads = mx.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))(Q, K, V)
    _close(grads, _reference_grads(Q, K, V, "causal"))


class TwoLayers(nn.Module):
    """Two attention layers in one model: each must backpropagate with its own statistics."""

    def __init__(self, dims=16, heads=2):
        super().__init__()
        self.heads = heads
        self.proj1 = nn.Linear(dims, 3 * dims)
        self.proj2 = nn.Linear(dims, 3 * dims)

    def attend(self, proj, x, fn):
        B, N, D = x.shape
        q, k, v = (t.reshape(B, N, self.heads, -1).transpose(0, 2, 1, 3) for t in mx.split(proj(x), 3, axis=-1))
        return fn(q, k, v).transpose(0, 2, 1, 3).reshape(B, N, D)

    def __call__(self, x, fn):
        x = x + self.attend(self.proj1, x, fn)
        return x + self.attend(self.proj2, x, fn)


def test_two_layers_share_one_backward():
    mx.random.seed(0)
    model = TwoLayers()
    x = rand(2, 12, 16, seed=11)
    ours = lambda q, k, v: flash_attention(q, k, v, mask="causal")
    theirs = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
    grads = []
    for fn in (ours, theirs):
        loss_and_grad = nn.value_and_grad(model, lambda m, x: (m(x, fn) ** 2).mean())
        grads.append(loss_and_grad(model, x))
    (l1, g1), (l2, g2) = grads
    assert abs(l1.item() - l2.item()) < 1e-5
    from mlx.utils import tree_flatten
    for (name, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, err_msg=name)


def test_lse_gradient():
    """lse is differentiable too (d lse / d s = softmax), e.g. for log-likelihood losses."""
    f = lambda q, k, v: flash_attention(q, k, v, return_lse=True)[1].sum()
    grads = mx.grad(f, argnums=(0, 1, 2))(Q, K, V)
    spec, _ = check_inputs(Q, K, V)
    want = reference.attention_backward(np.array(Q), np.array(K), np.array(V), np.zeros(Q.shape), spec,
                                        d_lse=np.ones(Q.shape[:3]))
    _close(grads, want)


def test_stream_argument():
    a = flash_attention(Q, K, V, stream=mx.cpu)
    b = flash_attention(Q, K, V, stream=mx.default_stream(mx.cpu))
    assert mx.array_equal(a, b)


def test_fallbacks_warn_once_and_count():
    mlx_flash.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            record_fallback("test reason")
    assert len([w for w in caught if issubclass(w.category, mlx_flash.FallbackWarning)]) == 1
    assert mlx_flash.fallback_counts() == {"test reason": 3}
    mlx_flash.reset_fallback_counts()
