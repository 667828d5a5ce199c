// Paged causal attention for mixed batches (prefill chunks over a cached prefix and decode
// rows alike), GQA, bf16 K/V cache, f32 scores and online softmax, split over the context
// (flash-decoding) so that a batch of one still spreads over every SM.
//
// Grid: (n_kv_heads * group chunks, query rows, splits). One CTA serves one query row, up to
// G query heads that share one KV head (each K/V row is loaded once for all of them), and
// one contiguous chunk of the row's context. Inside the CTA a token's K (or V) row of HD
// bf16 is read by LPT = HD/8 lanes with one 16-byte load each, so a warp covers TPW = 32/LPT
// tokens per load and the CTA's NW warps form TS = NW*TPW independent token streams; each
// thread issues the loads of U tokens (K and V: 2*U 16-byte loads) before using any, so a
// CTA keeps 2*U*16*NW*32 bytes in flight; with PF the next tile's loads are issued before
// the current one is consumed (register double-buffering), so they overlap the arithmetic. Dot products finish with log2(LPT) shuffles; each
// stream keeps its own running (max, sum, acc) per head, and streams merge at the end
// (shuffles within a warp, shared memory across warps).
//
// With one split the CTA writes the normalized bf16 output. With several, it writes its
// unnormalized f32 partial (acc, max, sum) to a workspace and `attention_combine_hd*` merges
// the splits of each (row, head). Scores are kept in the log2 domain (q is pre-scaled by
// scale * log2(e)) so the exponentials are exp2f.
//
// row_ctx[r]: tokens row r attends to (its position + 1: causal over the cache, which
// already holds the row's own K/V); 0 marks a padding row (a CUDA-graph bucket's unused
// rows), whose output is zeros. row_bt[r]: offset of the row's block table in
// block_tables. Cache layout per layer: [slot][n_kv_heads][head_dim].
//
// Each row's context is cut into gridDim.z splits of split_chunk(ctx, splits, min_chunk)
// tokens, computed here from the row's own length rather than passed in, so that one launch
// configuration (grid z = splits) serves any context lengths: a captured CUDA graph replays
// with new lengths. Splits past a row's context do nothing.

// Tokens per split of a row of ctx tokens: an even share rounded up to 16, at least min_chunk.
__device__ __forceinline__ int split_chunk(int ctx, int n_splits, int min_chunk) {
    const int even = ((ctx + n_splits - 1) / n_splits + 15) & ~15;
    return max(min_chunk, even);
}

__device__ __forceinline__ void bf8_to_f(const uint4 u, float* d) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        d[2 * j] = __uint_as_float(w[j] << 16);
        d[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

// Merges running softmax state (m2, l2, a2) into (m, l, a); either may be empty (m = -inf).
__device__ __forceinline__ void merge_state(float& m, float& l, float* a, float m2, float l2, const float* a2) {
    const float mx = fmaxf(m, m2);
    if (mx == NEG_INF) return;
    const float c1 = exp2f(m - mx), c2 = exp2f(m2 - mx);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = a[j] * c1 + a2[j] * c2;
    m = mx;
}

template <int HD, int NW, int U, int G, bool PF>
__device__ __forceinline__ void paged_attention_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk) {
    constexpr int LPT = HD / 8;
    constexpr int TPW = 32 / LPT;
    constexpr int TS = NW * TPW;
    __shared__ float sm_m[NW][G];
    __shared__ float sm_l[NW][G];
    __shared__ float sm_acc[NW][G][HD];

    const int group = n_heads / n_kv_heads;
    const int gchunks = (group + G - 1) / G;
    const int kvh = blockIdx.x / gchunks, gc = blockIdx.x - kvh * gchunks;
    const int row = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int h0 = kvh * group + gc * G;
    const int ng = min(G, group - gc * G);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int dl = lane % LPT;
    const int ctx = row_ctx[row];
    if (ctx <= 0) {
        // A padding row: zeros, so that nothing downstream reads uninitialized memory.
        if (split == 0) {
            for (int i = threadIdx.x; i < ng * HD; i += NW * 32)
                out[((long long)row * n_heads + h0 + i / HD) * HD + i % HD] = f2bf(0.f);
        }
        return;
    }
    const int chunk = split_chunk(ctx, n_splits, min_chunk);
    const int c0 = split * chunk;
    const int c1 = min(ctx, c0 + chunk);
    // A split past this row's context (rows of one launch have different lengths): the
    // combine step never reads it.
    if (c0 >= c1) return;
    const int* bt = block_tables + row_bt[row];
    const long long kv_w = (long long)n_kv_heads * HD;
    const bf16_t* kb = k_cache + (long long)kvh * HD + dl * 8;
    const bf16_t* vb = v_cache + (long long)kvh * HD + dl * 8;

    float qv[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (g < ng) {
            bf8_to_f(*reinterpret_cast<const uint4*>(q + ((long long)row * n_heads + h0 + g) * HD + dl * 8), qv[g]);
#pragma unroll
            for (int j = 0; j < 8; j++) qv[g][j] *= qscale;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) qv[g][j] = 0.f;
        }
    }
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.f;
    }

    // Loads the K/V rows of the tile starting at wbase (each lane: U tokens, 16 bytes each).
    auto load_tile = [&](int wbase, uint4* kr, uint4* vr, bool* ok) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = wbase + lane / LPT + u * TS;
            ok[u] = p < c1;
            if (ok[u]) {
                const int lb = p / block_size;
                const long long slot = (long long)bt[lb] * block_size + (p - lb * block_size);
                kr[u] = *reinterpret_cast<const uint4*>(kb + slot * kv_w);
                vr[u] = *reinterpret_cast<const uint4*>(vb + slot * kv_w);
            } else {
                kr[u] = make_uint4(0, 0, 0, 0);
                vr[u] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // Online softmax over one loaded tile, for every head of the CTA.
    auto consume = [&](const uint4* kr, const uint4* vr, const bool* ok) {
        float kf[U][8];
#pragma unroll
        for (int u = 0; u < U; u++) bf8_to_f(kr[u], kf[u]);
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (g < ng) {
                float s[U];
                float mx = m[g];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    float d = 0.f;
#pragma unroll
                    for (int j = 0; j < 8; j++) d += qv[g][j] * kf[u][j];
#pragma unroll
                    for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                    s[u] = ok[u] ? d : NEG_INF;
                    mx = fmaxf(mx, s[u]);
                }
                // mx is -inf only when this lane has seen no valid token yet (then every
                // weight below is 0 and the state stays empty).
                const float c = mx == NEG_INF ? 1.f : exp2f(m[g] - mx);
                l[g] *= c;
#pragma unroll
                for (int j = 0; j < 8; j++) acc[g][j] *= c;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const float pr = ok[u] ? exp2f(s[u] - mx) : 0.f;
                    l[g] += pr;
                    float vf[8];
                    bf8_to_f(vr[u], vf);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[g][j] += pr * vf[j];
                }
                m[g] = mx;
            }
        }
    };

    // The loop bound is uniform across the warp (the shuffles need every lane), so lanes
    // whose token falls past the chunk carry it as invalid. With PF the next tile's loads are
    // issued before the current tile is consumed, so a warp always has loads in flight.
    const int w0 = c0 + warp * TPW;
    if (PF) {
        uint4 kr[U], vr[U];
        bool ok[U];
        if (w0 < c1) load_tile(w0, kr, vr, ok);
        for (int wbase = w0; wbase < c1; wbase += TS * U) {
            uint4 nk[U], nv[U];
            bool nok[U];
#pragma unroll
            for (int u = 0; u < U; u++) nok[u] = false;
            const int nb = wbase + TS * U;
            if (nb < c1) load_tile(nb, nk, nv, nok);
            consume(kr, vr, ok);
#pragma unroll
            for (int u = 0; u < U; u++) {
                kr[u] = nk[u];
                vr[u] = nv[u];
                ok[u] = nok[u];
            }
        }
    } else {
        for (int wbase = w0; wbase < c1; wbase += TS * U) {
            uint4 kr[U], vr[U];
            bool ok[U];
            load_tile(wbase, kr, vr, ok);
            consume(kr, vr, ok);
        }
    }

    // Merge the TPW streams of each warp (lanes that differ in lane / LPT).
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            float a2[8];
#pragma unroll
            for (int j = 0; j < 8; j++) a2[j] = __shfl_xor_sync(0xffffffffu, acc[g][j], o);
            merge_state(m[g], l[g], acc[g], m2, l2, a2);
        }
    }
    if (lane < LPT) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (lane == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
#pragma unroll
            for (int j = 0; j < 8; j++) sm_acc[warp][g][dl * 8 + j] = acc[g][j];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ng * HD; i += NW * 32) {
        const int g = i / HD, d = i - g * HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) mx = fmaxf(mx, sm_m[w][g]);
        float L = 0.f, o = 0.f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float f = exp2f(sm_m[w][g] - mx);
                L += sm_l[w][g] * f;
                o += sm_acc[w][g][d] * f;
            }
        }
        const long long rh = (long long)row * n_heads + h0 + g;
        if (n_splits == 1) {
            out[rh * HD + d] = f2bf(o / L);
        } else {
            const long long ps = rh * n_splits + split;
            part_o[ps * HD + d] = o;
            if (d == 0) {
                part_ml[ps * 2] = mx;
                part_ml[ps * 2 + 1] = L;
            }
        }
    }
}

// Merges the splits of each (row, head): grid (n_heads, rows), HD threads. Splits past the
// row's context hold max = -inf and weigh nothing.
template <int HD>
__device__ __forceinline__ void attention_combine_body(const float* __restrict__ part_o,
                                                       const float* __restrict__ part_ml, bf16_t* __restrict__ out,
                                                       const int* __restrict__ row_ctx, int n_heads, int n_splits,
                                                       int min_chunk) {
    const int h = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
    const int ctx = row_ctx[row];
    const long long rh = (long long)row * n_heads + h;
    if (ctx <= 0) {
        out[rh * HD + d] = f2bf(0.f);  // a padding row (see above)
        return;
    }
    const int chunk = split_chunk(ctx, n_splits, min_chunk);
    const int used = min(n_splits, (ctx + chunk - 1) / chunk);
    const float* ml = part_ml + rh * n_splits * 2;
    float mx = NEG_INF;
    for (int s = 0; s < used; s++) mx = fmaxf(mx, ml[2 * s]);
    float L = 0.f, o = 0.f;
    for (int s = 0; s < used; s++) {
        const float f = exp2f(ml[2 * s] - mx);
        L += ml[2 * s + 1] * f;
        o += part_o[(rh * n_splits + s) * HD + d] * f;
    }
    out[rh * HD + d] = f2bf(o / L);
}

#define ATT_INSTANCE(HD, NW, U, G, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32) paged_attention_hd##HD##_w##NW##_u##U##_g##G##_p##P(      \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                        \
        const int* __restrict__ row_ctx, const int* __restrict__ row_bt, const int* __restrict__ block_tables,    \
        int n_heads, int n_kv_heads, int block_size, float qscale, int min_chunk) {                                \
        paged_attention_body<HD, NW, U, G, P != 0>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,            \
                                           block_tables, n_heads, n_kv_heads, block_size, qscale, min_chunk);     \
    }

// The variants, in the order of ATTN_VARIANTS in kernels/src/cuda/ops.rs.
#define ATT_VARIANTS(HD)       \
    ATT_INSTANCE(HD, 4, 4, 4, 0)  \
    ATT_INSTANCE(HD, 4, 8, 4, 0)  \
    ATT_INSTANCE(HD, 4, 4, 8, 0)  \
    ATT_INSTANCE(HD, 4, 4, 4, 1)  \
    ATT_INSTANCE(HD, 4, 2, 4, 1)  \
    ATT_INSTANCE(HD, 4, 2, 8, 1)  \
    extern "C" __global__ void attention_combine_hd##HD(const float* __restrict__ part_o,                          \
                                                        const float* __restrict__ part_ml, bf16_t* __restrict__ out, \
                                                        const int* __restrict__ row_ctx, int n_heads, int n_splits,  \
                                                        int min_chunk) {                                            \
        attention_combine_body<HD>(part_o, part_ml, out, row_ctx, n_heads, n_splits, min_chunk);                   \
    }

ATT_VARIANTS(16)
ATT_VARIANTS(32)
ATT_VARIANTS(64)
ATT_VARIANTS(128)
