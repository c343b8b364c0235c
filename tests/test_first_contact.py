"""First contact with the real Metal kernels, through the simulator and its fault injection.

MLX_FLASH_METALSIM_FAULT=compile:<kernel> makes the simulator reject a kernel like a compiler
error, corrupt:<kernel> makes it compute wrong numbers (mlx_flash/metalsim/fault.py). Each fault,
on each of the three kernels, must be caught by the first-contact guard (backends/guard.py) under
every transformation a training step uses: the user's call is served by the "mlx" backend with
results equal to it (and to the float64 reference), one FallbackWarning and one count.

Under mx.compile the simulator itself cannot run a kernel (it reads its inputs with numpy, which
MLX forbids while tracing): a faulty kernel is still caught there, because the guard's probe
evaluates only its own arrays; a healthy one raises the simulator's clear MetalSimError, which is
what the last test checks (on a Mac the real kernel runs inside mx.compile).
"""
from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from metal_compiler import require_metal_compiler  # noqa: E402
require_metal_compiler()

import mlx_flash  # noqa: E402
from mlx_flash import reference  # noqa: E402
from mlx_flash.backends import guard  # noqa: E402
from mlx_flash.metalsim import CompileError, MetalSimError, fault  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

KERNELS = ("forward", "backward_query", "backward_key_value")
TRANSFORMS = ("grad", "value_and_grad", "compile", "checkpoint")
# Small: one variant set (D = 16, fp32, causal, GQA 2:1) compiles once for the whole module.
SHAPE = dict(batch=1, kv_heads=1, group=2, q_len=37, kv_len=45, head_dim=16)


@pytest.fixture
def simulated(monkeypatch):
    """Metal kernels through the simulator; verdicts, counts and faults start clean."""
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    monkeypatch.delenv("MLX_FLASH_METALSIM_FAULT", raising=False)
    monkeypatch.delenv("MLX_FLASH_SELF_CHECK", raising=False)  # metal default: on
    guard.GUARD.forget()
    mlx_flash.reset_fallback_counts()
    yield monkeypatch
    guard.GUARD.forget()
    mlx_flash.reset_fallback_counts()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    s = SHAPE
    hq = s["kv_heads"] * s["group"]

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    query_shape = (s["batch"], hq, s["q_len"], s["head_dim"])
    key_shape = (s["batch"], s["kv_heads"], s["kv_len"], s["head_dim"])
    return normal(*query_shape), normal(*key_shape), normal(*key_shape), normal(*query_shape)


def _run(transform, backend, q, k, v, d_out):
    """(loss, dq, dk, dv) of one flash_attention call under `transform`."""
    def loss(q_, k_, v_):
        return (mlx_flash.flash_attention(q_, k_, v_, mask="causal", backend=backend) * d_out).sum()

    f = mx.checkpoint(loss) if transform == "checkpoint" else loss
    value_and_grad = mx.value_and_grad(f, argnums=(0, 1, 2))
    if transform == "grad":
        grads = mx.grad(f, argnums=(0, 1, 2))(q, k, v)
        value = loss(q, k, v) if backend == "mlx" else None
    elif transform == "compile":
        value, grads = mx.compile(value_and_grad)(q, k, v)
    else:
        value, grads = value_and_grad(q, k, v)
    mx.eval(value, grads)
    return (value,) + tuple(grads)


def _reference_gradients(q, k, v, d_out):
    spec, _ = check_inputs(q, k, v, mask="causal")
    arrays = [np.array(x) for x in (q, k, v, d_out)]
    return reference.attention_backward(*arrays, spec)


def _relative(x, ref):
    x = np.asarray(x, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("kind", ["compile", "corrupt"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fault_is_served_by_mlx_once_warned(simulated, kernel, kind, transform):
    simulated.setenv("MLX_FLASH_METALSIM_FAULT", f"{kind}:{kernel}")
    q, k, v, d_out = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(transform, "metal", q, k, v, d_out)
    messages = [str(w.message) for w in caught if issubclass(w.category, mlx_flash.FallbackWarning)]
    assert len(messages) == 1, messages
    assert f"mlx_flash_{kernel}_d16" in messages[0]  # names the variant that failed
    if kind == "compile":
        assert "failed to compile or run" in messages[0] and "fault injected" in messages[0]
    else:
        assert "first-use self-check" in messages[0] and "mlx_flash report" in messages[0]
    # One count per flash_attention call; mx.checkpoint calls the function again in the backward.
    assert list(mlx_flash.fallback_counts().values()) == [2 if transform == "checkpoint" else 1]

    # Served by the fallback path: the "mlx" backend's results (to float32 rounding, should the
    # fallback be another exact implementation), and the float64 reference's.
    want = _run(transform, "mlx", q, k, v, d_out)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)
    if got[0] is not None:
        np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-5, atol=1e-6)
    for name, g, r in zip(("dq", "dk", "dv"), got[1:], _reference_gradients(q, k, v, d_out)):
        assert _relative(g, r) <= reference.GRADIENT_TOLERANCE["float32"], name


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "checkpoint"])
def test_no_fault_no_fallback(simulated, transform):
    q, k, v, d_out = _inputs(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mlx_flash.FallbackWarning)
        got = _run(transform, "metal", q, k, v, d_out)
    assert mlx_flash.fallback_counts() == {}
    (record,) = guard.GUARD.records()
    assert record["verdict"] is None and "mlx_flash_backward_key_value_d16" in record["variants"]
    for name, g, r in zip(("dq", "dk", "dv"), got[1:], _reference_gradients(q, k, v, d_out)):
        assert _relative(g, r) <= reference.GRADIENT_TOLERANCE["float32"], name


def test_no_fault_under_compile_passes_the_guard_then_the_simulator_says_why_it_stops(simulated):
    """The probe runs (and passes) while mx.compile traces; the simulated kernel then cannot read
    traced inputs and says so with a MetalSimError (a real Metal kernel runs there)."""
    q, k, v, d_out = _inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mlx_flash.FallbackWarning)
        with pytest.raises(MetalSimError, match=r"inside mx.compile or mx.vmap"):
            _run("compile", "metal", q, k, v, d_out)
    assert mlx_flash.fallback_counts() == {}
    assert [r["verdict"] for r in guard.GUARD.records()] == [None]


def test_fault_value_is_checked(simulated):
    for bad in ("compile", "corrupt:", "break:forward", "forward"):
        simulated.setenv("MLX_FLASH_METALSIM_FAULT", bad)
        with pytest.raises(ValueError, match="MLX_FLASH_METALSIM_FAULT"):
            fault.active_fault()
    simulated.setenv("MLX_FLASH_METALSIM_FAULT", "compile:a:b")
    assert fault.active_fault() == fault.Fault("compile", "a:b")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_faults_on_a_plain_kernel(simulated, dtype):
    """compile: raises like a compiler error naming the kernel; corrupt: changes one element per
    threadgroup; a kernel whose name does not match is untouched."""
    from mlx_flash import metalsim

    copy = metalsim.metal_kernel(name="fault_probe_copy", input_names=["x"], output_names=["y"],
                                 source="uint i = thread_position_in_grid.x; y[i] = x[i];")
    x = mx.arange(64).astype(dtype) / 8
    run = dict(inputs=[x], output_shapes=[(64,)], output_dtypes=[dtype], grid=(64, 1, 1), threadgroup=(16, 1, 1))
    simulated.setenv("MLX_FLASH_METALSIM_FAULT", "compile:other_kernel")
    assert mx.array_equal(copy(**run)[0], x)
    simulated.setenv("MLX_FLASH_METALSIM_FAULT", "compile:probe_copy")
    with pytest.raises(CompileError, match=r"(?s)failed to compile kernel 'fault_probe_copy'.*fault injected"):
        copy(**run)
    simulated.setenv("MLX_FLASH_METALSIM_FAULT", "corrupt:probe_copy")
    y = np.array(copy(**run)[0].astype(mx.float32))
    changed = np.flatnonzero(y != np.array(x.astype(mx.float32)))
    assert changed.tolist() == [0, 16, 32, 48]  # 4 threadgroups, one element each
    np.testing.assert_array_equal(y[changed] - np.array(x.astype(mx.float32))[changed], fault.CORRUPTION)
