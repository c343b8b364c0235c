  // Attention forward: one threadgroup per (query block of P rows, query head, batch).
  // Streams key blocks of T keys through an online softmax (base 2) and writes O (input dtype)
  // and lse (fp32, natural log; -inf for rows that see no key).
  //
  // Inputs: q [B,Hq,Nq,D], k, v [B,Hkv,Nk,D], each read through its strides (q_strides, ...),
  //   mask (row-contiguous array mask, or a 1-element dummy),
  //   mask_layout int64 [b, h, query, key] (0 where the mask broadcasts),
  //   sinks fp32 [Hq] (attention sinks when SINKS, else a 1-element dummy),
  //   params int32 [Nq, Nk, Hq, group, window_left, window_right, Hkv, -],
  //   fparams fp32 [scale, softcap, 1 / softcap, ...].
  // Outputs: out [B,Nq,Hq,D] (token-major: the backend returns it as a [B,Hq,Nq,D] view),
  //   lse [B,Hq,Nq], o_acc (fp32 spill buffer of O, rows in out's order, when O is not cached
  //   and the input is not fp32; otherwise 1 element, unused).
  //
  // Compile-time constants (rendered by mlx_flash.backends.metal_source):
  constexpr int D = {{head_dim}};
  constexpr int DR8 = (D + 7) / 8 * 8;  // head dim padded to whole 8-wide fragments
  constexpr int P = {{parallel_block}};
  constexpr int T = {{traversal_block}};
  constexpr int H = {{head_block}};
  constexpr int LD = H + {{tile_pad}};  // padded tile row stride (bank conflicts)
  constexpr int NTHREADS = P / 8 * 32;
  constexpr bool Q_CACHED = {{q_cached}};
  constexpr bool O_CACHED = {{o_cached}};
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

  // This lane's query row (clamped in-bounds for addressing; row_ok gates its use).
  const int row = q0 + sg * 8 + lc.y;
  const bool row_ok = row < Nq;
  const int row_c = min(row, Nq - 1);
  const long head_row = (long(b) * Hq + h) * Nq + row_c;   // lse
  const long token_row = (long(b) * Nq + row_c) * Hq + h;  // out and its spill buffer
  const int kv_h = h / group;
  auto q_row = q + (b * q_strides[0] + h * q_strides[1] + row_c * q_strides[2]);
  const long q_step = q_strides[3];
  auto k_head = k + (b * k_strides[0] + kv_h * k_strides[1]);
  auto v_head = v + (b * v_strides[0] + kv_h * v_strides[1]);
  const long k_ld = k_strides[2];  // K, V tiles: rows (keys) ld apart, columns step apart
  const long k_step = k_strides[3];
  const long v_ld = v_strides[2];
  const long v_step = v_strides[3];
  device float* acc_row = {{o_accumulator}} + token_row * D;
  auto mask_row = mask + (mask_layout[0] * b + mask_layout[1] * h + mask_layout[2] * row_c);
  const long mask_step = mask_layout[3];

  // Cached operands live in registers for the whole kernel.
  vec<cache_t, 2> q_cache[Q_CACHED ? DR8 / 8 : 1];
  frag_t o_cache[O_CACHED ? DR8 / 8 : 1];
  if (Q_CACHED) load_row_pairs<Q_CACHED ? DR8 : 8>(q_cache, q_row, lc.x, D, row_ok, q_step);
  if (O_CACHED) zero_frags<O_CACHED ? DR8 / 8 : 1>(o_cache);

  // Whole key blocks outside the causal / window band are never visited.
  const int2 keys = key_range<CAUSAL, WINDOW>(q0, min(q0 + P, Nq) - 1, Nk, ctx);
  float m = -INFINITY;  // running row max (base 2)
  float l = 0.0f;       // running row sum of exp2(s - m)
  if (SINKS) {
    // The sink is the first score every row sees (a score with no value): m = sink, l = 1.
    m = sinks[h] * ATTN_LOG2E;
    l = m == -INFINITY ? 0.0f : 1.0f;
  }
  bool first = true;    // no key block visited yet: spilled O starts at zero

  for (int c0 = keys.x; c0 < keys.y; c0 += T) {
    const int t_limit = min(T, keys.y - c0);

    // S = Q K^T, one H-wide D-block at a time (K staged in threadgroup memory).
    frag_t s[T / 8];
    zero_frags<T / 8>(s);
    {{qk_unroll}}
    for (int d0 = 0; d0 < DR8; d0 += H) {
      stage_tile<T, H, LD, NTHREADS, in_t>(tile, k_head, k_ld, k_step, c0, keys.y, d0, D, tid);
      vec<cache_t, 2> q_stream[Q_CACHED ? 1 : H / 8];
      if (!Q_CACHED) load_row_pairs<H>(q_stream, q_row, d0 + lc.x, D, row_ok, q_step);
      gemm_abt<T, H, LD>(s, Q_CACHED ? q_cache + d0 / 8 : q_stream, tile, DR8 - d0, t_limit, lc);
    }

    // Online softmax: final scores, new row max, P = exp2(s - m_new), row sums.
    float block_max = -INFINITY;
#pragma clang loop unroll(full)
    for (int t = 0; t < T; t += 8) {
      float2 scores = s[t / 8];
#pragma clang loop unroll(full)
      for (int e = 0; e < 2; ++e) {
        const int key = c0 + t + lc.x + e;
        float unused_grad;
        scores[e] = final_score<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(
            scores[e], row, key, row_ok && key < keys.y, mask_row, key, mask_step, ctx, unused_grad);
        block_max = max(block_max, scores[e]);
      }
      s[t / 8] = scores;
    }
    const float m_new = max(m, row_max(block_max));
    // A row that has seen no visible key keeps max -inf: subtract 0 (exp2(-inf) = 0, no NaN).
    const float m_base = m_new == -INFINITY ? 0.0f : m_new;
    const float correction = exp2(m - m_base);
    float block_sum = 0.0f;
#pragma clang loop unroll(full)
    for (int t = 0; t < T; t += 8) {
      const float2 p = exp2(s[t / 8] - m_base);
      s[t / 8] = p;
      block_sum += p.x + p.y;
    }
    l = l * correction + row_sum(block_sum);
    m = m_new;

    // O = O * correction + P V, one D-block at a time. An uncached O block is reloaded from
    // and stored back to its fp32 spill buffer (each lane touches only its own elements).
    {{pv_unroll}}
    for (int d0 = 0; d0 < DR8; d0 += H) {
      stage_tile<T, H, LD, NTHREADS, in_t>(tile, v_head, v_ld, v_step, c0, keys.y, d0, D, tid);
      frag_t o_stream[O_CACHED ? 1 : H / 8];
      thread frag_t* o_block = O_CACHED ? o_cache + d0 / 8 : o_stream;
      if (!O_CACHED) {
        if (first) {
          zero_frags<O_CACHED ? 1 : H / 8>(o_stream);
        } else {
          load_row_frags<H>(o_stream, acc_row, d0 + lc.x, D, row_ok);
        }
      }
      scale_frags<H>(o_block, correction, DR8 - d0);
      gemm_ab<T, H, LD>(o_block, s, tile, DR8 - d0, t_limit, lc);
      if (!O_CACHED) store_row_frags<H, float>(acc_row, o_stream, 1.0f, d0 + lc.x, D, row_ok);
    }
    first = false;
  }

  // O /= l (rows that saw no key: O = 0, lse = -inf, or lse = sink with a sink).
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  auto out_row = out + token_row * D;
  if (O_CACHED) {
    store_row_frags<O_CACHED ? DR8 : 8, in_t>(out_row, o_cache, inv_l, lc.x, D, row_ok);
  } else {
    for (int d0 = 0; d0 < DR8; d0 += H) {
      frag_t o_stream[H / 8];
      if (first) {
        zero_frags<H / 8>(o_stream);
      } else {
        load_row_frags<H>(o_stream, acc_row, d0 + lc.x, D, row_ok);
      }
      store_row_frags<H, in_t>(out_row, o_stream, inv_l, d0 + lc.x, D, row_ok);
    }
  }
  if (row_ok && lc.x == 0) {
    lse[head_row] = l > 0.0f ? (m + log2(l)) * ATTN_LN2 : -INFINITY;
  }
