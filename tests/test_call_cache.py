"""flash_attention keeps a call signature's decisions (mlx_flash/call_cache.py): a repeated call
reuses them, anything they depend on makes them again, and what a call counts is counted on
every call."""
import warnings

import mlx.core as mx
import pytest

import mlx_flash
from mlx_flash import api, call_cache, flash_attention
from mlx_flash.backends import get_backend
from mlx_flash.spec import check_inputs

from test_dispatch import cuda_auto  # noqa: F401 (a fixture: "auto" resolves to a CUDA backend that routes)

pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture
def choices(monkeypatch):
    """The list of backend choices flash_attention makes (one per decision it does not reuse)."""
    made = []
    real = api.choose_backend

    def counting(*args, **kwargs):
        made.append(args[1])  # the spec
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "choose_backend", counting)
    return made


def arrays(n=8, d=16, heads=2, dtype=mx.float32):
    q = mx.random.normal((1, heads, n, d), key=mx.random.key(n)).astype(dtype)
    return q, q + 1, q - 1


def test_a_repeated_call_reuses_its_decision_and_computes_the_same(choices):
    q, k, v = arrays()
    first = flash_attention(q, k, v, mask="causal", backend="mlx")
    second = flash_attention(q, k, v, mask="causal", backend="mlx")
    assert len(choices) == 1
    assert mx.array_equal(first, second).item()
    # New arrays of the same signature reuse it too; another signature does not.
    q2, k2, v2 = arrays()
    flash_attention(q2 * 2, k2, v2, mask="causal", backend="mlx")
    assert len(choices) == 1
    flash_attention(q, k, v, backend="mlx")
    flash_attention(q, k, v, mask="causal", backend="mlx", scale=0.5)
    flash_attention(q[:, :, :5], k, v, mask="causal", backend="mlx")
    flash_attention(q, k, v, mask="causal", backend="mlx", return_lse=True)
    assert len(choices) == 5


def test_gradients_through_a_kept_decision_match_a_fresh_one():
    q, k, v = arrays(n=12)
    cotangent = mx.random.normal(q.shape, key=mx.random.key(1))

    def grads():
        return mx.vjp(lambda q, k, v: flash_attention(q, k, v, mask="causal", backend="mlx"), [q, k, v],
                      [cotangent])

    fresh = grads()
    kept = grads()
    call_cache.forget()
    again = grads()
    for a, b, c in zip(fresh[1], kept[1], again[1]):
        assert mx.array_equal(a, b).item() and mx.array_equal(a, c).item()


def test_array_masks_and_sinks_key_by_shape_and_dtype(choices):
    q, k, v = arrays()
    keep = mx.random.uniform(shape=(8, 8), key=mx.random.key(2)) > 0.3
    flash_attention(q, k, v, mask=keep, backend="mlx")
    flash_attention(q, k, v, mask=~keep, backend="mlx")  # other data, same signature
    assert len(choices) == 1
    flash_attention(q, k, v, mask=keep.astype(mx.float32), backend="mlx")  # additive
    flash_attention(q, k, v, mask=keep[None], backend="mlx")  # rank 3
    sinks = mx.zeros((2,))
    flash_attention(q, k, v, sinks=sinks, backend="mlx")
    flash_attention(q, k, v, sinks=sinks + 1, backend="mlx")
    assert len(choices) == 4
    # The kept decision reshapes each call's own mask: the result follows the data.
    a = flash_attention(q, k, v, mask=keep, backend="mlx")
    b = flash_attention(q, k, v, mask=~keep, backend="mlx")
    assert not mx.array_equal(a, b).item()


def test_bad_arguments_still_raise_after_a_good_call_of_the_same_shapes():
    q, k, v = arrays()
    flash_attention(q, k, v, backend="mlx")
    with pytest.raises(ValueError, match="mask"):
        flash_attention(q, k, v, mask="diagonal", backend="mlx")
    with pytest.raises(TypeError, match="return_lse"):
        flash_attention(q, k, v, return_lse=1, backend="mlx")
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=float("nan"), backend="mlx")
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.astype(mx.float16), v, backend="mlx")
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, k, v, backend="triton")


def test_calls_that_cannot_be_keyed_take_the_full_path(choices):
    q, k, v = arrays()
    for _ in range(2):
        flash_attention(q, k, v, scale=mx.array(0.25), backend="mlx")  # read with .item()
        flash_attention(q, k, v, window_size=[2, 0], backend="mlx")    # a list
        flash_attention(q, k, v, backend="mlx", stream=mx.cpu)         # a DeviceType
    assert len(choices) == 6


def test_an_environment_change_or_forget_decides_again(choices, monkeypatch):
    q, k, v = arrays()
    flash_attention(q, k, v)
    flash_attention(q, k, v)
    assert len(choices) == 1
    monkeypatch.setenv("MLX_FLASH_TUNED", "0")
    flash_attention(q, k, v)
    flash_attention(q, k, v)
    assert len(choices) == 2
    call_cache.forget()
    flash_attention(q, k, v)
    assert len(choices) == 3


def test_a_kept_decision_expires_after_the_recheck_period(choices, monkeypatch):
    q, k, v = arrays()
    clock = [1000.0]
    monkeypatch.setattr(call_cache.time, "monotonic", lambda: clock[0])
    flash_attention(q, k, v, backend="mlx")
    clock[0] += 0.5 * call_cache.RECHECK_S
    flash_attention(q, k, v, backend="mlx")
    assert len(choices) == 1
    clock[0] += call_cache.RECHECK_S
    flash_attention(q, k, v, backend="mlx")
    assert len(choices) == 2


def test_fallbacks_are_counted_on_every_call_and_warned_once(monkeypatch):
    """A kept decision that is a fallback counts each call, as the full path does."""
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    metal = get_backend("metal")
    monkeypatch.setattr(metal, "unsupported_reason", lambda spec: "variant failed its self-check")
    mlx_flash.reset_fallback_counts()
    q, k, v = arrays()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                mx.eval(flash_attention(q, k, v))
        counts = mlx_flash.fallback_counts()
        assert list(counts.values()) == [4], counts
        assert sum(issubclass(w.category, mlx_flash.FallbackWarning) for w in caught) == 1
    finally:
        mlx_flash.reset_fallback_counts()


def test_routes_are_counted_on_every_call(cuda_auto):  # noqa: F811
    q = mx.zeros((1, 2, 128, 16), mx.bfloat16)
    for _ in range(3):
        flash_attention(q, q, q, mask="causal")
    counts = mlx_flash.route_counts()
    assert list(counts.values()) == [3] and "line 17" in next(iter(counts)), counts
    assert mlx_flash.fallback_counts() == {}


def test_a_routed_call_with_nothing_around_mx_fast_calls_it_directly(cuda_auto, monkeypatch):  # noqa: F811
    """A routed call that needs nothing around mx.fast (no array mask, no query rows before the
    causal diagonal, no lse or sinks) is kept with mx.fast's own call, which gives exactly mx.fast's
    output and is still counted; a call with a stream argument (the key holds only its device)
    and the other routed calls take the general path (the fast backend's `attention`)."""
    q = mx.random.normal((1, 2, 128, 16), key=mx.random.key(1)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 2, 128, 16), key=mx.random.key(s)).astype(mx.bfloat16) for s in (2, 3))
    fast = get_backend("fast")
    general = []
    real = fast.attention
    monkeypatch.setattr(fast, "attention", lambda *args, **kwargs: general.append(1) or real(*args, **kwargs))

    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=16 ** -0.5, mask="causal")
    for _ in range(2):
        assert mx.array_equal(flash_attention(q, k, v, mask="causal"), want).item()
    assert general == [] and list(mlx_flash.route_counts().values()) == [2]
    stream = mx.default_stream(mx.default_device())
    assert mx.array_equal(flash_attention(q, k, v, mask="causal", stream=stream), want).item()
    assert general == [1] and list(mlx_flash.route_counts().values()) == [3]
    mask = mx.ones((1, 1, 128, 128), mx.bool_)
    flash_attention(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), mask=mask)  # ROW_BOOL
    assert general == [1, 1] and sum(mlx_flash.route_counts().values()) == 4
    spec = check_inputs(q, k[:, :, :64], v[:, :, :64], mask="causal")[0]
    assert fast.direct_call(spec) is None  # Nq > Nk: the first rows see no key and are zeros


def test_the_store_is_bounded():
    store = call_cache.Kept()
    now = call_cache.stamp()
    for i in range(call_cache.MAX_ENTRIES + 10):
        store.store(i, now, i)
    assert len(store._entries) <= call_cache.MAX_ENTRIES
    assert store.lookup(call_cache.MAX_ENTRIES + 9, now) == call_cache.MAX_ENTRIES + 9
    assert store.lookup(None, now) is None
