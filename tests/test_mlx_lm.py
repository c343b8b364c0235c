"""mlx_flash.integrations.mlx_lm: patched mlx-lm models against the same models unpatched.

Every comparison runs the real, unpatched mlx-lm model as the reference (mlx-lm's attention:
mx.fast.scaled_dot_product_attention), so a patch that routes badly or computes wrongly fails.
"""
import importlib
import subprocess
import sys
import textwrap
import types
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")

import mlx_flash  # noqa: E402
from mlx_flash.integrations import mlx_lm as flash_mlx_lm  # noqa: E402
from mlx_lm.models import base, cache as mlx_lm_cache, llama  # noqa: E402

# The tiny models here are fp32 and the expected counts are the CPU's: on a CUDA GPU fp32 calls are
# handed to mx.fast or the "mlx" backend by design (counted as fallbacks), and MLX's CUDA backend
# has no quantized matmul for the quantized-cache shapes. The kernels' own GPU checks are test_cuda.py.
pytestmark = pytest.mark.usefixtures("on_cpu")

TOLERANCE = 1e-4  # relative Frobenius error, fp32 logits, losses and gradients
SEQUENCE = 24     # > DECODE_QUERY_LENGTH, so full sequences take the flash path


@pytest.fixture(autouse=True)
def clean_state():
    """No test leaks a patch, counts or a checkpointed block class into the next."""
    assert not flash_mlx_lm.is_patched()
    block_call = llama.TransformerBlock.__call__
    mlx_flash.reset_fallback_counts()
    flash_mlx_lm.reset_call_counts()
    yield
    flash_mlx_lm.unpatch()
    llama.TransformerBlock.__call__ = block_call


def relative_error(x, reference) -> float:
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(x - reference) / max(np.linalg.norm(reference), 1e-30))


def tiny_llama(n_heads=4, n_kv_heads=4, layers=2, **extra):
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=layers, intermediate_size=64,
                           num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5,
                           vocab_size=97, **extra)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


MODELS = {
    "mha": dict(n_heads=4, n_kv_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mqa": dict(n_heads=4, n_kv_heads=1),
    # One sliding-window layer: mlx-lm passes its mask as a bool array (window 8 < 24 tokens).
    "sliding_window": dict(n_heads=4, n_kv_heads=2, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=8),
}


def tokens(batch=2, length=SEQUENCE + 1, seed=1):
    return mx.random.randint(0, 97, (batch, length), key=mx.random.key(seed))


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:]).mean()


def bindings_of(function):
    """(module, name) of every loaded mlx_lm module global that is `function`."""
    return [(module, name) for module_name, module in list(sys.modules.items())
            if module_name.startswith("mlx_lm") and module is not None
            for name, value in list(vars(module).items()) if value is function]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_patched_model_matches_unpatched(kind):
    model = tiny_llama(**MODELS[kind])
    batch = tokens()
    logits = model(batch[:, :-1])
    loss, grads = nn.value_and_grad(model, lm_loss)(model, batch)
    mx.eval(logits, loss, grads)
    assert flash_mlx_lm.call_counts() == {"flash": 0, "original": 0}

    with flash_mlx_lm.patched():
        patched_logits = model(batch[:, :-1])
        patched_loss, patched_grads = nn.value_and_grad(model, lm_loss)(model, batch)
        mx.eval(patched_logits, patched_loss, patched_grads)
    # 2 layers x (logits call + loss call), all on the flash path.
    assert flash_mlx_lm.call_counts() == {"flash": 4, "original": 0}
    assert mlx_flash.fallback_counts() == {}
    assert relative_error(patched_logits, logits) < TOLERANCE
    assert abs(patched_loss.item() - loss.item()) < TOLERANCE * abs(loss.item())
    grads, patched_grads = dict(tree_flatten(grads)), dict(tree_flatten(patched_grads))
    for name in grads:
        assert relative_error(patched_grads[name], grads[name]) < TOLERANCE, name


def test_patch_rebinds_every_module_and_unpatch_restores_identity():
    import mlx_lm.models.qwen2  # noqa: F401  (a second model module, imported before patching)
    original = base.scaled_dot_product_attention
    before = bindings_of(original)
    assert (llama, "scaled_dot_product_attention") in before and len(before) >= 3

    flash_mlx_lm.patch()
    replacement = base.scaled_dot_product_attention
    assert replacement is not original and replacement.__wrapped__ is original
    assert flash_mlx_lm.original_function() is original
    for module, name in before:
        assert getattr(module, name) is replacement, module.__name__
    assert bindings_of(original) == []  # nothing in mlx_lm still holds the original
    flash_mlx_lm.patch()  # idempotent
    assert base.scaled_dot_product_attention is replacement

    # A module (re)imported while patched binds the flash function from base itself, in mlx_lm
    # or outside it (a user's model file)...
    importlib.reload(mlx_lm.models.qwen2)
    assert mlx_lm.models.qwen2.scaled_dot_product_attention is replacement
    user_module = types.ModuleType("user_model_for_test")
    sys.modules[user_module.__name__] = user_module
    try:
        exec("from mlx_lm.models.base import scaled_dot_product_attention as attend", vars(user_module))
        assert user_module.attend is replacement
        flash_mlx_lm.unpatch()
        assert user_module.attend is original
    finally:
        del sys.modules[user_module.__name__]

    flash_mlx_lm.unpatch()
    # ...and unpatch restores the very same function object everywhere, reloaded module included.
    assert base.scaled_dot_product_attention is original
    for module, name in before:
        assert getattr(module, name) is original, module.__name__
    assert mlx_lm.models.qwen2.scaled_dot_product_attention is original
    assert not flash_mlx_lm.is_patched()
    flash_mlx_lm.unpatch()  # a second unpatch does nothing


def test_modules_imported_after_patch_in_a_fresh_interpreter():
    """In a fresh interpreter: llama imported before patch(), gemma imported after it (not
    loaded before), both attend with flash attention; unpatch() restores both."""
    script = textwrap.dedent("""
        import sys
        import mlx.core as mx
        from mlx_flash.integrations import mlx_lm as flash_mlx_lm
        import mlx_lm.models.llama as llama
        assert "mlx_lm.models.gemma" not in sys.modules
        original = llama.scaled_dot_product_attention
        flash_mlx_lm.patch()
        import mlx_lm.models.gemma as gemma
        replacement = llama.scaled_dot_product_attention
        assert replacement is not original
        assert gemma.scaled_dot_product_attention is replacement
        args = gemma.ModelArgs(model_type="gemma", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                               num_attention_heads=4, head_dim=8, rms_norm_eps=1e-5, vocab_size=50,
                               num_key_value_heads=2)
        model = gemma.Model(args)
        x = mx.random.randint(0, 50, (1, 16))
        patched = model(x)
        mx.eval(patched)
        assert flash_mlx_lm.call_counts() == {"flash": 2, "original": 0}, flash_mlx_lm.call_counts()
        flash_mlx_lm.unpatch()
        assert gemma.scaled_dot_product_attention is original
        assert llama.scaled_dot_product_attention is original
        error = (mx.abs(model(x) - patched).max() / mx.abs(patched).max()).item()
        assert error < 1e-4, error
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_decode_steps_fall_back_to_mlx_lm_and_match():
    model = tiny_llama(**MODELS["gqa"])
    prompt, follow = tokens(batch=1, length=SEQUENCE, seed=2), tokens(batch=1, length=3, seed=3)

    def generate_logits():
        cache = model.make_cache()
        # Chunked prefill: the second chunk's 12 queries see 24 keys ("causal", bottom-right).
        outs = [model(prompt[:, :12], cache=cache), model(prompt[:, 12:], cache=cache)]
        outs += [model(follow[:, t:t + 1], cache=cache) for t in range(follow.shape[1])]
        return mx.concatenate([o.reshape(-1, o.shape[-1]) for o in outs])

    reference = generate_logits()
    with flash_mlx_lm.patched(), pytest.warns(mlx_flash.FallbackWarning, match="decode step"):
        patched = generate_logits()
    assert relative_error(patched, reference) < TOLERANCE
    # Two prefill chunks on flash, each of the 3 one-token steps on mlx-lm's own, per layer.
    assert flash_mlx_lm.call_counts() == {"flash": 4, "original": 6}
    (reason, count), = mlx_flash.fallback_counts().items()
    assert "decode step" in reason and count == 6


def test_quantized_kv_cache_falls_back():
    model = tiny_llama(**MODELS["gqa"], head_dim=32)  # quantization groups of 32 along head_dim
    prompt = tokens(batch=1, length=SEQUENCE, seed=4)

    def prefill():
        cache = [mlx_lm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
        return model(prompt, cache=cache)

    reference = prefill()
    with flash_mlx_lm.patched(), pytest.warns(mlx_flash.FallbackWarning, match="quantized KV cache"):
        patched = prefill()
    assert relative_error(patched, reference) < 1e-6  # the same function served both
    assert flash_mlx_lm.call_counts() == {"flash": 0, "original": 2}
    assert any("quantized KV cache" in r and n == 2 for r, n in mlx_flash.fallback_counts().items())


def test_sinks_and_mixed_dtypes_go_through_flash():
    """Sinks are forwarded (not a fallback); q fp32 with fp16 k/v promote as MLX does."""
    shape = (1, 4, SEQUENCE, 8)
    q, k, v = (mx.random.normal(shape, key=mx.random.key(i)) for i in range(3))
    sinks = mx.array([0.5, -1.0, 0.0, 2.0])
    calls = [(q, k, v, sinks), (q, k.astype(mx.float16), v.astype(mx.float16), None)]
    references = [base.scaled_dot_product_attention(*c[:3], None, scale=0.35, mask="causal", sinks=c[3])
                  for c in calls]
    with flash_mlx_lm.patched():
        patched = [base.scaled_dot_product_attention(*c[:3], None, scale=0.35, mask="causal", sinks=c[3])
                   for c in calls]
        # Integer masks are additive, as in MLX.
        int_mask = mx.zeros((SEQUENCE, SEQUENCE), mx.int32)
        masked = base.scaled_dot_product_attention(q, k, v, None, scale=0.35, mask=int_mask)
    for x, reference in zip(patched, references):
        assert x.dtype == reference.dtype and relative_error(x, reference) < TOLERANCE
    assert relative_error(masked, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35)) < TOLERANCE
    assert flash_mlx_lm.call_counts() == {"flash": 3, "original": 0}
    assert mlx_flash.fallback_counts() == {}
    assert flash_mlx_lm.call_counts(by_model=True) == {"test_mlx_lm": {"flash": 3, "original": {}}}


def test_inputs_mlx_rejects_fall_back_with_their_reason():
    q = mx.random.normal((1, 4, SEQUENCE, 8))
    k = mx.random.normal((1, 3, SEQUENCE, 8))  # 4 query heads over 3 kv heads
    with flash_mlx_lm.patched(), pytest.warns(mlx_flash.FallbackWarning, match="rules reject"):
        with pytest.raises(ValueError):  # mlx-lm's own function raises MLX's error
            base.scaled_dot_product_attention(q, k, k, None, scale=0.35, mask=None)
    (reason, n), = flash_mlx_lm.call_counts(by_model=True)["test_mlx_lm"]["original"].items()
    assert n == 1 and "multiple" in reason


def test_fallback_warns_once_per_reason():
    q = mx.random.normal((1, 2, 1, 8))
    with flash_mlx_lm.patched():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                base.scaled_dot_product_attention(q, q, q, None, scale=1.0, mask=None)
    assert [str(w.message).count("decode step") for w in caught] == [1]
    assert flash_mlx_lm.call_counts()["original"] == 3


def lora_model():
    from mlx_lm.tuner.utils import linear_to_lora_layers
    model = tiny_llama(**MODELS["gqa"])
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    # LoRA's B starts at zero, which would make every A gradient zero: start from a random B.
    for name, leaf in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_b"):
            model.update(dict_path(name, 0.1 * mx.random.normal(leaf.shape, key=mx.random.key(len(name)))))
    return model


def dict_path(dotted, value):
    from mlx.utils import tree_unflatten
    return tree_unflatten([(dotted, value)])


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "grad_checkpoint"])
def test_compiled_lora_training_step_matches_unpatched(checkpoint):
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
    model = lora_model()
    if checkpoint:
        grad_checkpoint(model.layers[0])  # as mlx-lm's trainer does (restored by the fixture)
    batch = tokens(batch=2, length=33, seed=5)
    lengths = mx.array([[0, 33], [0, 21]])  # second sequence: only its first 21 tokens count

    def compiled_step():
        # A new function object each time: mx.compile caches traces per function.
        loss_and_grad = nn.value_and_grad(model, default_loss)

        def step(batch, lengths):
            (loss, _), grads = loss_and_grad(model, batch, lengths)
            return loss, grads

        return mx.compile(step, inputs=[model.state], outputs=[model.state])

    loss, grads = compiled_step()(batch, lengths)
    mx.eval(loss, grads)
    with flash_mlx_lm.patched():
        patched_loss, patched_grads = compiled_step()(batch, lengths)
        mx.eval(patched_loss, patched_grads)
    # Forward of 2 layers, plus their recomputation in the backward when checkpointed.
    assert flash_mlx_lm.call_counts() == {"flash": 4 if checkpoint else 2, "original": 0}
    assert abs(patched_loss.item() - loss.item()) < TOLERANCE * loss.item()
    grads, patched_grads = dict(tree_flatten(grads)), dict(tree_flatten(patched_grads))
    assert len(grads) == 28 and all(n.endswith(("lora_a", "lora_b")) for n in grads)
    for name in grads:
        assert relative_error(patched_grads[name], grads[name]) < TOLERANCE, name


def test_patched_context_manager_nests_and_checks_backend():
    original = base.scaled_dot_product_attention
    flash_mlx_lm.patch(backend="mlx")
    with flash_mlx_lm.patched(backend="mlx"):
        assert flash_mlx_lm.is_patched()
    assert flash_mlx_lm.is_patched()  # the outer patch() is still in effect
    with pytest.raises(ValueError, match="already patched with backend 'mlx'"):
        flash_mlx_lm.patch(backend="auto")
    flash_mlx_lm.unpatch()
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_mlx_lm.patch(backend="gpu")
    with pytest.raises(RuntimeError):
        with flash_mlx_lm.patched():
            raise RuntimeError("inside")
    assert not flash_mlx_lm.is_patched() and base.scaled_dot_product_attention is original


# -- models with sinks, soft-capping written by hand, float16 weights ---------------------------

def tiny_model(model_type, dtype=mx.float32, **args):
    """A tiny mlx-lm model of `model_type` built through mlx-lm's own loader path (ModelArgs.from_dict)."""
    from mlx_lm.utils import _get_classes
    config = {**dict(model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     vocab_size=97, rope_theta=10000.0), **args}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


TINY = {
    # gpt-oss: attention sinks, alternating sliding-window (bool mask) and full layers, MoE.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    # gemma2: hand-written soft-capped attention, reached through its adapter.
    "gemma2": dict(query_pre_attn_scalar=16.0, attn_logit_softcapping=5.0),
}
FLOAT16 = {
    # float16 models whose attention gets float32 queries with float16 keys (MLX promotes).
    "phi": dict(partial_rotary_factor=0.5, layer_norm_eps=1e-5, num_key_value_heads=4),
    "stablelm": dict(partial_rotary_factor=0.5, layer_norm_eps=1e-5, use_qkv_bias=False, num_key_value_heads=4),
    "cohere2": dict(layer_norm_eps=1e-5, sliding_window=8, sliding_window_pattern=2, logit_scale=0.5,
                    layer_norm_bias=False, attention_bias=False),
}


def _with_sinks(model):
    """Non-zero sinks so they matter (gpt-oss initializes them to zero)."""
    for i, layer in enumerate(model.layers):
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape, key=mx.random.key(10 + i))
    return model


@pytest.mark.parametrize("model_type, dtype", [(m, mx.float32) for m in TINY] + [(m, mx.float16) for m in FLOAT16])
def test_tiny_models_go_through_flash(model_type, dtype):
    model = _with_sinks(tiny_model(model_type, dtype, **{**TINY, **FLOAT16}[model_type]))
    batch = tokens(batch=2, length=SEQUENCE, seed=3)
    reference = model(batch).astype(mx.float32)
    with flash_mlx_lm.patched():
        patched = model(batch).astype(mx.float32)
    mx.eval(reference, patched)
    assert relative_error(patched, reference) < (TOLERANCE if dtype == mx.float32 else 5e-3)
    counts = flash_mlx_lm.call_counts(by_model=True)
    assert counts == {model_type: {"flash": 2, "original": {}}}, counts
    assert mlx_flash.fallback_counts() == {}


def test_adapters_are_undone_and_listed():
    from mlx_flash.integrations import mlx_lm_adapters
    from mlx_lm.models import gemma2, plamo2
    call, plamo_mx = gemma2.Attention.__call__, plamo2.mx
    with flash_mlx_lm.patched():
        assert gemma2.Attention.__call__ is not call and plamo2.mx is not mx
        # plamo2 calls mx.fast directly: the module sees ours, everything else is mlx.core's.
        assert plamo2.mx.fast.rms_norm is mx.fast.rms_norm and plamo2.mx.array is mx.array
        q = mx.random.normal((1, 2, SEQUENCE, 8))
        out = plamo2.mx.fast.scaled_dot_product_attention(q, q, q, scale=0.3, mask="causal")
    assert relative_error(out, mx.fast.scaled_dot_product_attention(q, q, q, scale=0.3, mask="causal")) < TOLERANCE
    assert gemma2.Attention.__call__ is call and plamo2.mx is plamo_mx
    assert flash_mlx_lm.call_counts(by_model=True) == {"plamo2": {"flash": 1, "original": {}}}
    assert {"gemma2", "gear", "plamo2", "muse_spark"} <= set(mlx_lm_adapters.adapted_models())
    assert set(mlx_lm_adapters.NOT_ADAPTED).isdisjoint(mlx_lm_adapters.adapted_models())


def test_adapter_decode_steps_use_the_model_path():
    from mlx_lm.models import cache as caches
    model = tiny_model("gemma2", **TINY["gemma2"])
    prompt = tokens(batch=1, length=SEQUENCE, seed=6)

    def generate_two():
        cache = caches.make_prompt_cache(model)
        logits = model(prompt, cache=cache)
        return logits[:, -1], model(prompt[:, -1:], cache=cache)[:, -1]

    reference = generate_two()
    with flash_mlx_lm.patched(), pytest.warns(mlx_flash.FallbackWarning, match="gemma2: mlx-lm decode step"):
        patched = generate_two()
    for x, y in zip(patched, reference):
        assert relative_error(x, y) < TOLERANCE
    counts = flash_mlx_lm.call_counts(by_model=True)["gemma2"]
    assert counts["flash"] == 2 and sum(counts["original"].values()) == 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_step_on_gpt_oss_with_learnable_sinks_matches_unpatched(compiled):
    """Loss and every gradient (LoRA weights and the sinks) equal to unpatched mlx-lm, where MLX
    differentiates the sinks through its unfused path."""
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers
    model = _with_sinks(tiny_model("gpt_oss", **TINY["gpt_oss"]))
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    for layer in model.layers:
        layer.self_attn.unfreeze(keys=["sinks"], recurse=False)
    for name, leaf in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_b"):
            model.update(dict_path(name, 0.1 * mx.random.normal(leaf.shape, key=mx.random.key(len(name)))))
    batch = tokens(batch=2, length=SEQUENCE + 1, seed=5)
    lengths = mx.array([[0, SEQUENCE + 1], [0, 15]])

    def step_function():
        loss_and_grad = nn.value_and_grad(model, default_loss)

        def step(batch, lengths):
            (loss, _), grads = loss_and_grad(model, batch, lengths)
            return loss, grads

        return mx.compile(step, inputs=[model.state], outputs=[model.state]) if compiled else step

    loss, grads = step_function()(batch, lengths)
    mx.eval(loss, grads)
    with flash_mlx_lm.patched():
        patched_loss, patched_grads = step_function()(batch, lengths)
        mx.eval(patched_loss, patched_grads)
    assert flash_mlx_lm.call_counts() == {"flash": 2, "original": 0}
    assert abs(patched_loss.item() - loss.item()) < TOLERANCE * loss.item()
    grads, patched_grads = dict(tree_flatten(grads)), dict(tree_flatten(patched_grads))
    assert sum(n.endswith("sinks") for n in grads) == 2 and len(grads) == 10
    for name in grads:
        assert relative_error(patched_grads[name], grads[name]) < TOLERANCE, name


def test_gear_softcap_attention_adapter():
    from mlx_lm.models import gear
    original = gear._softcap_attention
    q = mx.random.normal((1, 4, SEQUENCE, 16), key=mx.random.key(1))
    k = mx.random.normal((1, 2, SEQUENCE, 16), key=mx.random.key(2))
    reference = original(q, k, k, scale=0.25, softcap=5.0, mask="causal")
    with flash_mlx_lm.patched():
        assert gear._softcap_attention is not original
        out = gear._softcap_attention(q, k, k, scale=0.25, softcap=5.0, mask="causal")
    assert gear._softcap_attention is original
    assert relative_error(out, reference) < TOLERANCE
    assert flash_mlx_lm.call_counts(by_model=True) == {"gear": {"flash": 1, "original": {}}}
