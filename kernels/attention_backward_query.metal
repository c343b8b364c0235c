  // Attention backward, dQ: one threadgroup per (query block of P rows, query head, batch).
  // First computes delta_i = rowsum(dO_i * O_i) - d_lse_i (written out for the dK/dV kernel),
  // then streams key blocks of T keys:
  //   S = Q K^T, P = exp2(s - L) (recomputed from the saved lse), dP = dO V^T,
  //   dS = P * (dP - delta) [* softcap'(s)], dQ += dS K;   finally dQ *= scale.
  // Nothing is accumulated across threadgroups: no atomics, bitwise-reproducible gradients.
  //
  // With SINKS, each simdgroup (8 query rows) also writes its rows' part of the sink gradient,
  //   -sum_i exp2(sink - L_i) * delta_i, to d_sinks_part; the caller sums the parts (MLX ops).
  //
  // Inputs: q, o, d_out [B,Hq,Nq,D], k, v [B,Hkv,Nk,D], each read through its strides,
  //   lse, d_lse fp32 [B,Hq,Nq], mask, mask_layout, sinks, params, fparams (as the forward).
  // Outputs: dq [B,Nq,Hq,D] (token-major, returned as a [B,Hq,Nq,D] view), delta fp32
  //   [B,Hq,Nq], dq_acc (fp32 spill buffer of dQ, rows in dq's order, when dQ is not cached and
  //   the input is not fp32; otherwise 1 element, unused), d_sinks_part fp32
  //   [B, Hq, query blocks * P / 8] with SINKS (otherwise 1 element, unused).
  //
  // Compile-time constants (rendered by mlx_flash.backends.metal_source):
  constexpr int D = {{head_dim}};
  constexpr int DR8 = (D + 7) / 8 * 8;
  constexpr int P = {{parallel_block}};
  constexpr int T = {{traversal_block}};
  constexpr int H = {{head_block}};
  constexpr int LD = H + {{tile_pad}};
  constexpr int NTHREADS = P / 8 * 32;
  constexpr bool Q_CACHED = {{q_cached}};
  constexpr bool DO_CACHED = {{do_cached}};
  constexpr bool DQ_CACHED = {{dq_cached}};
  constexpr bool CAUSAL = {{causal}};
  constexpr bool WINDOW = {{window}};
  constexpr bool SOFTCAP = {{softcap}};
  constexpr int MASK_KIND = {{mask_kind}};
  constexpr bool SINKS = {{sinks}};
  typedef {{input_type}} in_t;
  typedef {{cache_type}} cache_t;

  threadgroup in_t tile[T * LD];

  const int Nq = params[0];
  const int Nk = params[1];
  const int Hq = params[2];
  const int group = params[3];
  ScoreContext ctx;
  ctx.scale = fparams[0];
  ctx.cap = fparams[1];
  ctx.inv_cap = fparams[2];
  ctx.diagonal = Nk - Nq + params[7];  // params[7]: AttentionSpec.diagonal_shift
  ctx.left = params[4];
  ctx.right = params[5];

  const int b = int(threadgroup_position_in_grid.z);
  const int h = int(threadgroup_position_in_grid.y);
  const int q0 = int(threadgroup_position_in_grid.x) * P;
  const ushort tid = ushort(thread_index_in_threadgroup);
  const ushort sg = ushort(simdgroup_index_in_threadgroup);
  const ushort2 lc = fragment_coord(ushort(thread_index_in_simdgroup));

  const int row = q0 + sg * 8 + lc.y;
  const bool row_ok = row < Nq;
  const int row_c = min(row, Nq - 1);
  const long head_row = (long(b) * Hq + h) * Nq + row_c;   // lse, d_lse, delta
  const long token_row = (long(b) * Nq + row_c) * Hq + h;  // dq and its spill buffer
  const int kv_h = h / group;
  auto q_row = q + (b * q_strides[0] + h * q_strides[1] + row_c * q_strides[2]);
  auto o_row = o + (b * o_strides[0] + h * o_strides[1] + row_c * o_strides[2]);
  auto do_row = d_out + (b * d_out_strides[0] + h * d_out_strides[1] + row_c * d_out_strides[2]);
  const long q_step = q_strides[3];
  const long o_step = o_strides[3];
  const long do_step = d_out_strides[3];
  auto k_head = k + (b * k_strides[0] + kv_h * k_strides[1]);
  auto v_head = v + (b * v_strides[0] + kv_h * v_strides[1]);
  const long k_ld = k_strides[2];  // K, V tiles: rows (keys) ld apart, columns step apart
  const long k_step = k_strides[3];
  const long v_ld = v_strides[2];
  const long v_step = v_strides[3];
  device float* acc_row = {{dq_accumulator}} + token_row * D;
  auto mask_row = mask + (mask_layout[0] * b + mask_layout[1] * h + mask_layout[2] * row_c);
  const long mask_step = mask_layout[3];

  // delta = rowsum(dO * O) - d_lse, fp32 (dO is loaded into its register cache on the way).
  vec<cache_t, 2> do_cache[DO_CACHED ? DR8 / 8 : 1];
  float dot_part = 0.0f;
  {{delta_unroll}}
  for (int d = 0; d < DR8; d += 8) {
    const float2 g = load_strided_pair(do_row, d + lc.x, D, row_ok, do_step);
    const float2 o_pair = load_strided_pair(o_row, d + lc.x, D, row_ok, o_step);
    if (DO_CACHED) do_cache[d / 8] = vec<cache_t, 2>(g);
    dot_part += g.x * o_pair.x + g.y * o_pair.y;
  }
  const float delta_row = row_sum(dot_part) - (row_ok ? d_lse[head_row] : 0.0f);
  if (row_ok && lc.x == 0) delta[head_row] = delta_row;
  // L in base 2; rows that saw no key have lse = -inf: use +inf so P = exp2(s - L) = 0.
  float lse2 = row_ok ? lse[head_row] * ATTN_LOG2E : INFINITY;
  if (lse2 == -INFINITY) lse2 = INFINITY;
  if (SINKS) {
    // d_sink: the sink's score gradient is p_sink * (0 - delta); one lane per row contributes
    // (lc.x == 0), the simdgroup sums its 8 rows, lane 0 writes the part (no atomics).
    const float p_sink = exp2(sinks[h] * ATTN_LOG2E - lse2);
    const float part = simd_sum(lc.x == 0 && row_ok ? -p_sink * delta_row : 0.0f);
    const int parts = (Nq + P - 1) / P * (P / 8);
    if (thread_index_in_simdgroup == 0) {
      d_sinks_part[(long(b) * Hq + h) * parts + q0 / 8 + sg] = part;
    }
  }

  vec<cache_t, 2> q_cache[Q_CACHED ? DR8 / 8 : 1];
  frag_t dq_cache[DQ_CACHED ? DR8 / 8 : 1];
  if (Q_CACHED) load_row_pairs<Q_CACHED ? DR8 : 8>(q_cache, q_row, lc.x, D, row_ok, q_step);
  if (DQ_CACHED) zero_frags<DQ_CACHED ? DR8 / 8 : 1>(dq_cache);

  const int2 keys = key_range<CAUSAL, WINDOW>(q0, min(q0 + P, Nq) - 1, Nk, ctx);
  bool first = true;

  for (int c0 = keys.x; c0 < keys.y; c0 += T) {
    const int t_limit = min(T, keys.y - c0);

    // S = Q K^T
    frag_t s[T / 8];
    zero_frags<T / 8>(s);
    {{qk_unroll}}
    for (int d0 = 0; d0 < DR8; d0 += H) {
      stage_tile<T, H, LD, NTHREADS, in_t>(tile, k_head, k_ld, k_step, c0, keys.y, d0, D, tid);
      vec<cache_t, 2> q_stream[Q_CACHED ? 1 : H / 8];
      if (!Q_CACHED) load_row_pairs<H>(q_stream, q_row, d0 + lc.x, D, row_ok, q_step);
      gemm_abt<T, H, LD>(s, Q_CACHED ? q_cache + d0 / 8 : q_stream, tile, DR8 - d0, t_limit, lc);
    }

    // P = exp2(s - L) (0 where masked); keep softcap'(s) for dS.
    float2 softcap_grad[SOFTCAP ? T / 8 : 1];
#pragma clang loop unroll(full)
    for (int t = 0; t < T; t += 8) {
      float2 values = s[t / 8];
      float2 grads = float2(1.0f);
#pragma clang loop unroll(full)
      for (int e = 0; e < 2; ++e) {
        const int key = c0 + t + lc.x + e;
        float grad;
        const float score = final_score<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(
            values[e], row, key, row_ok && key < keys.y, mask_row, key, mask_step, ctx, grad);
        values[e] = exp2(score - lse2);
        grads[e] = grad;
      }
      s[t / 8] = values;
      if (SOFTCAP) softcap_grad[SOFTCAP ? t / 8 : 0] = grads;
    }

    // dP = dO V^T
    frag_t dp[T / 8];
    zero_frags<T / 8>(dp);
    {{dov_unroll}}
    for (int d0 = 0; d0 < DR8; d0 += H) {
      stage_tile<T, H, LD, NTHREADS, in_t>(tile, v_head, v_ld, v_step, c0, keys.y, d0, D, tid);
      vec<cache_t, 2> do_stream[DO_CACHED ? 1 : H / 8];
      if (!DO_CACHED) load_row_pairs<H>(do_stream, do_row, d0 + lc.x, D, row_ok, do_step);
      gemm_abt<T, H, LD>(dp, DO_CACHED ? do_cache + d0 / 8 : do_stream, tile, DR8 - d0, t_limit, lc);
    }

    // dS = P * (dP - delta) [* softcap'(s)], written over dP.
#pragma clang loop unroll(full)
    for (int t = 0; t < T; t += 8) {
      float2 ds = s[t / 8] * (dp[t / 8] - delta_row);
      if (SOFTCAP) ds *= softcap_grad[SOFTCAP ? t / 8 : 0];
      dp[t / 8] = ds;
    }

    // dQ += dS K, one D-block at a time (an uncached dQ block round-trips its fp32 buffer).
    {{dsk_unroll}}
    for (int d0 = 0; d0 < DR8; d0 += H) {
      stage_tile<T, H, LD, NTHREADS, in_t>(tile, k_head, k_ld, k_step, c0, keys.y, d0, D, tid);
      frag_t dq_stream[DQ_CACHED ? 1 : H / 8];
      thread frag_t* dq_block = DQ_CACHED ? dq_cache + d0 / 8 : dq_stream;
      if (!DQ_CACHED) {
        if (first) {
          zero_frags<DQ_CACHED ? 1 : H / 8>(dq_stream);
        } else {
          load_row_frags<H>(dq_stream, acc_row, d0 + lc.x, D, row_ok);
        }
      }
      gemm_ab<T, H, LD>(dq_block, dp, tile, DR8 - d0, t_limit, lc);
      if (!DQ_CACHED) store_row_frags<H, float>(acc_row, dq_stream, 1.0f, d0 + lc.x, D, row_ok);
    }
    first = false;
  }

  // dQ = scale * sum_j dS_ij K_j, in the input dtype.
  auto dq_row = dq + token_row * D;
  if (DQ_CACHED) {
    store_row_frags<DQ_CACHED ? DR8 : 8, in_t>(dq_row, dq_cache, ctx.scale, lc.x, D, row_ok);
  } else {
    for (int d0 = 0; d0 < DR8; d0 += H) {
      frag_t dq_stream[H / 8];
      if (first) {
        zero_frags<H / 8>(dq_stream);
      } else {
        load_row_frags<H>(dq_stream, acc_row, d0 + lc.x, D, row_ok);
      }
      store_row_frags<H, in_t>(dq_row, dq_stream, ctx.scale, d0 + lc.x, D, row_ok);
    }
  }
