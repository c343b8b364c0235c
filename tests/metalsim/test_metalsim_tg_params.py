"""Threadgroup arrays passed to function templates taking `threadgroup T*` and
`const threadgroup T*`: valid MSL that must
compile in both modes, with out-of-bounds accesses through such parameters
still caught in bounds mode."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import metalsim

HEADER = """
template <typename T>
inline void fill(threadgroup T* p, uint i) { p[i] = T(1); }
template <typename T>
inline T load(const threadgroup T* p, uint i) { return p[i]; }
"""

# WRITE_SHIFT / READ_SHIFT push the access through the mutable / const
# parameter past the end of the array.
SOURCE = """
    threadgroup float buf[64];
    threadgroup float tile[8][8];
    uint t = thread_index_in_threadgroup;
    fill(buf, t + WRITE_SHIFT);
    fill(tile[t / 8], t % 8);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = load(buf, t + READ_SHIFT) + load(tile[t / 8], t % 8);
"""


def _run(check, write_shift=0, read_shift=0):
    kernel = metalsim.metal_kernel(name="tg_template_params", input_names=["inp"],
                                   output_names=["out"], header=HEADER, source=SOURCE,
                                   check=check)
    out = kernel(inputs=[mx.zeros((64,))], template=[("WRITE_SHIFT", write_shift),
                                                     ("READ_SHIFT", read_shift)],
                 grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                 output_dtypes=[mx.float32])[0]
    return np.array(out)


@pytest.mark.parametrize("check", ["none", "bounds"])
def test_threadgroup_array_to_template_pointer_parameters(check):
    np.testing.assert_array_equal(_run(check), np.full(64, 2.0, np.float32))


@pytest.mark.parametrize("shifts", [dict(write_shift=1), dict(read_shift=1)],
                         ids=["threadgroup T*", "const threadgroup T*"])
def test_out_of_bounds_through_template_pointer_parameter_caught(shifts):
    with pytest.raises(metalsim.MetalSimError, match=r"threadgroup array 'buf' index 64"):
        _run("bounds", **shifts)


IDIOMS_HEADER = """
inline float sum2(const device float* p) { return p[0] + p[1]; }
template <typename T> inline T first(const threadgroup T* p) { return *p; }
"""

# Checked pointers to T derive from checked pointers to const T: comparisons,
# differences and conversions mixing the two must stay unambiguous.
IDIOMS_SOURCE = """
    threadgroup float buf[64];
    uint t = thread_index_in_threadgroup;
    buf[t] = inp[t];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    threadgroup float* a = buf;
    threadgroup float* b = buf + 1;
    const threadgroup float* c = a;
    float r = 0;
    if (a) r += 1;
    if (!a) r += 100;
    if (a < b) r += 1;
    if (a == nullptr) r += 100;
    if (a != b) r += 1;
    if (c == a) r += 1;
    r += float(b - a) + float(b - c) + *(2 + a);
    a += 1; a++; ++a; a--; --a; a -= 1;
    r += a[0] + first(b) + first(c) + first(buf + 2);
    threadgroup float2* pairs = reinterpret_cast<threadgroup float2*>(buf);
    const device float* second = inp + 1;
    r += pairs[1].x + sum2(inp) + sum2(second) + (second > inp ? 1 : 0);
    out[t] = r;
"""


@pytest.mark.parametrize("check", ["none", "bounds"])
def test_pointer_idioms_mixing_const_and_mutable(check):
    kernel = metalsim.metal_kernel(name="pointer_idioms", input_names=["inp"],
                                   output_names=["out"], header=IDIOMS_HEADER,
                                   source=IDIOMS_SOURCE, check=check)
    out = kernel(inputs=[mx.arange(64, dtype=mx.float32)], grid=(64, 1, 1),
                 threadgroup=(64, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32])[0]
    # 4 true comparisons + 1 + 1 (differences) + buf[2] + buf[0] + buf[1] + buf[0] + buf[2]
    # + buf[2] (pairs[1].x) + (0 + 1) + (1 + 2) + 1
    np.testing.assert_array_equal(np.array(out), np.full(64, 18.0, np.float32))
