  // Attention backward, dK and dV: one threadgroup per (key block of P rows, kv head, batch).
  // Loops over the group's query heads (GQA: the sum over them stays inside the threadgroup,
  // in a fixed order) and, for each, streams query blocks of T queries:
  //   S^T = K Q^T, P^T = exp2(s - L), dV += P^T dO, dP^T = V dO^T,
  //   dS^T = P^T * (dP^T - delta) [* softcap'(s)], dK += dS^T Q;   finally dK *= scale.
  // No atomics: every dK/dV element is owned by one threadgroup.
  //
  // Inputs: q, d_out [B,Hq,Nq,D], k, v [B,Hkv,Nk,D], each read through its strides, lse, delta
  //   fp32 [B,Hq,Nq] (delta from the dQ kernel), mask, mask_layout, params, fparams (as the
  //   forward kernel).
  // Outputs: dk, dv [B,Nk,Hkv,D] (token-major, returned as [B,Hkv,Nk,D] views), dk_acc, dv_acc
  //   (fp32 spill buffers, rows in dk's order, when not cached and the input is not fp32;
  //   otherwise 1 element, unused).
  //
  // Compile-time constants (rendered by mlx_flash.backends.metal_source):
  constexpr int D = {{head_dim}};
  constexpr int DR8 = (D + 7) / 8 * 8;
  constexpr int P = {{parallel_block}};
  constexpr int T = {{traversal_block}};
  constexpr int H = {{head_block}};
  constexpr int LD = H + {{tile_pad}};
  constexpr int NTHREADS = P / 8 * 32;
  constexpr bool K_CACHED = {{k_cached}};
  constexpr bool V_CACHED = {{v_cached}};
  constexpr bool DK_CACHED = {{dk_cached}};
  constexpr bool DV_CACHED = {{dv_cached}};
  constexpr bool CAUSAL = {{causal}};
  constexpr bool WINDOW = {{window}};
  constexpr bool SOFTCAP = {{softcap}};
  constexpr int MASK_KIND = {{mask_kind}};
  typedef {{input_type}} in_t;
  typedef {{cache_type}} cache_t;

  threadgroup in_t tile[T * LD];

  const int Nq = params[0];
  const int Nk = params[1];
  const int Hq = params[2];
  const int group = params[3];
  const int Hkv = params[6];
  ScoreContext ctx;
  ctx.scale = fparams[0];
  ctx.cap = fparams[1];
  ctx.inv_cap = fparams[2];
  ctx.diagonal = Nk - Nq + params[7];  // params[7]: AttentionSpec.diagonal_shift
  ctx.left = params[4];
  ctx.right = params[5];

  const int b = int(threadgroup_position_in_grid.z);
  const int hk = int(threadgroup_position_in_grid.y);
  const int k0 = int(threadgroup_position_in_grid.x) * P;
  const ushort tid = ushort(thread_index_in_threadgroup);
  const ushort sg = ushort(simdgroup_index_in_threadgroup);
  const ushort2 lc = fragment_coord(ushort(thread_index_in_simdgroup));

  // This lane's key row.
  const int key = k0 + sg * 8 + lc.y;
  const bool key_ok = key < Nk;
  const int key_c = min(key, Nk - 1);
  const long kv_row = (long(b) * Nk + key_c) * Hkv + hk;  // dk, dv and their spill buffers
  auto k_row = k + (b * k_strides[0] + hk * k_strides[1] + key_c * k_strides[2]);
  auto v_row = v + (b * v_strides[0] + hk * v_strides[1] + key_c * v_strides[2]);
  const long k_step = k_strides[3];
  const long v_step = v_strides[3];
  const long q_ld = q_strides[2];  // Q, dO tiles: rows (queries) ld apart, columns step apart
  const long q_step = q_strides[3];
  const long do_ld = d_out_strides[2];
  const long do_step = d_out_strides[3];
  device float* dk_acc_row = {{dk_accumulator}} + kv_row * D;
  device float* dv_acc_row = {{dv_accumulator}} + kv_row * D;
  const long mask_step = mask_layout[2];  // the mask is walked along queries here

  vec<cache_t, 2> k_cache[K_CACHED ? DR8 / 8 : 1];
  vec<cache_t, 2> v_cache[V_CACHED ? DR8 / 8 : 1];
  frag_t dk_cache[DK_CACHED ? DR8 / 8 : 1];
  frag_t dv_cache[DV_CACHED ? DR8 / 8 : 1];
  if (K_CACHED) load_row_pairs<K_CACHED ? DR8 : 8>(k_cache, k_row, lc.x, D, key_ok, k_step);
  if (V_CACHED) load_row_pairs<V_CACHED ? DR8 : 8>(v_cache, v_row, lc.x, D, key_ok, v_step);
  if (DK_CACHED) zero_frags<DK_CACHED ? DR8 / 8 : 1>(dk_cache);
  if (DV_CACHED) zero_frags<DV_CACHED ? DR8 / 8 : 1>(dv_cache);

  // Whole query blocks outside the causal / window band are never visited.
  const int2 queries = query_range<CAUSAL, WINDOW>(k0, min(k0 + P, Nk) - 1, Nq, ctx);
  bool first = true;  // nothing accumulated yet: spilled dK / dV start at zero

  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    const long head = long(b) * Hq + h;
    auto q_head = q + (b * q_strides[0] + h * q_strides[1]);
    auto do_head = d_out + (b * d_out_strides[0] + h * d_out_strides[1]);
    auto lse_head = lse + head * Nq;
    auto delta_head = delta + head * Nq;
    auto mask_line = mask + (mask_layout[0] * b + mask_layout[1] * h + mask_layout[3] * key_c);

    for (int r0 = queries.x; r0 < queries.y; r0 += T) {
      const int t_limit = min(T, queries.y - r0);

      // S^T = K Q^T (Q staged in threadgroup memory).
      frag_t s[T / 8];
      zero_frags<T / 8>(s);
      {{kq_unroll}}
      for (int d0 = 0; d0 < DR8; d0 += H) {
        stage_tile<T, H, LD, NTHREADS, in_t>(tile, q_head, q_ld, q_step, r0, queries.y, d0, D, tid);
        vec<cache_t, 2> k_stream[K_CACHED ? 1 : H / 8];
        if (!K_CACHED) load_row_pairs<H>(k_stream, k_row, d0 + lc.x, D, key_ok, k_step);
        gemm_abt<T, H, LD>(s, K_CACHED ? k_cache + d0 / 8 : k_stream, tile, DR8 - d0, t_limit, lc);
      }

      // P^T = exp2(s - L) per query column (0 where masked); keep softcap'(s) for dS.
      float2 softcap_grad[SOFTCAP ? T / 8 : 1];
#pragma clang loop unroll(full)
      for (int t = 0; t < T; t += 8) {
        float2 values = s[t / 8];
        float2 grads = float2(1.0f);
#pragma clang loop unroll(full)
        for (int e = 0; e < 2; ++e) {
          const int query = r0 + t + lc.x + e;
          const bool in_bounds = key_ok && query < queries.y;
          float grad;
          const float score = final_score<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(
              values[e], query, key, in_bounds, mask_line, query, mask_step, ctx, grad);
          float lse2 = in_bounds ? lse_head[query] * ATTN_LOG2E : INFINITY;
          if (lse2 == -INFINITY) lse2 = INFINITY;  // a query that sees no key: P = 0
          values[e] = exp2(score - lse2);
          grads[e] = grad;
        }
        s[t / 8] = values;
        if (SOFTCAP) softcap_grad[SOFTCAP ? t / 8 : 0] = grads;
      }

      // dV += P^T dO and dP^T = V dO^T share each staged dO tile.
      frag_t dp[T / 8];
      zero_frags<T / 8>(dp);
      {{dov_unroll}}
      for (int d0 = 0; d0 < DR8; d0 += H) {
        stage_tile<T, H, LD, NTHREADS, in_t>(tile, do_head, do_ld, do_step, r0, queries.y, d0, D, tid);
        frag_t dv_stream[DV_CACHED ? 1 : H / 8];
        thread frag_t* dv_block = DV_CACHED ? dv_cache + d0 / 8 : dv_stream;
        if (!DV_CACHED) {
          if (first) {
            zero_frags<DV_CACHED ? 1 : H / 8>(dv_stream);
          } else {
            load_row_frags<H>(dv_stream, dv_acc_row, d0 + lc.x, D, key_ok);
          }
        }
        gemm_ab<T, H, LD>(dv_block, s, tile, DR8 - d0, t_limit, lc);
        if (!DV_CACHED) store_row_frags<H, float>(dv_acc_row, dv_stream, 1.0f, d0 + lc.x, D, key_ok);

        vec<cache_t, 2> v_stream[V_CACHED ? 1 : H / 8];
        if (!V_CACHED) load_row_pairs<H>(v_stream, v_row, d0 + lc.x, D, key_ok, v_step);
        gemm_abt<T, H, LD>(dp, V_CACHED ? v_cache + d0 / 8 : v_stream, tile, DR8 - d0, t_limit, lc);
      }

      // dS^T = P^T * (dP^T - delta) [* softcap'(s)], written over dP^T.
#pragma clang loop unroll(full)
      for (int t = 0; t < T; t += 8) {
        float2 deltas;
#pragma clang loop unroll(full)
        for (int e = 0; e < 2; ++e) {
          const int query = r0 + t + lc.x + e;
          deltas[e] = query < queries.y ? delta_head[query] : 0.0f;
        }
        float2 ds = s[t / 8] * (dp[t / 8] - deltas);
        if (SOFTCAP) ds *= softcap_grad[SOFTCAP ? t / 8 : 0];
        dp[t / 8] = ds;
      }

      // dK += dS^T Q, one D-block at a time.
      {{dsq_unroll}}
      for (int d0 = 0; d0 < DR8; d0 += H) {
        stage_tile<T, H, LD, NTHREADS, in_t>(tile, q_head, q_ld, q_step, r0, queries.y, d0, D, tid);
        frag_t dk_stream[DK_CACHED ? 1 : H / 8];
        thread frag_t* dk_block = DK_CACHED ? dk_cache + d0 / 8 : dk_stream;
        if (!DK_CACHED) {
          if (first) {
            zero_frags<DK_CACHED ? 1 : H / 8>(dk_stream);
          } else {
            load_row_frags<H>(dk_stream, dk_acc_row, d0 + lc.x, D, key_ok);
          }
        }
        gemm_ab<T, H, LD>(dk_block, dp, tile, DR8 - d0, t_limit, lc);
        if (!DK_CACHED) store_row_frags<H, float>(dk_acc_row, dk_stream, 1.0f, d0 + lc.x, D, key_ok);
      }
      first = false;
    }
  }

  // dK = scale * sum dS^T Q; dV = sum P^T dO; in the input dtype.
  auto dk_row = dk + kv_row * D;
  auto dv_row = dv + kv_row * D;
  if (DK_CACHED) {
    store_row_frags<DK_CACHED ? DR8 : 8, in_t>(dk_row, dk_cache, ctx.scale, lc.x, D, key_ok);
  }
  if (DV_CACHED) {
    store_row_frags<DV_CACHED ? DR8 : 8, in_t>(dv_row, dv_cache, 1.0f, lc.x, D, key_ok);
  }
  if (!DK_CACHED || !DV_CACHED) {
    for (int d0 = 0; d0 < DR8; d0 += H) {
      frag_t stream[H / 8];
      if (!DK_CACHED) {
        if (first) {
          zero_frags<H / 8>(stream);
        } else {
          load_row_frags<H>(stream, dk_acc_row, d0 + lc.x, D, key_ok);
        }
        store_row_frags<H, in_t>(dk_row, stream, ctx.scale, d0 + lc.x, D, key_ok);
      }
      if (!DV_CACHED) {
        if (first) {
          zero_frags<H / 8>(stream);
        } else {
          load_row_frags<H>(stream, dv_acc_row, d0 + lc.x, D, key_ok);
        }
        store_row_frags<H, in_t>(dv_row, stream, 1.0f, d0 + lc.x, D, key_ok);
      }
    }
  }
