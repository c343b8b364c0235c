"""mlx_flash.nn against the layers it stands in for: mlx.nn.MultiHeadAttention and mlx-lm's
Llama attention, with the same weights, forward and gradients w.r.t. the parameters."""
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flash import nn as flash_nn

FORWARD_TOLERANCE = 2e-5   # relative Frobenius error, fp32
GRADIENT_TOLERANCE = 1e-4


def relative_error(x, reference, floor=0.0) -> float:
    """||x - reference|| / max(||reference||, floor). `floor` keeps a gradient that is exactly
    zero in exact arithmetic (e.g. of the key bias: softmax ignores a per-row constant) from
    turning rounding noise into a large relative error."""
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(x - reference) / max(np.linalg.norm(reference), floor, 1e-30))


def assert_close(x, reference, tolerance, what="", floor=0.0):
    error = relative_error(x, reference, floor)
    assert error < tolerance, f"{what}: relative error {error:.2e} >= {tolerance:.0e}"


def assert_grads_close(grads, ref_grads, tolerance):
    """Every gradient close to its reference, relative to the largest reference gradient's
    norm at least (see relative_error)."""
    assert set(grads) == set(ref_grads) and len(grads) >= 4
    floor = 1e-3 * max(np.linalg.norm(np.asarray(g)) for g in ref_grads.values())
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], tolerance, f"grad {name}", floor)


def assert_same_parameters(a: nn.Module, b: nn.Module):
    shapes_a = {k: v.shape for k, v in tree_flatten(a.parameters())}
    shapes_b = {k: v.shape for k, v in tree_flatten(b.parameters())}
    assert shapes_a == shapes_b


def value_and_parameter_grads(layer, inputs, mask):
    def loss(module, *xs):
        out = module(*xs, mask)
        # A fixed, non-uniform cotangent so every output element matters.
        weights = mx.cos(mx.arange(out.size, dtype=mx.float32)).reshape(out.shape)
        return (out * weights).sum()

    value, grads = nn.value_and_grad(layer, loss)(layer, *inputs)
    return value, dict(tree_flatten(grads))


MHA_CASES = {
    "self": dict(kwargs=dict(dims=32, num_heads=4), q_len=12, kv_len=12, dims=(32, 32, 32)),
    "cross_bias": dict(kwargs=dict(dims=24, num_heads=3, query_input_dims=20, key_input_dims=16,
                                   value_input_dims=12, value_dims=18, value_output_dims=10, bias=True),
                       q_len=7, kv_len=19, dims=(20, 16, 12)),
}


def make_mask(kind, q_len, kv_len, batch, heads):
    if kind == "none":
        return None
    if kind == "additive_causal":
        assert q_len == kv_len
        return nn.MultiHeadAttention.create_additive_causal_mask(q_len)
    if kind == "causal":
        return "causal"
    if kind == "bool_batch_heads":
        keep = mx.random.uniform(shape=(batch, heads, q_len, kv_len)) > 0.3
        return mx.logical_or(keep, mx.eye(q_len, kv_len, dtype=mx.bool_))  # every row sees a key
    if kind == "additive_padding":
        # [B, 1, 1, Nk]: the last keys of the second sequence are padding.
        pad = np.zeros((batch, 1, 1, kv_len), np.float32)
        pad[1, ..., kv_len - 3:] = -1e9
        return mx.array(pad)
    raise ValueError(kind)


MASK_KINDS = ["none", "additive_causal", "causal", "bool_batch_heads", "additive_padding"]


@pytest.mark.parametrize("case_name, mask_kind", [
    (case, mask) for case in sorted(MHA_CASES) for mask in MASK_KINDS
    if mask != "additive_causal" or MHA_CASES[case]["q_len"] == MHA_CASES[case]["kv_len"]])
def test_multi_head_attention_matches_mlx(case_name, mask_kind):
    case = MHA_CASES[case_name]
    mx.random.seed(1)
    reference = nn.MultiHeadAttention(**case["kwargs"])
    layer = flash_nn.MultiHeadAttention(**case["kwargs"])
    assert_same_parameters(reference, layer)
    layer.update(reference.parameters())
    batch = 2
    q_dims, k_dims, v_dims = case["dims"]
    inputs = (mx.random.normal((batch, case["q_len"], q_dims)), mx.random.normal((batch, case["kv_len"], k_dims)),
              mx.random.normal((batch, case["kv_len"], v_dims)))
    mask = make_mask(mask_kind, case["q_len"], case["kv_len"], batch, case["kwargs"]["num_heads"])

    assert_close(layer(*inputs, mask), reference(*inputs, mask), FORWARD_TOLERANCE, "output")
    value, grads = value_and_parameter_grads(layer, inputs, mask)
    ref_value, ref_grads = value_and_parameter_grads(reference, inputs, mask)
    assert_grads_close(grads, ref_grads, GRADIENT_TOLERANCE)


def test_multi_head_attention_weights_load_both_ways(tmp_path):
    kwargs = dict(dims=16, num_heads=2, bias=True)
    mx.random.seed(2)
    reference, layer = nn.MultiHeadAttention(**kwargs), flash_nn.MultiHeadAttention(**kwargs)
    x = mx.random.normal((1, 5, 16))

    reference.save_weights(str(tmp_path / "mlx.safetensors"))
    layer.load_weights(str(tmp_path / "mlx.safetensors"))  # strict: names and shapes must match
    assert_close(layer(x, x, x), reference(x, x, x), FORWARD_TOLERANCE, "MLX -> flash")

    mx.random.seed(3)
    other = flash_nn.MultiHeadAttention(**kwargs)
    other.save_weights(str(tmp_path / "flash.safetensors"))
    reference.load_weights(str(tmp_path / "flash.safetensors"))
    assert_close(other(x, x, x), reference(x, x, x), FORWARD_TOLERANCE, "flash -> MLX")
    assert isinstance(layer, nn.MultiHeadAttention)


def test_multi_head_attention_extras_window_and_softcap():
    mx.random.seed(4)
    layer = flash_nn.MultiHeadAttention(16, 2)
    x = mx.random.normal((1, 10, 16))
    q = layer.query_proj(x).reshape(1, 10, 2, 8).transpose(0, 2, 1, 3)
    k = layer.key_proj(x).reshape(1, 10, 2, 8).transpose(0, 2, 1, 3)
    v = layer.value_proj(x).reshape(1, 10, 2, 8).transpose(0, 2, 1, 3)
    s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(8)
    s = 5.0 * mx.tanh(s / 5.0)
    i, j = mx.arange(10)[:, None], mx.arange(10)[None]
    s = mx.where((j <= i) & (j >= i - 3), s, -mx.inf)
    expected = layer.out_proj((mx.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(1, 10, 16))
    out = layer(x, x, x, "causal", window_size=(3, 0), softcap=5.0)
    assert_close(out, expected, FORWARD_TOLERANCE, "window + softcap")


def test_multi_head_attention_errors():
    with pytest.raises(ValueError, match="backend"):
        flash_nn.MultiHeadAttention(16, 2, backend="tpu")
    with pytest.raises(ValueError, match=r"value_dims \(9\).*num_heads \(2\)"):
        flash_nn.MultiHeadAttention(16, 2, value_dims=9)


# ---------------------------------------------------------------- GroupedQueryAttention

def llama_attention(n_heads=4, n_kv_heads=2, dims=32):
    llama = pytest.importorskip("mlx_lm.models.llama", reason="compares against mlx-lm (the 'lm' extra)")
    args = llama.ModelArgs(model_type="llama", hidden_size=dims, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5,
                           vocab_size=16)
    return llama.Attention(args)


def call_mlx_lm_attention(attention, x, cache=None):
    """mlx-lm's Attention with the mask its model builds, on mlx-lm's own (unpatched) attention."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_flash.integrations import mlx_lm as flash_mlx_lm
    assert not flash_mlx_lm.is_patched()
    return attention(x, create_attention_mask(x, cache), cache)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_grouped_query_attention_matches_mlx_lm_llama(n_heads, n_kv_heads):
    mx.random.seed(5)
    reference = llama_attention(n_heads, n_kv_heads)
    layer = flash_nn.GroupedQueryAttention(32, n_heads, n_kv_heads, rope=True)
    assert_same_parameters(reference, layer)
    layer.load_weights(list(tree_flatten(reference.parameters())))
    x = mx.random.normal((2, 20, 32))
    assert_close(layer(x), call_mlx_lm_attention(reference, x), FORWARD_TOLERANCE, "output")

    def loss(module, x, call):
        out = call(module, x)
        return (out * mx.sin(mx.arange(out.size, dtype=mx.float32)).reshape(out.shape)).sum()

    _, grads = nn.value_and_grad(layer, loss)(layer, x, lambda m, x: m(x))
    _, ref_grads = nn.value_and_grad(reference, loss)(reference, x, call_mlx_lm_attention)
    assert_grads_close(dict(tree_flatten(grads)), dict(tree_flatten(ref_grads)), GRADIENT_TOLERANCE)


def test_grouped_query_attention_kv_cache_decoding_matches_mlx_lm():
    KVCache = pytest.importorskip("mlx_lm.models.cache", reason="compares against mlx-lm (the 'lm' extra)").KVCache
    mx.random.seed(6)
    reference = llama_attention(4, 2)
    layer = flash_nn.GroupedQueryAttention(32, 4, 2, rope=True)
    layer.load_weights(list(tree_flatten(reference.parameters())))
    x = mx.random.normal((1, 14, 32))
    cache, ref_cache = KVCache(), KVCache()
    # Prefill 10 tokens, then decode 4 one at a time (bottom-right causal alignment, RoPE offsets).
    outs = [layer(x[:, :10], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(10, 14)]
    refs = [call_mlx_lm_attention(reference, x[:, :10], ref_cache)] + \
           [call_mlx_lm_attention(reference, x[:, t:t + 1], ref_cache) for t in range(10, 14)]
    assert_close(mx.concatenate(outs, axis=1), mx.concatenate(refs, axis=1), FORWARD_TOLERANCE, "decoding")
    # And equal to attending over the whole sequence at once.
    assert_close(mx.concatenate(outs, axis=1), layer(x), FORWARD_TOLERANCE, "cache vs full")


def plain_attention(layer, x, keep=None, additive=None):
    """The layer's attention spelled out with dense MLX ops (the reference for options)."""
    B, L, _ = x.shape
    q = layer.q_proj(x).reshape(B, L, layer.n_heads, -1).transpose(0, 2, 1, 3)
    k = layer.k_proj(x).reshape(B, L, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = layer.v_proj(x).reshape(B, L, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    group = layer.n_heads // layer.n_kv_heads
    k, v = mx.repeat(k, group, axis=1), mx.repeat(v, group, axis=1)
    s = (q @ k.transpose(0, 1, 3, 2)) * layer.scale
    if layer.softcap is not None:
        s = layer.softcap * mx.tanh(s / layer.softcap)
    if additive is not None:
        s = s + additive
    if keep is not None:
        s = mx.where(keep, s, -mx.inf)
    out = mx.softmax(s, axis=-1) @ v
    return layer.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_grouped_query_attention_window_softcap_and_padding_mask():
    mx.random.seed(7)
    L = 24
    i, j = mx.arange(L)[:, None], mx.arange(L)[None]
    x = mx.random.normal((2, L, 32))
    # Mistral-style window of 6 tokens, causal, with a softcap.
    layer = flash_nn.GroupedQueryAttention(32, 4, 2, window_size=(5, 3), softcap=8.0)
    assert layer.window_size == (5, 0)  # causal wins on the right
    assert_close(layer(x), plain_attention(layer, x, keep=(j <= i) & (j > i - 6)), FORWARD_TOLERANCE, "window")
    # Causal plus a padding mask (bool [B, 1, 1, L]): the array mask and the causal band combine.
    layer = flash_nn.GroupedQueryAttention(32, 4, 1)
    padding = mx.array(np.arange(L)[None, None, None, :] < np.array([L, L - 5])[:, None, None, None])
    assert_close(layer(x, mask=padding), plain_attention(layer, x, keep=(j <= i) & padding),
                 FORWARD_TOLERANCE, "causal + padding")
    # Non-causal with an additive mask.
    layer = flash_nn.GroupedQueryAttention(32, 2, causal=False, head_dim=8)
    additive = mx.random.normal((L, L))
    assert_close(layer(x, mask=additive), plain_attention(layer, x, additive=additive),
                 FORWARD_TOLERANCE, "additive")


def test_grouped_query_attention_errors():
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        flash_nn.GroupedQueryAttention(48, 6, 4)
    with pytest.raises(ValueError, match=r"dims \(30\) must be divisible by n_heads \(4\)"):
        flash_nn.GroupedQueryAttention(30, 4)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int, got 0"):
        flash_nn.GroupedQueryAttention(32, 4, 0)
    with pytest.raises(TypeError, match="rope"):
        flash_nn.GroupedQueryAttention(32, 4, rope="yes")
    with pytest.raises(ValueError, match="window_size"):
        flash_nn.GroupedQueryAttention(32, 4, window_size=3)
    with pytest.raises(ValueError, match=r"shape \(2, 32\)"):
        flash_nn.GroupedQueryAttention(32, 4)(mx.zeros((2, 32)))
