"""The fallback rule: a call the chosen kernel backend cannot serve goes to mx.fast where that is
exact (and its unfused memory fits), else to the "mlx" backend; counted once per call, warned
once per reason, and the results equal the float64 reference either way."""
import dataclasses
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
from mlx_flash import flash_attention, reference
from mlx_flash.backends import fast, get_backend
from mlx_flash.spec import check_inputs

from attention_cases import (FORWARD_TOLERANCE, GRADIENT_TOLERANCE, Case, make_arrays, relative_error,


                             to_numpy)


# Routing and fp32 tolerances as on a CPU device, wherever the suite runs (see conftest.on_cpu).
pytestmark = pytest.mark.usefixtures("on_cpu")

FAST = "using mx.fast.scaled_dot_product_attention"
MLX = "using 'mlx'"


@pytest.fixture
def kernel_refuses(monkeypatch):
    """"auto" resolves to the (simulated) Metal backend, which refuses every call."""
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    metal = get_backend("metal")
    monkeypatch.setattr(metal, "unsupported_reason", lambda spec: "variant failed its self-check")
    mlx_flash.reset_fallback_counts()
    yield metal
    mlx_flash.reset_fallback_counts()


def run_and_check(case: Case, return_lse=False):
    """One forward+backward through flash_attention(backend="auto"), checked against float64."""
    a = make_arrays(case)
    spec, mask4 = check_inputs(a.q, a.k, a.v, mask=a.mask, **a.kwargs)
    np_mask = None if mask4 is None else to_numpy(mask4)
    q, k, v, d_out = (to_numpy(x) for x in (a.q, a.k, a.v, a.d_out))
    ref_out, _ = reference.attention_forward(q, k, v, spec, np_mask)
    ref_grads = reference.attention_backward(q, k, v, d_out, spec, np_mask)

    def loss(q_, k_, v_):
        o = flash_attention(q_, k_, v_, mask=a.mask, return_lse=return_lse, **a.kwargs)
        o = o[0] if return_lse else o
        return (o.astype(mx.float32) * a.d_out.astype(mx.float32)).sum(), o

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mlx_flash.FallbackWarning)
        (_, out), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(a.q, a.k, a.v)
    assert out.dtype == a.q.dtype and out.shape == ref_out.shape
    errors = {"out": relative_error(to_numpy(out), ref_out)}
    errors.update({n: relative_error(to_numpy(g), r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    limits = {n: FORWARD_TOLERANCE[case.dtype] if n == "out" else GRADIENT_TOLERANCE[case.dtype] for n in errors}
    assert all(errors[n] <= limits[n] for n in errors), f"{case}: errors {errors} over {limits}"


def destinations():
    """{destination: calls} from the fallback counts (each call counted once)."""
    counts = mlx_flash.fallback_counts()
    return {"fast": sum(c for r, c in counts.items() if FAST in r),
            "mlx": sum(c for r, c in counts.items() if MLX in r)}


# Rows that see no key occur in the bool / additive cases (some rows fully dropped) and under
# causal with q_len > kv_len: mx.fast must give them 0 output and 0 gradient like our backends.
EXACT_ON_FAST = [
    Case(q_len=33, kv_len=47, head_dim=16),
    Case(q_len=40, kv_len=40, head_dim=24, mask="causal", kv_heads=2, group=3),
    Case(q_len=45, kv_len=20, head_dim=8, mask="causal", batch=2),
    Case(q_len=30, kv_len=37, head_dim=16, mask="bool", batch=2, kv_heads=2, group=2, seed=3),
    Case(q_len=30, kv_len=37, head_dim=16, mask="additive", mask_shape=(False, True, True, True), seed=4),
    Case(q_len=48, kv_len=48, head_dim=32, mask="causal", dtype="float16", seed=5),
    Case(q_len=48, kv_len=31, head_dim=32, mask="bool", dtype="bfloat16", seed=6),
]


@pytest.mark.parametrize("case", EXACT_ON_FAST, ids=lambda c: f"{c.mask}-{c.dtype}-{c.q_len}x{c.kv_len}")
def test_unsupported_call_goes_to_mx_fast_when_exact(kernel_refuses, case):
    run_and_check(case)
    # value_and_grad runs flash_attention once: one call, one count.
    assert destinations() == {"fast": 1, "mlx": 0}, mlx_flash.fallback_counts()


def test_value_dim_differs_from_head_dim_goes_to_mx_fast(kernel_refuses):
    q, k = mx.random.normal((1, 2, 20, 16)), mx.random.normal((1, 2, 24, 16))
    v = mx.random.normal((1, 2, 24, 8))
    spec, _ = check_inputs(q, k, v, mask="causal")
    with pytest.warns(mlx_flash.FallbackWarning):
        out = flash_attention(q, k, v, mask="causal")
    ref, _ = reference.attention_forward(np.array(q), np.array(k), np.array(v), spec)
    assert relative_error(np.array(out), ref) < 1e-5
    assert destinations() == {"fast": 1, "mlx": 0}


@pytest.mark.parametrize("case, lse", [
    (Case(q_len=30, kv_len=40, mask="window", window=(5, 3)), False),
    (Case(q_len=30, kv_len=40, mask="causal", softcap=5.0), False),
    (Case(q_len=30, kv_len=40, mask="bool", seed=9), True),
], ids=["window", "softcap", "return_lse"])
def test_what_mx_fast_cannot_give_goes_to_mlx(kernel_refuses, case, lse):
    run_and_check(case, return_lse=lse)
    assert destinations() == {"fast": 0, "mlx": 1}, mlx_flash.fallback_counts()


def test_unavailable_under_auto_follows_the_same_rule(kernel_refuses, monkeypatch):
    monkeypatch.setattr(kernel_refuses, "unavailable_reason", lambda device: "no Metal GPU")
    run_and_check(Case(q_len=24, kv_len=24, mask="causal"))
    run_and_check(Case(q_len=24, kv_len=24, softcap=30.0))
    assert destinations() == {"fast": 1, "mlx": 1}
    assert all("unavailable (no Metal GPU)" in r for r in mlx_flash.fallback_counts())


def test_over_the_memory_budget_goes_to_mlx(kernel_refuses, monkeypatch):
    monkeypatch.setattr(fast, "memory_budget_bytes", lambda device: 16 * fast.unfused_bytes(spec_of(64, 64)))
    run_and_check(Case(q_len=64, kv_len=64, mask="causal"))   # exactly 1/16 of the memory: fits
    run_and_check(Case(q_len=64, kv_len=65, mask="causal"))   # one more key: over
    assert destinations() == {"fast": 1, "mlx": 1}
    assert any("unfused under grad" in r for r in mlx_flash.fallback_counts())


def spec_of(nq, nk):
    return check_inputs(mx.zeros((1, 1, nq, 16)), mx.zeros((1, 1, nk, 16)), mx.zeros((1, 1, nk, 16)))[0]


def test_sinks_never_go_to_mx_fast():
    plain = spec_of(8, 8)
    spec = dataclasses.replace(plain, has_sinks=True)
    assert "sinks" in get_backend("fast").unsupported_reason(spec, False, mx.cpu)


def test_each_reason_warns_once_and_counts_every_call(kernel_refuses):
    q = mx.random.normal((1, 1, 8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            mx.eval(flash_attention(q, q, q))
            mx.eval(flash_attention(q, q, q, softcap=2.0))
    assert sum(issubclass(w.category, mlx_flash.FallbackWarning) for w in caught) == 2
    assert destinations() == {"fast": 3, "mlx": 3}
    assert len(mlx_flash.fallback_counts()) == 2


def test_fast_is_not_a_public_backend_name():
    q = mx.zeros((1, 1, 4, 8))
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attention(q, q, q, backend="fast")


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_rows_that_see_no_key_are_zero_on_mx_fast(kernel_refuses, kind):
    rng = np.random.default_rng(7)
    q, k, v, d_out = (mx.array(rng.standard_normal((1, 2, 12, 8)).astype(np.float32)) for _ in range(4))
    keep = rng.random((1, 1, 12, 12)) < 0.6
    keep[..., 3, :] = False  # row 3 sees no key
    mask = mx.array(keep) if kind == "bool" else mx.array(np.where(keep, 0.5, -np.inf).astype(np.float32))
    spec, mask4 = check_inputs(q, k, v, mask=mask)
    loss = lambda q, k, v: (flash_attention(q, k, v, mask=mask) * d_out).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mlx_flash.FallbackWarning)
        grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
        out = flash_attention(q, k, v, mask=mask)
    args = [np.array(x) for x in (q, k, v)]
    ref_out, _ = reference.attention_forward(*args, spec, np.array(mask4))
    ref_grads = reference.attention_backward(*args, np.array(d_out), spec, np.array(mask4))
    assert np.all(np.array(out)[..., 3, :] == 0) and np.all(np.array(grads[0])[..., 3, :] == 0)
    assert relative_error(np.array(out), ref_out) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert relative_error(np.array(g), r) < 1e-5
    assert destinations() == {"fast": 2, "mlx": 0}
