"""Attention sinks (MLX's `sinks=`): forward, the sink gradient, edge rows and bad input.

The sink of head h is one more softmax score with no value. These tests check it on the "mlx"
backend against the float64 reference, against finite differences, against MLX's own
(unfused) implementation, and that every bad sinks argument is a ValueError naming `sinks`.
The kernel backends run the same checks in tests/test_metal.py and tests/test_cuda.py.
"""
import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import flash_attention, reference, scaled_dot_product_attention
from mlx_flash.spec import check_inputs

from attention_cases import Case, check_case, relative_error, to_numpy


def rand(*shape, dtype=mx.float32, seed=0, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale).astype(dtype)


@pytest.mark.parametrize("case", [
    Case(kv_heads=2, group=3, q_len=37, kv_len=29, head_dim=24, mask="causal", sinks=True, lse_gradient=True),
    Case(batch=2, kv_heads=1, group=4, q_len=20, kv_len=50, head_dim=16, mask="window", window=(5, 3),
         softcap=5.0, sinks=True, lse_gradient=True, seed=3),
    Case(batch=2, kv_heads=2, q_len=33, kv_len=17, head_dim=8, mask="bool", mask_shape=(True, False, True, True),
         sinks=True, seed=5),
    Case(kv_heads=2, group=2, q_len=19, kv_len=23, head_dim=32, mask="additive", dtype="float16", sinks=True,
         seed=7),
    Case(kv_heads=1, group=2, q_len=12, kv_len=40, head_dim=64, mask="causal_window", window=(4, 0),
         dtype="bfloat16", sinks=True, lse_gradient=True, seed=9),
])
def test_sinks_match_reference(case):
    errors = check_case(case, backend="mlx")
    assert "d_sinks" in errors


def test_sink_gradient_matches_finite_differences():
    """d loss / d sink_h by central differences of the float32 loss, head by head."""
    q, k, v = rand(2, 4, 9, 8, seed=1), rand(2, 2, 11, 8, seed=2), rand(2, 2, 11, 8, seed=3)
    w, w_lse = rand(2, 4, 9, 8, seed=4), rand(2, 4, 9, seed=5)
    sinks = rand(4, seed=6)

    def loss(s):
        out, lse = flash_attention(q, k, v, mask="causal", sinks=s, return_lse=True, backend="mlx")
        return (out * w).sum() + (lse * w_lse).sum()

    grad = np.array(mx.grad(loss)(sinks))
    eps = 1e-2
    numeric = []
    for h in range(4):
        step = mx.array(np.eye(4, dtype=np.float32)[h] * eps)
        numeric.append((loss(sinks + step).item() - loss(sinks - step).item()) / (2 * eps))
    assert relative_error(grad, np.array(numeric)) < 1e-3, (grad, numeric)


def test_sinks_match_mlx_fast_forward_and_gradient():
    """MLX's own path (unfused on the CPU) gives the same output and the same sink gradient."""
    q, k, v = rand(1, 6, 13, 16, seed=1), rand(1, 2, 13, 16, seed=2), rand(1, 2, 13, 16, seed=3)
    w, sinks = rand(1, 6, 13, 16, seed=4), rand(6, seed=5, scale=3.0)
    for mask in (None, "causal", rand(13, 13, seed=6) > 0):
        def ours(s):
            return (scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=s) * w).sum()

        def mlx(s):
            return (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=s) * w).sum()

        (a, ga), (b, gb) = mx.value_and_grad(ours)(sinks), mx.value_and_grad(mlx)(sinks)
        assert abs(a.item() - b.item()) < 1e-4
        assert np.allclose(np.array(ga), np.array(gb), atol=1e-5)


def test_rows_that_see_no_key_give_the_sink_all_the_probability():
    """A row with no visible key and a sink: output 0, lse = sink, d_sink = d_lse, no other gradient."""
    q, k, v = rand(1, 2, 4, 8, seed=1), rand(1, 2, 6, 8, seed=2), rand(1, 2, 6, 8, seed=3)
    mask = mx.array(np.array([True, False, True, True])[:, None] & np.ones((1, 6), bool))
    sinks = mx.array([0.5, -1.5])
    out, lse = flash_attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, backend="mlx")
    assert np.all(np.array(out)[:, :, 1] == 0)
    assert np.allclose(np.array(lse)[0, :, 1], [0.5, -1.5])
    d_lse = mx.zeros((1, 2, 4)).at[:, :, 1].add(1.0)

    def loss(q_, s):
        return (flash_attention(q_, k, v, mask=mask, sinks=s, return_lse=True, backend="mlx")[1] * d_lse).sum()

    dq, ds = mx.grad(loss, argnums=(0, 1))(q, sinks)
    assert np.allclose(np.array(ds), [1.0, 1.0])
    assert np.all(np.array(dq) == 0)
    # No key at all (kv_len 0): same rule on every row.
    out, lse = flash_attention(q, k[:, :, :0], v[:, :, :0], sinks=sinks, return_lse=True, backend="mlx")
    assert np.all(np.array(out) == 0) and np.allclose(np.array(lse), np.array(sinks)[None, :, None])


def test_sinks_gradient_is_deterministic():
    case = Case(batch=2, kv_heads=2, group=2, q_len=40, kv_len=40, head_dim=16, mask="causal", sinks=True)
    from attention_cases import make_arrays
    a = make_arrays(case)
    grad = mx.grad(lambda s: (flash_attention(a.q, a.k, a.v, mask="causal", sinks=s) * a.d_out).sum())
    assert np.array_equal(np.array(grad(a.sinks)), np.array(grad(a.sinks)))


def test_sinks_dtype_follows_mlx():
    """Sinks join the softmax in the output dtype (as MLX casts them); the gradient comes back in
    the sinks' own dtype; integer sinks promote."""
    q, k, v = (rand(1, 2, 5, 8, seed=i, dtype=mx.float16) for i in range(3))
    sinks32 = mx.array([0.3333333, -2.7182818])
    for sinks in (sinks32.astype(mx.float16), mx.array([1, -2], dtype=mx.int8)):
        out = flash_attention(q, k, v, sinks=sinks)
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=8 ** -0.5, sinks=sinks)
        assert out.dtype == mx.float16
        assert np.allclose(to_numpy(out), to_numpy(expected), atol=2e-3)
    g = mx.grad(lambda s: flash_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                                          sinks=s).sum())(sinks32.astype(mx.float16))
    assert g.dtype == mx.float16


Q, K, V = rand(2, 4, 8, 16, seed=1), rand(2, 2, 10, 16, seed=2), rand(2, 2, 10, 16, seed=3)


@pytest.mark.parametrize("function", ["flash_attention", "scaled_dot_product_attention"])
@pytest.mark.parametrize("q, sinks, words", [
    (Q, mx.zeros((5,)), ["sinks", "(4,)", "(5,)"]),
    (Q, mx.zeros((2,)), ["sinks", "(4,)", "(2,)"]),          # one per kv head: wrong under GQA
    (Q, mx.zeros((1, 4)), ["sinks", "(1, 4)"]),               # rank 2
    (Q, mx.zeros(()), ["sinks", "()"]),                       # rank 0
    (Q.astype(mx.float16), mx.zeros((4,)), ["sinks", "float32", "float16"]),
    (Q, mx.zeros((4,), mx.complex64), ["sinks", "complex64"]),
])
def test_bad_sinks_are_a_value_error_naming_sinks(function, q, sinks, words):
    k, v = K.astype(q.dtype), V.astype(q.dtype)
    with pytest.raises(ValueError) as info:
        if function == "flash_attention":
            flash_attention(q, k, v, sinks=sinks)
        else:
            scaled_dot_product_attention(q, k, v, scale=0.25, sinks=sinks)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_sinks_that_are_not_an_array_are_a_type_error():
    with pytest.raises(TypeError, match="sinks"):
        flash_attention(Q, K, V, sinks=[0.0] * 4)


def test_spec_records_sinks():
    spec, _ = check_inputs(Q, K, V, sinks=mx.zeros((4,)))
    assert spec.has_sinks and not check_inputs(Q, K, V)[0].has_sinks
    assert reference.attention_forward(np.array(Q), np.array(K), np.array(V), spec,
                                       sinks=np.zeros(4))[0].shape == (2, 4, 8, 16)
