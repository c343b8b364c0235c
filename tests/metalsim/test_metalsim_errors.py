"""metalsim faithfulness aids and error reporting."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import metalsim

MISSING_BARRIER_SOURCE = """
    threadgroup float buf[64];
    uint tid = thread_position_in_threadgroup.x;
    buf[tid] = inp[tid];
    // BUG: a threadgroup_barrier is missing here
    out[tid] = tid > 0 ? buf[tid - 1] : 0.0f;
"""


def test_missing_barrier_caught_by_reversed_order():
    x = mx.arange(64, dtype=mx.float32) + 1
    expected = np.concatenate([[0], np.arange(63) + 1])
    kw = dict(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
              output_dtypes=[mx.float32])
    fwd = metalsim.metal_kernel(name="no_barrier", input_names=["inp"], output_names=["out"],
                                source=MISSING_BARRIER_SOURCE)
    np.testing.assert_array_equal(np.array(fwd(**kw)[0]), expected)
    rev = metalsim.metal_kernel(name="no_barrier", input_names=["inp"], output_names=["out"],
                                source=MISSING_BARRIER_SOURCE, thread_order="reversed")
    out = np.array(rev(**kw)[0])
    assert not np.array_equal(out, expected)
    assert np.isnan(out[1:]).all()  # reads of poisoned threadgroup memory


def test_reversed_order_from_environment(monkeypatch):
    monkeypatch.setenv("MLX_FLASH_METALSIM_ORDER", "reversed")
    k = metalsim.metal_kernel(name="no_barrier", input_names=["inp"], output_names=["out"],
                              source=MISSING_BARRIER_SOURCE)
    out = np.array(k(inputs=[mx.ones((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                     output_shapes=[(64,)], output_dtypes=[mx.float32])[0])
    assert np.isnan(out[1:]).all()


OOB_SOURCE = """
    uint i = thread_position_in_grid.x;
    out[i + OFFSET] = inp[i];
"""


def test_out_of_bounds_write_caught_in_bounds_mode():
    k = metalsim.metal_kernel(name="oob_write", input_names=["inp"], output_names=["out"],
                              source=OOB_SOURCE, check="bounds")
    kw = dict(inputs=[mx.ones((16,))], grid=(16, 1, 1), threadgroup=(16, 1, 1),
              output_shapes=[(16,)], output_dtypes=[mx.float32])
    out = k(template=[("OFFSET", 0)], **kw)[0]  # in bounds: fine, same result
    np.testing.assert_array_equal(np.array(out), 1)
    with pytest.raises(metalsim.MetalSimError) as e:
        k(template=[("OFFSET", 1)], **kw)
    msg = str(e.value)
    assert "oob_write" in msg and "'out'" in msg and "index 16" in msg
    assert "thread_position_in_grid=(15, 0, 0)" in msg


def test_out_of_bounds_from_environment_and_threadgroup_arrays(monkeypatch):
    monkeypatch.setenv("MLX_FLASH_METALSIM_CHECK", "bounds")
    source = """
        threadgroup float tile[4][8];
        uint t = thread_position_in_threadgroup.x;
        tile[t / 8][t % 8] = inp[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const threadgroup float* row = tile[t / 8];
        out[t] = row[(t % 8) + SHIFT];
    """
    k = metalsim.metal_kernel(name="oob_tg", input_names=["inp"], output_names=["out"],
                              source=source)
    kw = dict(inputs=[mx.arange(32, dtype=mx.float32)], grid=(32, 1, 1),
              threadgroup=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.float32])
    np.testing.assert_array_equal(np.array(k(template=[("SHIFT", 0)], **kw)[0]), np.arange(32))
    with pytest.raises(metalsim.MetalSimError, match=r"threadgroup array 'tile' index 8"):
        k(template=[("SHIFT", 1)], **kw)


def test_unsupported_construct_rejected_at_compile_time():
    source = """
        uint i = thread_position_in_grid.x;
        texture2d<float> t;
        out[i] = 0;
    """
    k = metalsim.metal_kernel(name="uses_texture", input_names=["inp"], output_names=["out"],
                              source=source)
    with pytest.raises(metalsim.MetalSimUnsupportedError) as e:
        k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])
    msg = str(e.value)
    assert "uses_texture" in msg and "source line 3" in msg and "not supported in metalsim" in msg

    k2 = metalsim.metal_kernel(name="uses_attr", input_names=["inp"], output_names=["out"],
                               source="uint i [[thread_position_in_grid]];\nout[0] = 1;")
    with pytest.raises(metalsim.MetalSimUnsupportedError, match="source line 1"):
        k2(inputs=[mx.ones((4,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(4,)],
           output_dtypes=[mx.float32])


def test_compile_error_mapped_to_source_line():
    source = """
        uint i = thread_position_in_grid.x;
        float y = inp[i];
        out[i] = y + undeclared_thing;
    """
    k = metalsim.metal_kernel(name="broken", input_names=["inp"], output_names=["out"],
                              source=source, header="inline float helper(float x) { return x; }\n")
    with pytest.raises(metalsim.CompileError) as e:
        k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])
    msg = str(e.value)
    assert "broken" in msg
    assert "source line 4: error:" in msg and "undeclared_thing" in msg

    k2 = metalsim.metal_kernel(name="broken_header", input_names=["inp"], output_names=["out"],
                               source="out[0] = helper(1.0f);",
                               header="// helper\ninline float helper(float x) { return x + ; }\n")
    with pytest.raises(metalsim.CompileError, match="header line 2: error:"):
        k2(inputs=[mx.ones((4,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(4,)],
           output_dtypes=[mx.float32])


def test_threadgroup_memory_limit():
    source = """
        threadgroup float a[4096];
        threadgroup float b[N];
        uint t = thread_position_in_threadgroup.x;
        a[t] = 1.0f; b[t] = 2.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = a[t] + b[t];
    """
    k = metalsim.metal_kernel(name="big_tg", input_names=["inp"], output_names=["out"],
                              source=source)
    kw = dict(inputs=[mx.ones((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
              output_shapes=[(32,)], output_dtypes=[mx.float32])
    np.testing.assert_array_equal(np.array(k(template=[("N", 4096)], **kw)[0]), 3)  # exactly 32 KB
    with pytest.raises(metalsim.MetalSimError, match=r"threadgroup memory.*'b'.*32768"):
        k(template=[("N", 4097)], **kw)


def test_threadgroup_size_limit():
    k = metalsim.metal_kernel(name="big_group", input_names=["inp"], output_names=["out"],
                              source="out[thread_position_in_grid.x] = 1;")
    kw = dict(inputs=[mx.ones((4,))], output_shapes=[(2048,)], output_dtypes=[mx.float32])
    out = k(grid=(2048, 1, 1), threadgroup=(1024, 1, 1), **kw)[0]
    np.testing.assert_array_equal(np.array(out), 1)
    with pytest.raises(ValueError, match="greater than"):
        k(grid=(2048, 1, 1), threadgroup=(32, 33, 1), **kw)


def test_argument_checks():
    k = metalsim.metal_kernel(name="args", input_names=["a", "b"], output_names=["out"],
                              source="out[0] = a[0] + b;")
    with pytest.raises(ValueError, match="Expected `inputs` to have size 2"):
        k(inputs=[mx.ones((4,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
          output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="Invalid template argument"):
        k(inputs=[mx.ones((4,)), 1.0], grid=(1, 1, 1), threadgroup=(1, 1, 1),
          output_shapes=[(1,)], output_dtypes=[mx.float32], template=[("X", 1.5)])
    out = k(inputs=[mx.ones((4,)), 2.5], grid=(1, 1, 1), threadgroup=(1, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
    assert out.item() == 3.5
    with pytest.raises(ValueError):
        metalsim.metal_kernel(name="x", input_names=[], output_names=[], source="")
    with pytest.raises(ValueError, match="math_mode"):
        metalsim.metal_kernel(name="x", input_names=[], output_names=["o"], source="",
                              compile_options={"math_mode": "turbo"})


FAULT_SOURCE = """
    uint i = thread_position_in_grid.x;
    if (MODE == 0) {
        out[i] = float(100 / int(inp[i]));             // integer division by zero
    } else if (MODE == 1) {
        device float* bad = (device float*)(uintptr_t(16));
        out[i] = bad[i];                               // wild pointer
    } else {
        float big[80000];                              // > the fiber stack
        for (int k = 0; k < 80000; ++k) big[k] = inp[(i + k) % 4];
        out[i] = big[int(inp[i]) * 79999];
    }
"""


@pytest.mark.parametrize("mode,what", [(0, "division by zero"), (1, "invalid memory access"),
                                       (2, "stack overflow")])
def test_faults_become_exceptions(mode, what):
    k = metalsim.metal_kernel(name="faulty", input_names=["inp"], output_names=["out"],
                              source=FAULT_SOURCE)
    kw = dict(inputs=[mx.zeros((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
              output_shapes=[(4,)], output_dtypes=[mx.float32])
    with pytest.raises(metalsim.MetalSimError, match=what) as e:
        k(template=[("MODE", mode)], **kw)
    assert "faulty" in str(e.value)
    # the runtime is still usable afterwards
    out = k(template=[("MODE", 0)], inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
            output_shapes=[(4,)], output_dtypes=[mx.float32])[0]
    np.testing.assert_array_equal(np.array(out), 100)


def test_compiler_override_and_cache_dir(monkeypatch, tmp_path):
    import shlex
    import sys

    monkeypatch.setenv("MLX_FLASH_METALSIM_CXX", f"{shlex.quote(sys.executable)} -m ziglang c++")
    monkeypatch.setenv("MLX_FLASH_METALSIM_CACHE", str(tmp_path))
    k = metalsim.metal_kernel(name="override", input_names=["inp"], output_names=["out"],
                              source="uint i = thread_position_in_grid.x; out[i] = inp[i] + 0.5;")
    out = k(inputs=[mx.ones((8,))], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
            output_dtypes=[mx.float32])[0]
    np.testing.assert_array_equal(np.array(out), 1.5)
    assert list(tmp_path.glob("k-*.so")) and list(tmp_path.glob("k-*.cpp"))
