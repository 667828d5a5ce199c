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
//
// Options (runtime arguments of every entry, both kernels and the combine; `AttentionOptions`
// in kernels/src/cuda/attention.rs):
// - window > 0: row r reads keys [max(0, ctx - window), ctx) only; the splits cut that range
//   (its length min(ctx, window) replaces ctx in split_chunk), so no block before the window
//   is read and splits past it do nothing. 0: the whole context.
// - cap2 > 0: each score s (log2 domain) becomes cap2 * tanh(s / cap2), cap2 = softcap *
//   log2(e): in the natural domain cap * tanh(s / cap), the soft-cap of the scaled score.
// - sinks non-null: one natural-log logit per query head that joins the softmax denominator
//   only (gpt-oss). It is added once, where the output is normalized: the single-split write
//   or the combine, never per split.

// The first key a row of ctx tokens reads (window 0: the whole context).
__device__ __forceinline__ int window_start(int ctx, int window) { return window > 0 ? max(0, ctx - window) : 0; }

// The soft-cap of a log2-domain score (cap2 <= 0: none).
__device__ __forceinline__ float soft_cap(float s, float cap2) { return cap2 > 0.f ? cap2 * tanhf(s / cap2) : s; }

// Adds head h's sink to a finished (max mx, sum L, unnormalized o) softmax state: the sink's
// column weighs exp(sink) in the natural domain, so exp2(sink * log2 e - max) here; the max
// moves to the sink when it is larger, so that a large sink rescales instead of overflowing.
__device__ __forceinline__ void add_sink(const float* __restrict__ sinks, int h, float& mx, float& L, float& o) {
    if (sinks == nullptr) return;
    const float sk = sinks[h] * 1.4426950408889634f;
    const float m2 = fmaxf(mx, sk);
    const float f = exp2f(mx - m2);
    L = L * f + exp2f(sk - m2);
    o *= f;
    mx = m2;
}

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
    float qscale, int min_chunk, int window, float cap2, const float* __restrict__ sinks) {
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
    const int lo = window_start(ctx, window);
    const int chunk = split_chunk(ctx - lo, n_splits, min_chunk);
    const int c0 = lo + split * chunk;
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
                    s[u] = ok[u] ? soft_cap(d, cap2) : NEG_INF;
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
            add_sink(sinks, h0 + g, mx, L, o);
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
                                                       int min_chunk, int window, const float* __restrict__ sinks) {
    const int h = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
    const int ctx = row_ctx[row];
    const long long rh = (long long)row * n_heads + h;
    if (ctx <= 0) {
        out[rh * HD + d] = f2bf(0.f);  // a padding row (see above)
        return;
    }
    const int len = ctx - window_start(ctx, window);
    const int chunk = split_chunk(len, n_splits, min_chunk);
    const int used = min(n_splits, (len + chunk - 1) / chunk);
    const float* ml = part_ml + rh * n_splits * 2;
    float mx = NEG_INF;
    for (int s = 0; s < used; s++) mx = fmaxf(mx, ml[2 * s]);
    float L = 0.f, o = 0.f;
    for (int s = 0; s < used; s++) {
        const float f = exp2f(ml[2 * s] - mx);
        L += ml[2 * s + 1] * f;
        o += part_o[(rh * n_splits + s) * HD + d] * f;
    }
    add_sink(sinks, h, mx, L, o);
    out[rh * HD + d] = f2bf(o / L);
}

#define ATT_INSTANCE(HD, NW, U, G, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32) paged_attention_hd##HD##_w##NW##_u##U##_g##G##_p##P(      \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                        \
        const int* __restrict__ row_ctx, const int* __restrict__ row_bt, const int* __restrict__ block_tables,    \
        int n_heads, int n_kv_heads, int block_size, float qscale, int min_chunk, int window, float cap2,          \
        const float* __restrict__ sinks) { PDL_ENTER();                                                           \
        paged_attention_body<HD, NW, U, G, P != 0>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,            \
                                           block_tables, n_heads, n_kv_heads, block_size, qscale, min_chunk,      \
                                           window, cap2, sinks);                                                  \
    }

// The variants, in the order of ATTN_VARIANTS in kernels/src/cuda/paged_attention.rs.
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
                                                        int min_chunk, int window, const float* __restrict__ sinks) { PDL_ENTER(); \
        attention_combine_body<HD>(part_o, part_ml, out, row_ctx, n_heads, n_splits, min_chunk, window, sinks);    \
    }

ATT_VARIANTS(16)
ATT_VARIANTS(32)
ATT_VARIANTS(64)
ATT_VARIANTS(128)
ATT_VARIANTS(256)

// ---------------------------------------------------------------------------------------------
// Tensor-core decode attention (`paged_attention_tc_*`): the same contract as above (arguments,
// grid (n_kv_heads * group chunks, rows, splits), split_chunk cut here, padding rows, partials
// for attention_combine), a different inside.
//
// Why. The kernel above is limited by loads in flight per SM: its K/V tiles live in registers,
// so more tokens in flight means more registers, fewer resident warps and no net gain (see
// BENCHMARKS.md). Here K/V tiles go global -> shared memory by cp.async (16-byte copies that
// need no registers while in flight) through an NS-stage ring, and the arithmetic runs on the
// tensor cores: the CTA's query heads (up to MG = 8 or 16) are the M rows of
// mma.sync.m16n8k16 (rows past the group are zero: the kernel is memory-bound, so wasted M is
// free), tokens are N for S = Q K^T and K for O += P V (P stays in registers: the S
// accumulators are exactly the A fragment of the P V product). No per-token shuffle
// reduction, no per-token f32 K/V conversion.
//
// Numbers written before measuring (Llama-3.1-8B shape: 32 query heads, 8 KV heads, head_dim
// 128, GQA group 4, block 16, bf16 cache; b = 32 rows at ctx 2,048):
//   bytes: K + V = 2 * 32 * 2048 * 8 * 128 * 2 = 268.4 MB, q + out 0.5 MB -> 268.9 MB;
//          at the measured H100 copy rate (2,980 GB/s) the floor is 90 us.
//   FLOPs: 4 * 32 * 32 * 2048 * 128 = 1.07 GFLOP useful; the tensor cores execute 4x that
//          (4 of 16 M rows used) = 4.3 GFLOP, ~10 us at mma.sync rates: memory-bound still.
//   In flight: a stage is TT = 8*NW tokens of K and V: 8 KB at NW = 2, head_dim 128. With
//          NS = 4 stages (34.8 KB of shared memory with the row padding) 6 CTAs fit an SM
//          (228 KB), each keeping NS-1 = 3 stages in flight while it computes on the fourth:
//          6 * 3 * 8 KB = 144 KB per SM, against ~23 KB that Little's law needs at 3 TB/s and
//          ~1 us (the register kernel peaks at ~48 KB: 3 CTAs * 128 threads * 4 tokens * 32 B).
//          b = 32, ctx 2k makes 768 CTAs (3 splits): one wave at 6 per SM (792 slots).
//   Predicted: 75-85 % of copy at b >= 32, ctx >= 2k (from 50-57 %); the rest is DRAM
//          efficiency on 256-byte rows scattered by the block table, the CTA prologue (four
//          dependent loads before the first copy) and, where a launch has more CTAs than 6 per
//          SM (b = 64 at 2k: 1,024), a second partial wave.
//   ptxas (sm_90a, head_dim 128): w2_s4_g8 144 registers, 34,816 B shared, 0 spills -> 6 CTAs
//          per SM (shared memory and registers both allow 6); w2_s5_g8 144 / 43,520 B -> 5;
//          w2_s4_g16 160 / 34,816 B -> 6. The issue per stage and warp is ~250 instructions
//          against ~630 cycles of the SM's share of bandwidth per stage: compute keeps up.
//
// Layout. Stage s holds TT consecutive tokens of the chunk, K then V, one row per token of HD
// bf16 padded to RS = HD + 8 elements (16 bytes): ldmatrix reads 8 rows at one column, and the
// odd 16-byte stride puts them in 8 different bank groups. Warp w owns tokens 8w..8w+7 of
// every stage: S (16 x 8) = Q (16 x HD) K^T by HD/16 m16n8k16; online softmax per row over
// its 8 tokens (a quad of lanes holds a row: two shuffles for the max); O (16 x HD) += P V by
// HD/8 m16n8k8 (k = its 8 tokens). Warps keep their own (max, sum, O) and merge once at the
// end through shared memory (the pipeline buffers, drained by then).
//
// Block tables: four threads share each token of a stage (see the copy assignment below), so
// a thread tracks one token's block; the block id of its token in the next stage is loaded
// one stage ahead into a register, so the dependent block-table read never stalls the copy
// issue. Tokens past the chunk are copied
// as zeros (cp.async src-size 0), so no stale or uninitialized shared memory (possibly NaN)
// meets a zero probability in the P V product; their scores are masked to -inf.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy; n = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x2(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x2_t(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x1(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm_x1_t(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr) : "memory");
}

// N (1, 2 or 4) 8 x 8 b16 matrices, transposed with TRANS; lane l supplies the address of row
// l % 8 of matrix l / 8 (lanes past 8 N are ignored).
template <int N, bool TRANS>
__device__ __forceinline__ void ldsm_n(unsigned addr, unsigned* r) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
    if constexpr (N == 4) {
        if constexpr (TRANS) ldsm_x4_t(addr, r); else ldsm_x4(addr, r);
    } else if constexpr (N == 2) {
        if constexpr (TRANS) ldsm_x2_t(addr, r); else ldsm_x2(addr, r);
    } else {
        if constexpr (TRANS) ldsm_x1_t(addr, r); else ldsm_x1(addr, r);
    }
}

// Two f32 as f16x2, lo in the low half.
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two f32 as bf16x2, lo in the low half (the lower column of an mma fragment).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c (MG/4 accumulators: rows g, and g + 8 when MG = 16) += A (16 x 16) B (16 x 8). With MG = 8
// rows 8..15 are zero: a1, a3 and c2, c3 are constants and d2, d3 are dropped, so the
// accumulators of those rows take no registers.
template <int MG>
__device__ __forceinline__ void tc_mma_k16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    if constexpr (MG == 16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        float x2, x3;
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %10, %10};"
            : "+f"(c[0]), "+f"(c[1]), "=f"(x2), "=f"(x3)
            : "r"(a[0]), "r"(0u), "r"(a[1]), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
    }
}

// c += A (16 x 8: a0 rows g, a1 rows g + 8) B (8 x 8), as tc_mma_k16.
template <int MG>
__device__ __forceinline__ void tc_mma_k8(float* c, const unsigned* a, unsigned b0) {
    if constexpr (MG == 16) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(b0));
    } else {
        float x2, x3;
        asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %7, %7};"
            : "+f"(c[0]), "+f"(c[1]), "=f"(x2), "=f"(x3)
            : "r"(a[0]), "r"(0u), "r"(b0), "f"(0.f));
    }
}

// Bytes of one ring row (a token's K or V): HD bf16 padded by 16 bytes (see Layout), or for
// an FP8 cache (eb = 1) HD codes padded by 16 bytes.
constexpr int tc_ring_row(int hd, int eb) { return eb == 1 ? hd + 16 : (hd + 8) * 2; }

// Tokens a warp takes per stage: 8 (the bf16 kernel: tokens are the mma's N) or 16 (the FP8
// kernel, attention_tc_fp8.cu: tokens are its M).
constexpr int tc_warp_tokens(int eb) { return eb == 1 ? 16 : 8; }

// Shared memory of one CTA: the ring, or the end-of-kernel merge (which reuses it) if larger.
constexpr int tc_smem_bytes(int hd, int nw, int ns, int mg, int eb) {
    return ns * 2 * (tc_warp_tokens(eb) * nw) * tc_ring_row(hd, eb) > nw * mg * (hd + 2) * 4
               ? ns * 2 * (tc_warp_tokens(eb) * nw) * tc_ring_row(hd, eb)
               : nw * mg * (hd + 2) * 4;
}

// CTAs per SM that shared memory allows (228 KB per SM, 1 KB reserved per CTA), at most 6:
// the residency the register allocation must leave room for (__launch_bounds__' second
// value; 6 CTAs of 2 warps leave 170 registers a thread). Without it ptxas picked 72
// registers and spilled for some head_dim 64 shapes; a cap of 8 CTAs (128 registers) spilled
// at head_dim 128, whose shapes take 154-168.
// At head_dim 256 the accumulators and Q fragments alone take ~100 registers a thread and the
// shapes 238-250 in all, so at most 4 CTAs of 2 warps fit by registers (tc_cta_cap): the first
// FP8 kernel's 4-stage ring (34.8 KB, 6 CTAs by shared memory) spilled 240 bytes a thread at 6.
constexpr int tc_cta_cap(int hd) { return hd >= 256 ? 4 : 6; }

constexpr int tc_min_ctas(int hd, int nw, int ns, int mg, int eb) {
    return 233472 / (tc_smem_bytes(hd, nw, ns, mg, eb) + 1024) < tc_cta_cap(hd)
               ? 233472 / (tc_smem_bytes(hd, nw, ns, mg, eb) + 1024)
               : tc_cta_cap(hd);
}

// Shared memory a CTA declares statically; a shape that needs more (head_dim 256) takes it as
// dynamic shared memory, whose size the launcher passes and whose limit the device raised
// (`tc_dynamic_smem` in kernels/src/cuda/paged_attention.rs mirrors tc_smem_bytes).
constexpr int TC_STATIC_SMEM = 48 * 1024;

template <int SMEM>
__device__ __forceinline__ unsigned char* tc_smem_base() {
    if constexpr (SMEM <= TC_STATIC_SMEM) {
        __shared__ __align__(16) unsigned char s[SMEM];
        return s;
    } else {
        extern __shared__ __align__(16) unsigned char tc_dyn_smem[];
        return tc_dyn_smem;
    }
}

// The copy of a CTA's row chunk into the shared-memory ring, shared by both tensor-core decode
// kernels. A stage is TT tokens: K rows (ring slot s at sk + s * TILE_B) then V rows (at sv),
// RB bytes a row. Four threads share each token: thread q = tid % 4 copies 16-byte chunks
// q, q + 4, ... of the token's K row followed by its V row (2 * CPR chunks; with 2 * CPR < 4
// some threads copy nothing), so one warp instruction reads 64 contiguous bytes of each of 8
// rows (whole 32-byte sectors; the FP8 kernel's first version, two threads a token and 32
// bytes a row per instruction, ran 15 % slower at 32 x 8k). With TT > THREADS / 4 (the FP8
// kernel's 16 tokens a warp) a thread serves TPTH tokens, THREADS / 4 apart. Each thread
// tracks the blocks of its tokens only: the block id of a token in the next stage is loaded
// one stage ahead, so the dependent block-table read is a stage old when its copies issue.
// Tokens past the chunk are copied as zeros (cp.async src-size 0): no stale or uninitialized
// shared memory (possibly NaN) meets a zero probability in the P V product.
template <typename C, int HD, int TT, int THREADS, int RB, int NS>
struct TcRing {
    static constexpr int TPT = 4;                          // threads per token
    static constexpr int TPTH = TT * TPT / THREADS;        // tokens per thread
    static constexpr int CPR = HD * (int)sizeof(C) / 16;  // 16-byte chunks per row
    static constexpr int CPT = (2 * CPR + TPT - 1) / TPT;  // copies per thread and token per stage
    static constexpr int EPC = 16 / (int)sizeof(C);      // elements per chunk
    static constexpr int TILE_B = TT * RB;                 // bytes of one K (or V) stage
    static_assert(TPTH >= 1 && TPTH * THREADS == TT * TPT && CPR >= 1 && RB % 16 == 0, "copy mapping");

    const C* kbase;
    const C* vbase;
    const int* bt;
    long long kv_w;
    int block_size, c1, p0, ctok, cq;
    int lb[TPTH], off[TPTH], blk[TPTH];
    unsigned sk, sv, drow;

    __device__ __forceinline__ TcRing(unsigned ring, const C* k_cache, const C* v_cache, int kvh, int n_kv_heads,
                                      int block_size_, const int* bt_, int c0, int c1_, int tid)
        : kbase(k_cache + (long long)kvh * HD), vbase(v_cache + (long long)kvh * HD), bt(bt_),
          kv_w((long long)n_kv_heads * HD), block_size(block_size_), c1(c1_), p0(c0), ctok(tid / TPT),
          cq(tid % TPT), sk(ring), sv(ring + NS * TILE_B), drow((unsigned)(tid / TPT * RB)) {
#pragma unroll
        for (int k = 0; k < TPTH; k++) {
            const int p = c0 + ctok + k * (THREADS / TPT);
            lb[k] = p / block_size;
            off[k] = p - lb[k] * block_size;
            blk[k] = p < c1 ? bt[lb[k]] : 0;
        }
    }

    // Copies the next stage in order (the token state advances by one stage) into slot s.
    __device__ __forceinline__ void issue(int s) {
#pragma unroll
        for (int k = 0; k < TPTH; k++) {
            const int p = p0 + ctok + k * (THREADS / TPT);
            const int n = p < c1 ? 16 : 0;
            const long long e = n ? ((long long)blk[k] * block_size + off[k]) * kv_w : 0;
            const unsigned d = (unsigned)(s * TILE_B) + drow + (unsigned)(k * (THREADS / TPT) * RB);
#pragma unroll
            for (int j = 0; j < CPT; j++) {
                // Chunk c of the K row then V row (c < CPR: K).
                const int c = cq + TPT * j;
                if ((2 * CPR) % TPT == 0 || c < 2 * CPR) {
                    const bool is_v = c >= CPR;
                    const int col = is_v ? c - CPR : c;
                    cp_async16((is_v ? sv : sk) + d + col * 16, (is_v ? vbase : kbase) + e + col * EPC, n);
                }
            }
            off[k] += TT;
            while (off[k] >= block_size) {
                off[k] -= block_size;
                lb[k]++;
            }
            blk[k] = p + TT < c1 ? bt[lb[k]] : 0;
        }
        p0 += TT;
    }
};

// The end of both tensor-core decode kernels, once every warp has written its heads' running
// (max, sum) to sm_ml [NW][MG][2] and unnormalized O to sm_o [NW][MG][HD] and the CTA has
// synchronized: the CTA combines the warps per output and writes the normalized bf16 output
// (one split; the sink joins the softmax here) or the split's partial for attention_combine.
// v_scale multiplies O (an FP8 cache's V scale; 1 for bf16).
template <int HD, int NW, int MG>
__device__ __forceinline__ void tc_merge_write(const float* sm_o, const float* sm_ml, int ng, int row, int h0,
                                               int n_heads, int split, int n_splits, float v_scale,
                                               const float* __restrict__ sinks, bf16_t* __restrict__ out,
                                               float* __restrict__ part_o, float* __restrict__ part_ml) {
    for (int i = threadIdx.x; i < ng * HD; i += NW * 32) {
        const int r = i / HD, d = i - r * HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) mx = fmaxf(mx, sm_ml[(w * MG + r) * 2]);
        float L = 0.f, o = 0.f;
        // mx is finite: the chunk holds at least one valid token, so some warp saw one.
#pragma unroll
        for (int w = 0; w < NW; w++) {
            const float f = exp2f(sm_ml[(w * MG + r) * 2] - mx);
            L += sm_ml[(w * MG + r) * 2 + 1] * f;
            o += sm_o[(w * MG + r) * HD + d] * f;
        }
        const long long rh = (long long)row * n_heads + h0 + r;
        if (n_splits == 1) {
            add_sink(sinks, h0 + r, mx, L, o);
            out[rh * HD + d] = f2bf(o * v_scale / L);
        } else {
            const long long ps = rh * n_splits + split;
            part_o[ps * HD + d] = o * v_scale;
            if (d == 0) {
                part_ml[ps * 2] = mx;
                part_ml[ps * 2 + 1] = L;
            }
        }
    }
}

// The row, CTA and chunk a tensor-core decode CTA serves (grid (n_kv_heads * group chunks,
// rows, splits)); `run` is false when it has nothing to do: a padding row (whose zeros the
// first split writes here) or a split past the row's context (the combine never reads it).
struct TcChunk {
    int kvh, row, split, n_splits, h0, ng, c0, c1;
    bool run;
};

template <int HD, int MG>
__device__ __forceinline__ TcChunk tc_chunk(const int* __restrict__ row_ctx, int n_heads, int n_kv_heads,
                                            int min_chunk, int window, bf16_t* __restrict__ out) {
    TcChunk k;
    const int group = n_heads / n_kv_heads;
    const int gchunks = (group + MG - 1) / MG;
    k.kvh = blockIdx.x / gchunks;
    const int gc = blockIdx.x - k.kvh * gchunks;
    k.row = blockIdx.y;
    k.split = blockIdx.z;
    k.n_splits = gridDim.z;
    k.h0 = k.kvh * group + gc * MG;
    k.ng = min(MG, group - gc * MG);
    const int ctx = row_ctx[k.row];
    k.run = false;
    k.c0 = k.c1 = 0;
    if (ctx <= 0) {
        // A padding row: zeros, so that nothing downstream reads uninitialized memory.
        if (k.split == 0) {
            for (int i = threadIdx.x; i < k.ng * HD; i += blockDim.x)
                out[((long long)k.row * n_heads + k.h0 + i / HD) * HD + i % HD] = f2bf(0.f);
        }
        return k;
    }
    const int lo = window_start(ctx, window);
    const int chunk = split_chunk(ctx - lo, k.n_splits, min_chunk);
    k.c0 = lo + k.split * chunk;
    k.c1 = min(ctx, k.c0 + chunk);
    k.run = k.c0 < k.c1;
    return k;
}

// Q of `row` as mma A fragments (rows g and g + 8 = query heads h0 + g (+ 8), k = head dims;
// heads past ng are zero), unscaled: the scale is applied to the f32 scores so q keeps its bf16
// value exactly. Fragment order a0 (row g, k 2t), a1 (row g+8), a2 (row g, k 2t+8), a3 (row
// g+8, k 2t+8); with MG = 8 only a0, a2 are kept (tc_mma_k16 supplies the zero rows). Shared by
// the bf16 tensor-core and streaming decode kernels.
template <int HD, int MG>
__device__ __forceinline__ void tc_load_q(const bf16_t* __restrict__ q, int row, int n_heads, int h0, int ng, int g,
                                          int t, unsigned (&qa)[HD / 16][MG / 4]) {
    constexpr int RH = MG / 8;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
        for (int h = 0; h < RH; h++) {
            const int r = g + 8 * h;
            unsigned lo = 0, hi = 0;
            if (r < ng) {
                const unsigned* qr =
                    reinterpret_cast<const unsigned*>(q + ((long long)row * n_heads + h0 + r) * HD + kk * 16 + 2 * t);
                lo = qr[0];
                hi = qr[4];
            }
            if constexpr (RH == 2) {
                qa[kk][h] = lo;
                qa[kk][2 + h] = hi;
            } else {
                qa[kk][0] = lo;
                qa[kk][1] = hi;
            }
        }
    }
}

// An empty online-softmax state: running max -inf, sum 0, accumulators 0.
template <int HD, int RH>
__device__ __forceinline__ void tc_clear_state(float (&m)[RH], float (&l)[RH], float (&acc)[HD / 8][2 * RH]) {
#pragma unroll
    for (int h = 0; h < RH; h++) {
        m[h] = NEG_INF;
        l[h] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int i = 0; i < 2 * RH; i++) acc[j][i] = 0.f;
}

// The bf16-cache kernel (an FP8 cache has its own, attention_tc_fp8.cu).
template <int HD, int NW, int NS, int MG>
__device__ __forceinline__ void paged_attention_tc_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, int window, float cap2, const float* __restrict__ sinks) {
    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "head_dim: a multiple of 16, at most 256");
    static_assert(MG == 8 || MG == 16, "8 or 16 query heads per CTA (the mma's M rows)");
    static_assert(NS >= 2, "at least double buffering");
    constexpr int THREADS = NW * 32;
    constexpr int TT = tc_warp_tokens(2) * NW;  // tokens per stage (8 per warp)
    constexpr int RS = HD + 8;                  // padded bf16 row stride, elements
    constexpr int RB = tc_ring_row(HD, 2);      // ring row stride, bytes
    constexpr int RH = MG / 8;                  // accumulator row halves per thread (g, g + 8)
    constexpr int SMEM = tc_smem_bytes(HD, NW, NS, MG, 2);
    using Ring = TcRing<bf16_t, HD, TT, THREADS, RB, NS>;
    static_assert(SMEM >= NS * 2 * Ring::TILE_B && SMEM >= NW * MG * (HD + 2) * 4, "ring and merge fit");
    static_assert(SMEM <= 227 * 1024, "a CTA's shared memory limit");
    static_assert(Ring::TPTH == 1, "one token a thread");
    unsigned char* const smem = tc_smem_base<SMEM>();

    const TcChunk ck = tc_chunk<HD, MG>(row_ctx, n_heads, n_kv_heads, min_chunk, window, out);
    if (!ck.run) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int c0 = ck.c0, c1 = ck.c1, ng = ck.ng;
    const int n_tiles = (c1 - c0 + TT - 1) / TT;
    Ring ring(smem_addr(smem), k_cache, v_cache, ck.kvh, n_kv_heads, block_size, block_tables + row_bt[ck.row], c0,
              c1, tid);

    // Q as A fragments, and the running softmax state.
    unsigned qa[HD / 16][2 * RH];
    tc_load_q<HD, MG>(q, ck.row, n_heads, ck.h0, ng, g, t, qa);
    float m[RH], l[RH], acc[HD / 8][2 * RH];
    tc_clear_state<HD, RH>(m, l, acc);

    // The ring: NS - 1 stages in flight while one is consumed. Empty commit groups keep the
    // wait count uniform at the tail.
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < n_tiles) ring.issue(s);
        cp_async_commit();
    }
    // ldmatrix row addresses: lane l supplies row l % 8 of matrix l / 8; the warp's rows are
    // its 8 tokens of the ring stage.
    const unsigned lrow = (unsigned)(((warp * 8 + (lane & 7)) * RS + (lane >> 3) * 8) * 2);
    const unsigned lrow2 = (unsigned)(((warp * 8 + (lane & 7)) * RS + ((lane >> 3) & 1) * 8) * 2);
    for (int it = 0; it < n_tiles; it++) {
        cp_async_wait<NS - 2>();
        // Stage `it` is visible to every warp, and every warp is done with the slot that the
        // next copy overwrites (consumed in the previous iteration).
        __syncthreads();
        if (it + NS - 1 < n_tiles) ring.issue((it + NS - 1) % NS);
        cp_async_commit();

        const int s = it % NS;
        const unsigned ks = ring.sk + (unsigned)(s * Ring::TILE_B), vs = ring.sv + (unsigned)(s * Ring::TILE_B);
        // S = Q K^T over this warp's 8 tokens.
        float sc[2 * RH];
#pragma unroll
        for (int i = 0; i < 2 * RH; i++) sc[i] = 0.f;
        if constexpr (HD >= 32) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk += 2) {
                unsigned b[4];
                ldsm_x4(ks + lrow + kk * 32, b);
                tc_mma_k16<MG>(sc, qa[kk], b[0], b[1]);
                tc_mma_k16<MG>(sc, qa[kk + 1], b[2], b[3]);
            }
        } else {
            unsigned b[2];
            ldsm_x2(ks + lrow2, b);
            tc_mma_k16<MG>(sc, qa[0], b[0], b[1]);
        }
        // Online softmax (log2 domain) per row over the 8 tokens; a row lives in one quad.
        const int pt = c0 + it * TT + warp * 8 + 2 * t;
        const bool v0 = pt < c1, v1 = pt + 1 < c1;
        unsigned pa[RH];
        float corr[RH];
#pragma unroll
        for (int h = 0; h < RH; h++) {
            const float s0 = v0 ? soft_cap(sc[2 * h] * qscale, cap2) : NEG_INF;
            const float s1 = v1 ? soft_cap(sc[2 * h + 1] * qscale, cap2) : NEG_INF;
            float tm = fmaxf(s0, s1);
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
            const float mn = fmaxf(m[h], tm);
            // No valid token seen yet by this warp: keep everything at zero.
            const float mu = mn == NEG_INF ? 0.f : mn;
            corr[h] = exp2f(m[h] - mu);
            const float p0 = exp2f(s0 - mu), p1 = exp2f(s1 - mu);
            l[h] = l[h] * corr[h] + p0 + p1;
            m[h] = mn;
            pa[h] = pack_bf16x2(p0, p1);
        }
        // The rescale is skipped when no row of the warp moved its max (every corr is exactly
        // 1, so the product would be the identity), as after the first tiles it rarely does.
        // Not at head_dim 256, where the branch costs registers the 8-head shapes do not have.
        bool moved = HD > 128;
        if constexpr (HD <= 128) {
#pragma unroll
            for (int h = 0; h < RH; h++) moved |= corr[h] != 1.f;
            moved = __any_sync(0xffffffffu, moved);
        }
        if (moved) {
#pragma unroll
            for (int j = 0; j < HD / 8; j++)
#pragma unroll
                for (int i = 0; i < 2 * RH; i++) acc[j][i] *= corr[i / 2];
        }
        // O += P V: the 8 tokens are k, head dims n (8 per mma).
        if constexpr (HD >= 32) {
#pragma unroll
            for (int nb = 0; nb < HD / 32; nb++) {
                unsigned b[4];
                ldsm_x4_t(vs + lrow + nb * 64, b);
#pragma unroll
                for (int j = 0; j < 4; j++) tc_mma_k8<MG>(acc[nb * 4 + j], pa, b[j]);
            }
        } else {
            unsigned b[2];
            ldsm_x2_t(vs + lrow2, b);
            tc_mma_k8<MG>(acc[0], pa, b[0]);
            tc_mma_k8<MG>(acc[1], pa, b[1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reuse it for the merge

    // Merge the warps: each writes its rows' (max, sum, O) and the CTA combines per output.
    float* const sm_o = reinterpret_cast<float*>(smem);  // [NW][MG][HD]
    float* const sm_ml = sm_o + NW * MG * HD;            // [NW][MG][2]
#pragma unroll
    for (int h = 0; h < RH; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int r = g + 8 * h;
        if (t == 0) {
            sm_ml[(warp * MG + r) * 2] = m[h];
            sm_ml[(warp * MG + r) * 2 + 1] = l[h];
        }
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            sm_o[(warp * MG + r) * HD + j * 8 + 2 * t] = acc[j][2 * h];
            sm_o[(warp * MG + r) * HD + j * 8 + 2 * t + 1] = acc[j][2 * h + 1];
        }
    }
    __syncthreads();
    tc_merge_write<HD, NW, MG>(sm_o, sm_ml, ng, ck.row, ck.h0, n_heads, ck.split, ck.n_splits, 1.f, sinks, out,
                               part_o, part_ml);
}

#define ATT_TC_INSTANCE(HD, NW, NS, MG)                                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, tc_min_ctas(HD, NW, NS, MG, 2)) paged_attention_tc_hd##HD##_w##NW##_s##NS##_g##MG(       \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                        \
        const int* __restrict__ row_ctx, const int* __restrict__ row_bt, const int* __restrict__ block_tables,    \
        int n_heads, int n_kv_heads, int block_size, float qscale, int min_chunk, int window, float cap2,          \
        const float* __restrict__ sinks) { PDL_ENTER();                                                           \
        paged_attention_tc_body<HD, NW, NS, MG>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,       \
                                                block_tables, n_heads, n_kv_heads, block_size, qscale, min_chunk, \
                                                window, cap2, sinks);                                             \
    }

// The tensor-core variants (warps, stages, heads per CTA), in the order they follow the
// register variants in ATTN_VARIANTS (the FP8-cache variants: attention_tc_fp8.cu).
#define ATT_TC_VARIANTS(HD)      \
    ATT_TC_INSTANCE(HD, 2, 4, 8) \
    ATT_TC_INSTANCE(HD, 2, 5, 8) \
    ATT_TC_INSTANCE(HD, 2, 4, 16)

ATT_TC_VARIANTS(16)
ATT_TC_VARIANTS(32)
ATT_TC_VARIANTS(64)
ATT_TC_VARIANTS(128)
ATT_TC_VARIANTS(256)
