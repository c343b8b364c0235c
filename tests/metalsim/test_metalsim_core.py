"""metalsim: kernels checked against numpy."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import metalsim
from mlx_flash.metalsim.samples import matmul_kernel, run_matmul


def np_of(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


def test_mlx_docs_exp_example():
    source = """
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::exp(tmp);
    """
    kernel = metalsim.metal_kernel(name="myexp", input_names=["inp"], output_names=["out"],
                                   source=source)
    a = mx.random.normal(shape=(4, 16)).astype(mx.float16)
    b = kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
               threadgroup=(256, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])[0]
    assert b.dtype == mx.float16 and b.shape == a.shape
    assert mx.allclose(b, mx.exp(a)).item()


STRIDED_SOURCE = """
    uint elem = thread_position_in_grid.x;
    int64_t loc = elem_to_loc(int64_t(elem), inp_shape, inp_strides, inp_ndim);
    out[elem] = inp[loc] * scale;
"""


@pytest.mark.parametrize("contiguous", [False, True])
def test_strided_inputs(contiguous):
    kernel = metalsim.metal_kernel(name="strided_copy", input_names=["inp", "scale"],
                                   output_names=["out"], source=STRIDED_SOURCE,
                                   ensure_row_contiguous=contiguous)
    base = mx.arange(6 * 10, dtype=mx.float32).reshape(6, 10)
    views = [base.T, base[::2, 1::3], base[1:5, 2:9].T]
    for v in views:
        out = kernel(inputs=[v, 2.0], grid=(v.size, 1, 1), threadgroup=(32, 1, 1),
                     output_shapes=[v.shape], output_dtypes=[mx.float32])[0]
        np.testing.assert_array_equal(np.array(out), np.array(v) * 2)


def test_strides_passed_as_is_without_copy():
    source = """
        uint i = thread_position_in_grid.x;
        if (i < inp_ndim) { out[i] = inp_strides[i]; out[4 + i] = inp_shape[i]; }
    """
    k_view = metalsim.metal_kernel(name="strides_view", input_names=["inp"], output_names=["out"],
                                   source=source, ensure_row_contiguous=False)
    k_copy = metalsim.metal_kernel(name="strides_copy", input_names=["inp"], output_names=["out"],
                                   source=source, ensure_row_contiguous=True)
    v = mx.zeros((3, 5), dtype=mx.float32).T  # shape (5, 3), strides (1, 5)
    kw = dict(inputs=[v], grid=(2, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(8,)],
              output_dtypes=[mx.int32], init_value=0)
    np.testing.assert_array_equal(np.array(k_view(**kw)[0])[[0, 1, 4, 5]], [1, 5, 5, 3])
    np.testing.assert_array_equal(np.array(k_copy(**kw)[0])[[0, 1, 4, 5]], [3, 1, 5, 3])


REDUCE_SOURCE = """
    threadgroup float partial[256];
    uint tid = thread_position_in_threadgroup.x;
    uint n = threads_per_threadgroup.x;
    uint row = threadgroup_position_in_grid.y;
    float acc = 0.0;
    for (uint i = tid; i < inp_shape[1]; i += n)
        acc += float(inp[row * inp_shape[1] + i]);
    partial[tid] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = n / 2; s > 0; s >>= 1) {
        if (tid < s) partial[tid] += partial[tid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) out[row] = partial[0];
"""


def reduce_kernel(**kw):
    return metalsim.metal_kernel(name="row_sum", input_names=["inp"], output_names=["out"],
                                 source=REDUCE_SOURCE, **kw)


def test_threadgroup_reduction_with_barriers(rng):
    x = rng.standard_normal((5, 1000)).astype(np.float32)
    for order in ("forward", "reversed"):
        out = reduce_kernel(thread_order=order)(
            inputs=[mx.array(x)], grid=(256, 5, 1), threadgroup=(256, 1, 1),
            output_shapes=[(5,)], output_dtypes=[mx.float32])[0]
        np.testing.assert_allclose(np.array(out), x.sum(1), rtol=1e-4, atol=1e-4)


SIMD_SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint gid = thread_position_in_grid.x;
    float x = inp[gid];
    sums[gid] = simd_sum(x);
    maxs[gid] = simd_max(x);
    xors[gid] = simd_shuffle_xor(x, 1);
    pref[gid] = simd_prefix_exclusive_sum(x);
    bcast[gid] = simd_broadcast(x, 3);
    int ix = int(x * 4.0f);
    ints[gid] = simd_sum(ix) * 1000 + simd_shuffle_down(ix, 2) + 100 * (simd_all(ix > -1000) ? 1 : 0)
                + 200 * (simd_any(ix > 1000) ? 1 : 0);
    float4 v = float4(x, 2.0 * x, x + 1.0, lane);
    float4 sv = simd_sum(v);
    vsum[gid] = sv.y + sv.w;
    first[gid] = simd_broadcast_first(x) + (simd_is_first() ? 1000.0 : 0.0);
"""


def test_simd_functions_partial_simdgroups(rng):
    tgsize, ntg = 40, 3  # simdgroups of 32 and 8 lanes
    n = tgsize * ntg
    x = rng.integers(-8, 8, n).astype(np.float32) / 4
    kernel = metalsim.metal_kernel(
        name="simd_ops", input_names=["inp"],
        output_names=["sums", "maxs", "xors", "pref", "bcast", "ints", "vsum", "first"],
        source=SIMD_SOURCE)
    outs = kernel(inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(tgsize, 1, 1),
                  output_shapes=[(n,)] * 8,
                  output_dtypes=[mx.float32] * 5 + [mx.int32] + [mx.float32] * 2)
    sums, maxs, xors, pref, bcast, ints, vsum, first = [np.array(o) for o in outs]
    for t in range(ntg):
        for g0, cnt in ((0, 32), (32, 8)):
            s = slice(t * tgsize + g0, t * tgsize + g0 + cnt)
            xs = x[s]
            lanes = np.arange(cnt)
            np.testing.assert_allclose(sums[s], xs.sum())
            np.testing.assert_allclose(maxs[s], xs.max())
            np.testing.assert_allclose(xors[s], xs[lanes ^ 1])
            np.testing.assert_allclose(pref[s], np.concatenate([[0], np.cumsum(xs)[:-1]]))
            np.testing.assert_allclose(bcast[s], xs[3])
            ix = (xs * 4).astype(np.int32)
            down = np.where(lanes + 2 < 32, ix[np.minimum(lanes + 2, cnt - 1)], ix)
            down = np.where((lanes + 2 < 32) & (lanes + 2 >= cnt), 0, down)  # inactive source: 0
            np.testing.assert_array_equal(ints[s], ix.sum() * 1000 + down + 100)
            np.testing.assert_allclose(vsum[s], 2 * xs.sum() + lanes.sum())
            np.testing.assert_allclose(first[s], xs[0] + np.where(lanes == 0, 1000, 0))


SGM_LAYOUT_SOURCE = """
    uint lane = thread_index_in_simdgroup;
    // 1. which element of an 8x8 matrix each lane holds
    simdgroup_float8x8 m;
    m.thread_elements()[0] = float(lane * 2);
    m.thread_elements()[1] = float(lane * 2 + 1);
    simdgroup_store(m, layout, 8);
    // 2. load (plain, transposed, with origin) and read back per lane
    simdgroup_float8x8 p, t, o;
    simdgroup_load(p, mat, 16);
    simdgroup_load(t, mat, 16, ulong2(0, 0), true);
    simdgroup_load(o, mat, 16, ulong2(8, 4));
    lanes[lane * 2] = p.thread_elements()[0];
    lanes[lane * 2 + 1] = p.thread_elements()[1];
    simdgroup_store(t, tr, 8);
    simdgroup_store(o, orig, 8);
    simdgroup_store(p, st_tr, 8, ulong2(0, 0), true);
    // 3. diagonal constructor and multiply
    simdgroup_float8x8 eye = simdgroup_float8x8(2.0f);
    simdgroup_float8x8 prod;
    simdgroup_multiply(prod, p, eye);
    simdgroup_store(prod, mul, 8);
"""


def test_simdgroup_matrix_lane_layout():
    mat = np.arange(16 * 16, dtype=np.float32).reshape(16, 16)
    kernel = metalsim.metal_kernel(name="sgm_layout", input_names=["mat"],
                                   output_names=["layout", "lanes", "tr", "orig", "st_tr", "mul"],
                                   source=SGM_LAYOUT_SOURCE)
    outs = kernel(inputs=[mx.array(mat)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                  output_shapes=[(8, 8), (64,), (8, 8), (8, 8), (8, 8), (8, 8)],
                  output_dtypes=[mx.float32] * 6)
    layout, lanes, tr, orig, st_tr, mul = [np.array(o) for o in outs]
    expect = np.zeros((8, 8), np.float32)
    for lane in range(32):
        y = (lane // 16) * 4 + (lane // 2) % 4
        x = ((lane // 4) & 2) * 2 + (lane % 2) * 2
        expect[y, x], expect[y, x + 1] = 2 * lane, 2 * lane + 1
        assert lanes[2 * lane] == mat[y, x] and lanes[2 * lane + 1] == mat[y, x + 1]
    np.testing.assert_array_equal(layout, expect)
    np.testing.assert_array_equal(tr, mat[:8, :8].T)
    np.testing.assert_array_equal(orig, mat[4:12, 8:16])
    np.testing.assert_array_equal(st_tr, mat[:8, :8].T)
    np.testing.assert_array_equal(mul, 2 * mat[:8, :8])


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-4), (mx.float16, 2e-2), (mx.bfloat16, 1e-1)])
def test_tiled_matmul_simdgroup_matrix(rng, dtype, tol):
    M, K, N = 128, 96, 64
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    am, bm = mx.array(a).astype(dtype), mx.array(b).astype(dtype)
    c = run_matmul(matmul_kernel(metalsim), am, bm, dtype)
    assert c.dtype == dtype
    ref = np_of(am).astype(np.float64) @ np_of(bm).astype(np.float64)
    err = np.abs(np_of(c) - ref).max() / np.abs(ref).max()
    assert err < tol, err
    if dtype == mx.float32:
        np.testing.assert_allclose(np_of(c), ref, rtol=1e-4, atol=1e-4)


def test_half_and_bfloat_rounding():
    source = """
        uint i = thread_position_in_grid.x;
        bfloat b = bfloat(x[i]);
        half h = half(x[i]);
        ob[i] = b * bfloat(3.0) + bfloat(1.0);
        oh[i] = h * 3.0h + 1.0h;
        bits[i] = as_type<ushort>(b);
        half4 hv = half4(h, 1.0h, float2(2.0, 3.0));
        float4 fv = float4(hv) + float4(1);
        vec[i] = fv.x + fv.y * 10 + fv.z * 100 + fv.w * 1000 + dot(fv.xy, fv.zw);
    """
    kernel = metalsim.metal_kernel(name="rounding", input_names=["x"],
                                   output_names=["ob", "oh", "bits", "vec"], source=source)
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.14159, 1e-3, 65504.0, 1e30], np.float32)
    ob, oh, bits, vec = kernel(inputs=[mx.array(x)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                               output_shapes=[(8,)] * 4,
                               output_dtypes=[mx.bfloat16, mx.float16, mx.uint16, mx.float32])
    xb = mx.array(x).astype(mx.bfloat16)
    # each op rounded to bfloat16, like Metal
    exp_b = ((xb * mx.array(3.0, mx.bfloat16)).astype(mx.bfloat16) + mx.array(1.0, mx.bfloat16))
    np.testing.assert_array_equal(np_of(ob), np_of(exp_b))
    np.testing.assert_array_equal(np.array(bits), np.array(xb.view(mx.uint16)))
    with np.errstate(over="ignore"):
        xh = x.astype(np.float16)
        np.testing.assert_array_equal(np.array(oh), (xh * np.float16(3)) + np.float16(1))
    h = xh.astype(np.float32) + 1
    np.testing.assert_allclose(np.array(vec)[:6], (h + 20 + 300 + 4000 + h * 3 + 2 * 4)[:6], rtol=1e-6)


ATOMIC_SOURCE = """
    uint i = thread_position_in_grid.y;   // token
    uint d = thread_position_in_grid.x;   // feature
    int row = idx[i];
    atomic_fetch_add_explicit(&grad[row * D + d], gout[i * D + d], memory_order_relaxed);
    if (d == 0) atomic_fetch_add_explicit(count + row, 1, memory_order_relaxed);
"""


def test_atomic_scatter_add_embedding_backward(rng):
    V, D, Ntok = 10, 16, 300
    idx = rng.integers(0, V, Ntok).astype(np.int32)
    gout = rng.standard_normal((Ntok, D)).astype(np.float32)
    kernel = metalsim.metal_kernel(name="embed_bwd", input_names=["idx", "gout"],
                                   output_names=["grad", "count"], source=ATOMIC_SOURCE,
                                   atomic_outputs=True)
    grad, count = kernel(inputs=[mx.array(idx), mx.array(gout)], template=[("D", D)],
                         grid=(D, Ntok, 1), threadgroup=(D, 4, 1),
                         output_shapes=[(V, D), (V,)], output_dtypes=[mx.float32, mx.int32],
                         init_value=0)
    ref = np.zeros((V, D), np.float64)
    np.add.at(ref, idx, gout)
    np.testing.assert_allclose(np.array(grad), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.array(count), np.bincount(idx, minlength=V))


TEMPLATE_SOURCE = """
    uint i = thread_position_in_grid.x;
    T v = T(inp[i]);
    out[i] = FLAG ? v * T(N) : v + T(N);
"""


def test_template_parameters():
    kernel = metalsim.metal_kernel(name="tmpl", input_names=["inp"], output_names=["out"],
                                   source=TEMPLATE_SOURCE)
    x = mx.arange(8, dtype=mx.float32)
    for dt, n, flag, exp in [(mx.float32, 3, True, np.arange(8) * 3),
                             (mx.float16, 5, False, np.arange(8) + 5),
                             (mx.int32, 2, True, np.arange(8) * 2)]:
        out = kernel(inputs=[x], template=[("T", dt), ("N", n), ("FLAG", flag)],
                     grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                     output_dtypes=[dt])[0]
        assert out.dtype == dt
        np.testing.assert_array_equal(np.array(out), exp)


def test_init_value_and_poisoning():
    source = """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) { f[i] = 1.0; n[i] = 1; b[i] = 1.0; }
    """
    kernel = metalsim.metal_kernel(name="half_write", input_names=["dummy"],
                                   output_names=["f", "n", "b"], source=source)
    kw = dict(inputs=[mx.zeros((1,))], grid=(8, 1, 1), threadgroup=(8, 1, 1),
              output_shapes=[(8,)] * 3, output_dtypes=[mx.float32, mx.int32, mx.bfloat16])
    f, n, b = [np_of(o) for o in kernel(**kw)]
    assert np.all(f[::2] == 1) and np.all(np.isnan(f[1::2]))
    assert np.all(n[::2] == 1) and np.all(n[1::2].view(np.uint32) == 0xDEADBEEF)
    assert np.all(b[::2] == 1) and np.all(np.isnan(b[1::2]))
    f, n, b = [np_of(o) for o in kernel(init_value=7, **kw)]
    np.testing.assert_array_equal(f, [1, 7] * 4)
    np.testing.assert_array_equal(n, [1, 7] * 4)
    np.testing.assert_array_equal(b, [1, 7] * 4)


ATTR_SOURCE = """
    uint i = thread_position_in_grid.y * threads_per_grid.x + thread_position_in_grid.x;
    out[i * 8 + 0] = thread_position_in_grid.x;
    out[i * 8 + 1] = threads_per_threadgroup.x;
    out[i * 8 + 2] = threadgroup_position_in_grid.x;
    out[i * 8 + 3] = thread_index_in_threadgroup;
    out[i * 8 + 4] = simdgroup_index_in_threadgroup;
    out[i * 8 + 5] = threadgroups_per_grid.x;
    out[i * 8 + 6] = dispatch_threads_per_threadgroup.x;
    out[i * 8 + 7] = thread_position_in_threadgroup.y;
"""


def test_grid_and_threadgroup_semantics():
    """dispatchThreads: partial edge threadgroups; MLX clamps the threadgroup
    to the grid (a grid smaller than the threadgroup runs grid threads)."""
    kernel = metalsim.metal_kernel(name="attrs", input_names=["dummy"], output_names=["out"],
                                   source=ATTR_SOURCE)
    # 70 = 2 full threadgroups of 32 + a partial one of 6
    out = np.array(kernel(inputs=[mx.zeros((1,))], grid=(70, 1, 1), threadgroup=(32, 1, 1),
                          output_shapes=[(70 * 8,)], output_dtypes=[mx.uint32])[0]).reshape(70, 8)
    np.testing.assert_array_equal(out[:, 0], np.arange(70))
    np.testing.assert_array_equal(out[:, 1], [32] * 64 + [6] * 6)
    np.testing.assert_array_equal(out[:, 2], np.arange(70) // 32)
    np.testing.assert_array_equal(out[:, 3], np.arange(70) % 32)
    np.testing.assert_array_equal(out[:, 5], 3)
    np.testing.assert_array_equal(out[:, 6], 32)
    # grid (24, 2) with threadgroup (256, 1): MLX dispatches (24, 1) threadgroups
    out = np.array(kernel(inputs=[mx.zeros((1,))], grid=(24, 2, 1), threadgroup=(256, 1, 1),
                          output_shapes=[(48 * 8,)], output_dtypes=[mx.uint32],
                          init_value=999)[0]).reshape(48, 8)
    assert not np.any(out == 999)  # every thread of the grid ran exactly once
    np.testing.assert_array_equal(out[:, 0], np.tile(np.arange(24), 2))
    np.testing.assert_array_equal(out[:, 1], 24)
    np.testing.assert_array_equal(out[:, 6], 24)
    np.testing.assert_array_equal(out[:, 5], 1)


def test_divergent_simd_collective():
    """Lanes that take a branch run the collective among themselves."""
    source = """
        uint lane = thread_index_in_simdgroup;
        float r = -1.0;
        if (lane < 10) r = simd_sum(1.0f);
        else r = simd_max(float(lane));
        threadgroup_barrier(mem_flags::mem_none);
        out[lane] = r;
    """
    kernel = metalsim.metal_kernel(name="divergent", input_names=["dummy"], output_names=["out"],
                                   source=source)
    out = np.array(kernel(inputs=[mx.zeros((1,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                          output_shapes=[(32,)], output_dtypes=[mx.float32])[0])
    np.testing.assert_array_equal(out, [10] * 10 + [31] * 22)


KITCHEN_SINK_SOURCE = r"""
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = inp[i];
    half hx = half(x);
    bfloat bx = bfloat(x);
    float4 v = float4(x, x + 1, x * 2, -x);
    half4 hv = half4(v);
    int k = int(i) - 16;
    float r = 0;
    r += metal::exp(x) + exp2(x) + metal::log(abs(x) + 1) + log2(abs(x) + 1) + pow(abs(x), 1.5f);
    r += sqrt(abs(x)) + rsqrt(abs(x) + 1) + tanh(x) + clamp(x, -1.0f, 1.0f) + select(0.0f, 1.0f, x > 0);
    r += (isnan(x) ? 1 : 0) + (isinf(x) ? 1 : 0) + floor(x) + ceil(x) + round(x) + trunc(x) + fract(x);
    r += precise::divide(x, 3.0f) + fast::exp(x) + fast::divide(x, 2.0f) + dot(v, v) + fma(x, x, x) + mix(x, 2.0f, 0.5f);
    r += float(max(hx, 0.5h)) + float(min(bx, bfloat(0.25))) + max(x, 0) + min(v, 1.0f).y + max(v, v).w;
    r += float(abs(k)) + float(popcount(uint(i))) + float(clz(uint(i) + 1)) + float(ctz(uint(i) + 1));
    r += all(v > -100.0f) ? 1 : 0; r += any(v > 100.0f) ? 1 : 0;
    r += float(metal::numeric_limits<half>::max()) * 0 + float(numeric_limits<int>::max() > 0);
    r += (numeric_limits<float>::infinity() > 1e30f) ? 1 : 0;
    r += float(hv.x * hv.y) + float(dot(hv, hv)) * 0 + length(v.xy) * 0 + normalize(v).x * 0;
    r += sign(x) + copysign(1.0f, x) + step(0.0f, x) + smoothstep(0.0f, 1.0f, x) + saturate(x) + fmod(x, 0.7f);
    r += sin(x) + cos(x) + atan2(x, 1.0f) + float(sinh(hx)) + cospi(x);
    r += as_type<float>(as_type<uint>(x)) + float(as_type<ushort>(hx) > 0);
    float2 p2 = float2(x) * 2.0f + 1;
    r += p2.x + p2.y;
    uint2 u2 = uint2(i, i + 1) / 2u;
    r += float(u2.x + u2.y);
    int3 i3 = int3(k) * 2 - 1;
    r += float(i3.z);
    r += float(half(x) * 2.0h + half(1));
    float4 w = float4(hv.xy, v.zw);
    r += w.x + w.w;
    bool4 b4 = v > 0.0f;
    r += b4[0] ? 1 : 0;
    // SIMD extras
    r += simd_product(x > 0 ? 1.0f : 1.0f) + simd_min(x) + float(simd_and(uint(i)) + simd_or(uint(i)) + simd_xor(uint(i)));
    r += simd_prefix_inclusive_sum(x) + simd_shuffle_up(x, 1) + simd_shuffle_rotate_down(x, 3) + simd_shuffle(x, 5);
    r += float(simd_ballot(x > 0).all()) + float(uint64_t(simd_ballot(x > 0)) & 1) + quad_sum(x) + quad_shuffle_xor(x, 1) + quad_broadcast(x, 2);
    r += float(quad_all(true)) + float(simd_any(lane == 3));
    // threadgroup atomics
    threadgroup atomic<uint> counter;
    threadgroup atomic<float> fsum;
    if (lane == 0 && simdgroup_index_in_threadgroup == 0) { atomic_store_explicit(&counter, 0u, memory_order_relaxed); atomic_store_explicit(&fsum, 0.0f, memory_order_relaxed); }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&counter, 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(&fsum, 0.5f, memory_order_relaxed);
    atomic_fetch_max_explicit(&counter, 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    r += float(atomic_load_explicit(&counter, memory_order_relaxed)) + atomic_load_explicit(&fsum, memory_order_relaxed);
    uint expected = 1000u;
    atomic_compare_exchange_weak_explicit(&counter, &expected, 5u, memory_order_relaxed, memory_order_relaxed);
    r += float(expected) * 0;
    simdgroup_half8x8 hm = make_filled_simdgroup_matrix<half, 8, 8>(1.0h);
    simdgroup_bfloat8x8 bm = simdgroup_bfloat8x8(bfloat(2));
    simdgroup_float8x8 fm;
    simdgroup_multiply(fm, hm, bm);
    r += fm.thread_elements()[0];
    out[i] = r;
"""


def test_msl_library_compiles_in_both_modes():
    """Instantiates most of the supported MSL library (templates are only
    checked by the compiler when used)."""
    k = metalsim.metal_kernel(name="kitchen_sink", input_names=["inp"], output_names=["out"],
                              source=KITCHEN_SINK_SOURCE)
    x = mx.array(np.linspace(-2, 2, 64).astype(np.float32))
    kw = dict(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
              output_dtypes=[mx.float32])
    a = np.array(k(**kw)[0])
    k.check = "bounds"
    b = np.array(k(**kw)[0])
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


MATH_SOURCE = """
    uint i = thread_position_in_grid.x;
    uint n = threads_per_grid.x;
    float x = inp[i];
    float ax = abs(x) + 0.5f;
    float r[16] = {metal::exp(x), exp2(x), log(ax), log2(ax), pow(ax, 1.5f), sqrt(ax),
                   rsqrt(ax), tanh(x), clamp(x, -1.0f, 0.5f), floor(x), ceil(x), round(x),
                   precise::divide(x, 3.0f), fma(x, 2.0f, 1.0f), max(x, 0.25f), min(x, 0.25f)};
    for (int k = 0; k < 16; ++k) out[k * n + i] = r[k];
    half h = half(x);
    hout[i] = metal::exp(h);
"""


def test_math_functions_against_numpy():
    x = np.linspace(-3, 3, 50).astype(np.float32)
    k = metalsim.metal_kernel(name="mathfns", input_names=["inp"], output_names=["out", "hout"],
                              source=MATH_SOURCE)
    out, hout = k(inputs=[mx.array(x)], grid=(50, 1, 1), threadgroup=(32, 1, 1),
                  output_shapes=[(16, 50), (50,)], output_dtypes=[mx.float32, mx.float16])
    ax = np.abs(x) + 0.5
    ref = [np.exp(x), np.exp2(x), np.log(ax), np.log2(ax), ax ** 1.5, np.sqrt(ax), 1 / np.sqrt(ax),
           np.tanh(x), np.clip(x, -1, 0.5), np.floor(x), np.ceil(x),
           np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5)), x / 3, x * 2 + 1,
           np.maximum(x, 0.25), np.minimum(x, 0.25)]
    np.testing.assert_allclose(np.array(out), np.array(ref, np.float32), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.array(hout),
                                  np.exp(x.astype(np.float16).astype(np.float32)).astype(np.float16))
