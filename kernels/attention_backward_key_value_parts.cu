// dK and dV from the dK/dV kernels' head-split parts (HEAD_SPLIT in attention_backward_key_value
// and its wgmma version): SPLITS fp32 parts [SPLITS, B, Nk, Hkv, D] of each, added in split order
// (so the sum is bitwise the same run to run) and rounded into the token-major [B, Nk, Hkv, D]
// buffers. An element-wise pass over what the split CTAs wrote: each thread takes CHUNK
// consecutive elements (a float4 where D allows) of both outputs.
namespace mlxflash {
namespace kvparts {
typedef {{input_type}} T;
constexpr int HEAD_DIM = {{head_dim}};
constexpr int THREADS = {{threads}};
constexpr int CHUNK = {{chunk}};  // elements a thread adds, rounds and stores (cuda_source.key_value_parts_chunk)
static_assert(CHUNK == 1 || (CHUNK == 4 && HEAD_DIM % 4 == 0), "a float4 per thread where D allows, else one element");
}  // namespace kvparts

__device__ void attention_backward_key_value_parts(const float* __restrict__ dk_parts,
                                                   const float* __restrict__ dv_parts, const i64* __restrict__ ip,
                                                   kvparts::T* __restrict__ dk, kvparts::T* __restrict__ dv) {
  using namespace kvparts;
  const i64 n = ip[P_BATCH] * ip[P_KVLEN] * ip[P_KVHEADS] * HEAD_DIM;  // elements of one part
  const i64 e = (linear_block() * THREADS + threadIdx.x) * CHUNK;
  if (e >= n) return;
  const int splits = (int)ip[P_SPLITS];
  float k[CHUNK], v[CHUNK];
  auto load = [&](const float* p, float (&x)[CHUNK]) {
    if constexpr (CHUNK == 4) {
      const float4 f = *reinterpret_cast<const float4*>(p);
      x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else {
      x[0] = *p;
    }
  };
  load(dk_parts + e, k);
  load(dv_parts + e, v);
  for (int s = 1; s < splits; ++s) {
    float ks[CHUNK], vs[CHUNK];
    load(dk_parts + s * n + e, ks);
    load(dv_parts + s * n + e, vs);
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) k[j] += ks[j], v[j] += vs[j];
  }
  if constexpr (CHUNK == 4) {
    store2(dk + e, k[0], k[1]);
    store2(dk + e + 2, k[2], k[3]);
    store2(dv + e, v[0], v[1]);
    store2(dv + e + 2, v[2], v[3]);
  } else {
    store1(dk + e, k[0]);
    store1(dv + e, v[0]);
  }
}

}  // namespace mlxflash
