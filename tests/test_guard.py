"""The first-contact guard (mlx_flash/backends/guard.py) with stand-in kernel backends.

A stand-in wraps the "mlx" backend and breaks on request (a compiler error in one stage, or
wrong numbers), so the routing is tested on any machine; the Metal simulator's fault injection
tests the same path with the real kernels.
"""
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
from mlx_flash import backends
from mlx_flash.backends import guard, mlx_ops

from attention_cases import Case, check_case


# Routing and fp32 tolerances as on a CPU device, wherever the suite runs (see conftest.on_cpu).
pytestmark = pytest.mark.usefixtures("on_cpu")



class StandIn:
    """A kernel backend in protocol, computing with the "mlx" backend, broken on request.

    Args:
        fail: "forward" or "backward": that stage raises like a compiler error.
        corrupt: "dq" / "d_sinks": that gradient is wrong by 50%.
    """

    name = "metal"

    def __init__(self, fail=None, corrupt=None):
        self.fail, self.corrupt = fail, corrupt
        self.forward_calls = 0

    def unavailable_reason(self, device):
        return None

    def unsupported_reason(self, spec):
        return None

    def variant_key(self, spec, mask_dtype=None):
        return (spec.head_dim, spec.dtype, spec.causal, spec.mask_kind, mask_dtype)

    def variant_name(self, kernel, spec, mask_dtype=None):
        return f"standin_{kernel}_d{spec.head_dim}"

    def forward(self, q, k, v, mask, spec, sinks=None):
        self.forward_calls += 1
        if self.fail == "forward":
            raise RuntimeError("program_source:12:3: error: use of undeclared identifier 'simd_foo'")
        return mlx_ops.forward(q, k, v, mask, spec, sinks=sinks)

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=None):
        if self.fail == "backward":
            raise RuntimeError("nvrtc: error: identifier \"wgmma_foo\" is undefined")
        dq, dk, dv, d_sinks = mlx_ops.backward(q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=sinks)
        if self.corrupt == "d_sinks" and d_sinks is not None:
            d_sinks = d_sinks * 1.5
        return (dq * 1.5 if self.corrupt == "dq" else dq), dk, dv, d_sinks


@pytest.fixture
def stand_in(monkeypatch):
    """install(**kwargs): a StandIn serves backend="metal"; verdicts and counts start clean."""
    def install(**kwargs):
        backend = StandIn(**kwargs)
        real = backends.get_backend
        monkeypatch.setattr(backends, "get_backend", lambda name: backend if name == "metal" else real(name))
        return backend

    guard.GUARD.forget()
    mlx_flash.reset_fallback_counts()
    yield install
    guard.GUARD.forget()
    mlx_flash.reset_fallback_counts()


CASE = Case(batch=1, kv_heads=2, group=2, q_len=40, kv_len=52, head_dim=24, dtype="float32", mask="causal")


def _fallbacks():
    return {reason: n for reason, n in mlx_flash.fallback_counts().items() if "metal" in reason}


@pytest.mark.parametrize("fail", ["forward", "backward"])
def test_build_failure_is_served_elsewhere_once_warned(stand_in, fail):
    backend = stand_in(fail=fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_case(CASE, backend="metal")   # forward and gradients against float64
        check_case(CASE, backend="metal")
    messages = [str(w.message) for w in caught if issubclass(w.category, mlx_flash.FallbackWarning)]
    assert len(messages) == 1, messages
    assert "failed to compile or run" in messages[0]
    assert ("simd_foo" if fail == "forward" else "wgmma_foo") in messages[0]
    expected_name = "kernel standin_forward_d24" if fail == "forward" else "backward kernels"
    assert expected_name in messages[0]
    (reason, count), = _fallbacks().items()
    assert count == 4  # one per call: each check_case calls flash_attention twice (forward, grad)
    assert backend.forward_calls == 1  # probed once; the user's calls never reached the broken kernels


def test_self_check_catches_wrong_numbers(stand_in, monkeypatch):
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "1")
    stand_in(corrupt="dq")
    with pytest.warns(mlx_flash.FallbackWarning, match=r"self-check: dq differs .* relative error"):
        check_case(CASE, backend="metal")
    assert sum(_fallbacks().values()) >= 1


def test_self_check_compares_the_sink_gradient(stand_in, monkeypatch):
    """With sinks the probe passes them to forward and backward and checks d_sinks (results[5])."""
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "1")
    stand_in(corrupt="d_sinks")
    case = Case(batch=1, kv_heads=2, group=2, q_len=40, kv_len=52, head_dim=24, dtype="float32", mask="causal",
                sinks=True)
    with pytest.warns(mlx_flash.FallbackWarning, match=r"self-check: d_sinks differs .* relative error"):
        errors = check_case(case, backend="metal")  # served by the "mlx" backend: d_sinks exact
    assert "d_sinks" in errors
    assert sum(_fallbacks().values()) >= 1


def test_self_check_off_lets_wrong_numbers_through(stand_in, monkeypatch):
    """The switch works both ways: with the self-check off, only build failures are caught."""
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "0")
    stand_in(corrupt="dq")
    with pytest.raises(AssertionError, match="dq"):
        check_case(CASE, backend="metal")
    assert _fallbacks() == {}


def test_healthy_backend_is_probed_once_and_silent(stand_in, monkeypatch):
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "1")
    backend = stand_in()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mlx_flash.FallbackWarning)
        check_case(CASE, backend="metal")
        probes = backend.forward_calls
        check_case(CASE, backend="metal")
    assert _fallbacks() == {}
    assert backend.forward_calls == probes + 2  # the second round adds only the user's own calls
    assert len(guard.GUARD.probe_seconds) == 1


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "compile", "checkpoint"])
def test_guard_under_transformations(stand_in, transform):
    """The probe runs while the user's function is being transformed; the call still falls back."""
    stand_in(fail="forward")
    rng = np.random.default_rng(3)
    q, k, v = (mx.array(rng.standard_normal((1, 2, 33, 16)).astype(np.float32)) for _ in range(3))

    def loss(q_, k_, v_, backend):
        return mlx_flash.flash_attention(q_, k_, v_, mask="causal", backend=backend).sum()

    def run(backend):
        f = lambda q_, k_, v_: loss(q_, k_, v_, backend)  # noqa: E731
        if transform == "checkpoint":
            f = mx.checkpoint(f)
        if transform == "value_and_grad":
            return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)[1]
        grad = mx.grad(f, argnums=(0, 1, 2))
        return (mx.compile(grad) if transform == "compile" else grad)(q, k, v)

    with pytest.warns(mlx_flash.FallbackWarning):
        got = run("metal")
    want = run("mlx")
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)


def test_probe_spec_keeps_compile_time_constants():
    q = mx.zeros((3, 8, 500, 40), mx.bfloat16)
    k = mx.zeros((3, 2, 700, 40), mx.bfloat16)
    mask = mx.zeros((3, 1, 500, 700), mx.bfloat16)
    spec, _ = mlx_flash.spec.check_inputs(q, k, k, mask=mask, window_size=(30, 2), softcap=20.0, scale=0.3)
    small = guard.probe_spec(spec)
    for field in ("head_dim", "value_dim", "dtype", "scale", "causal", "window", "softcap", "mask_kind"):
        assert getattr(small, field) == getattr(spec, field), field
    assert (small.batch, small.kv_heads, small.q_heads) == (1, 1, 2)
    assert small.mask_shape == (1, 1, guard.PROBE_QUERIES, guard.PROBE_KEYS)
    x = guard.probe_inputs(small, mx.bfloat16)
    assert x.mask.dtype == mx.bfloat16 and x.mask.shape == small.mask_shape


def test_self_check_switch(monkeypatch):
    monkeypatch.delenv("MLX_FLASH_SELF_CHECK", raising=False)
    assert guard.self_check_enabled("metal") and not guard.self_check_enabled("cuda")
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "1")
    assert guard.self_check_enabled("cuda")
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "0")
    assert not guard.self_check_enabled("metal")
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "yes")
    with pytest.raises(ValueError, match="MLX_FLASH_SELF_CHECK"):
        guard.self_check_enabled("metal")
