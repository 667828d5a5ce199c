// Paged causal attention for mixed batches (prefill chunks over a cached prefix and decode
// rows alike), GQA, bf16 K/V cache, f32 scores and online softmax.
//
// Grid: (query rows, KV heads, ceil(group / MAXG)). One block serves one query row and the
// up-to-MAXG query heads that share one KV head, so each K/V row is read once for the whole
// group. The block's NW warps split the row's context (warp w takes tokens w*U.. in strides
// of NW*U). NW, U and MAXG are template parameters: several variants are instantiated so the
// benchmark can time them side by side (names paged_attention_hd{HD}_w{NW}_u{U}_g{MAXG}_p{PF}); within a warp each lane holds E = head_dim/32 elements of the head (head_dim 16:
// half the lanes idle), dot products finish with a butterfly shuffle, and U tokens are
// loaded before any is used so that several loads are in flight. Warps merge their partial
// (max, sum, acc) through shared memory at the end.
//
// row_ctx[r]: tokens row r attends to (its position + 1: causal over the cache, which
// already holds the row's own K/V). row_bt[r]: offset of the row's block table in
// block_tables. Cache layout per layer: [slot][n_kv_heads][head_dim].


template <int E>
__device__ __forceinline__ void load_bf(const bf16_t* p, float* d) {
    if constexpr (E == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) { d[2 * j] = __uint_as_float(w[j] << 16); d[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u); }
    } else if constexpr (E == 4) {
        uint2 u = *reinterpret_cast<const uint2*>(p);
        d[0] = __uint_as_float(u.x << 16); d[1] = __uint_as_float(u.x & 0xffff0000u);
        d[2] = __uint_as_float(u.y << 16); d[3] = __uint_as_float(u.y & 0xffff0000u);
    } else if constexpr (E == 2) {
        unsigned u = *reinterpret_cast<const unsigned*>(p);
        d[0] = __uint_as_float(u << 16); d[1] = __uint_as_float(u & 0xffff0000u);
    } else {
#pragma unroll
        for (int j = 0; j < E; j++) d[j] = bf2f(p[j]);
    }
}

template <int HD, int ATT_NW, int ATT_U, int ATT_MAXG, bool PF>
__device__ __forceinline__ void paged_attention_body(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                                                     const bf16_t* __restrict__ v_cache, bf16_t* __restrict__ out,
                                                     const int* __restrict__ row_ctx, const int* __restrict__ row_bt,
                                                     const int* __restrict__ block_tables, int n_heads,
                                                     int n_kv_heads, int block_size, float scale) {
    constexpr int E = HD >= 32 ? HD / 32 : 1;
    __shared__ float sm_m[ATT_NW][ATT_MAXG];
    __shared__ float sm_l[ATT_NW][ATT_MAXG];
    __shared__ float sm_acc[ATT_NW][ATT_MAXG][HD];

    const int row = blockIdx.x, kvh = blockIdx.y;
    const int group = n_heads / n_kv_heads;
    const int g0 = blockIdx.z * ATT_MAXG;
    const int ng = min(ATT_MAXG, group - g0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool active = lane * E < HD;
    const int ctx = row_ctx[row];
    const int* bt = block_tables + row_bt[row];
    const long long kv_w = (long long)n_kv_heads * HD;

    // Queries of the group, pre-scaled, E elements per lane.
    float qv[ATT_MAXG][E];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        if (g < ng && active) {
            load_bf<E>(q + ((long long)row * n_heads + kvh * group + g0 + g) * HD + lane * E, qv[g]);
#pragma unroll
            for (int j = 0; j < E; j++) qv[g][j] *= scale;
        } else {
#pragma unroll
            for (int j = 0; j < E; j++) qv[g][j] = 0.f;
        }
    }
    float m[ATT_MAXG], l[ATT_MAXG], acc[ATT_MAXG][E];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < E; j++) acc[g][j] = 0.f;
    }

    // PF: the block id of the warp's next token group is loaded one iteration ahead, so the
    // K/V loads do not wait behind a dependent block-table load; the group's slots are then
    // derived from (block, offset) without a division per token.
    int nxt_blk = 0;
    if (PF && warp * ATT_U < ctx) nxt_blk = bt[(warp * ATT_U) / block_size];
    for (int base = warp * ATT_U; base < ctx; base += ATT_NW * ATT_U) {
        float kf[ATT_U][E], vf[ATT_U][E];
        bool ok[ATT_U];
        const int lb = base / block_size;
        const int off0 = base - lb * block_size;
        const int cur_blk = nxt_blk;
        if (PF) {
            const int nb = base + ATT_NW * ATT_U;
            if (nb < ctx) nxt_blk = bt[nb / block_size];
        }
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            int p = base + u;
            ok[u] = p < ctx;
            if (ok[u] && active) {
                long long slot;
                if (PF && off0 + u < block_size) {
                    slot = (long long)cur_blk * block_size + off0 + u;
                } else {
                    slot = (long long)bt[p / block_size] * block_size + p % block_size;
                }
                const long long off = slot * kv_w + (long long)kvh * HD + lane * E;
                load_bf<E>(k_cache + off, kf[u]);
                load_bf<E>(v_cache + off, vf[u]);
            } else {
#pragma unroll
                for (int j = 0; j < E; j++) { kf[u][j] = 0.f; vf[u][j] = 0.f; }
            }
        }
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++) {
            if (g >= ng) break;
            float s[ATT_U];
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < ATT_U; u++) {
                float d = 0.f;
#pragma unroll
                for (int j = 0; j < E; j++) d += qv[g][j] * kf[u][j];
                d = warp_sum(d);
                s[u] = ok[u] ? d : NEG_INF;
                mx = fmaxf(mx, s[u]);
            }
            // mx is finite: token `base` is always valid.
            float c = __expf(m[g] - mx);
            l[g] *= c;
#pragma unroll
            for (int j = 0; j < E; j++) acc[g][j] *= c;
#pragma unroll
            for (int u = 0; u < ATT_U; u++) {
                float pr = __expf(s[u] - mx);
                l[g] += pr;
#pragma unroll
                for (int j = 0; j < E; j++) acc[g][j] += pr * vf[u][j];
            }
            m[g] = mx;
        }
    }

#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        if (g < ng) {
            if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
            if (active) {
#pragma unroll
                for (int j = 0; j < E; j++) sm_acc[warp][g][lane * E + j] = acc[g][j];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ng * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATT_NW; w++) mx = fmaxf(mx, sm_m[w][g]);
        float L = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_NW; w++) {
            float mw = sm_m[w][g];
            float f = mw == NEG_INF ? 0.f : __expf(mw - mx);
            L += sm_l[w][g] * f;
            o += sm_acc[w][g][d] * f;
        }
        out[((long long)row * n_heads + kvh * group + g0 + g) * HD + d] = f2bf(o / L);
    }
}

#define ATT_INSTANCE(HD, NW, U, G, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32) paged_attention_hd##HD##_w##NW##_u##U##_g##G##_p##P(        \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, const int* __restrict__ row_ctx, const int* __restrict__ row_bt,                \
        const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size, float scale) {          \
        paged_attention_body<HD, NW, U, G, P != 0>(q, k_cache, v_cache, out, row_ctx, row_bt, block_tables, n_heads,      \
                                           n_kv_heads, block_size, scale);                                         \
    }

// The variants, in the order of ATTN_VARIANTS in kernels/src/cuda/ops.rs.
#define ATT_VARIANTS(HD)      \
    ATT_INSTANCE(HD, 8, 4, 8, 0) \
    ATT_INSTANCE(HD, 8, 8, 8, 0) \
    ATT_INSTANCE(HD, 8, 4, 4, 0) \
    ATT_INSTANCE(HD, 8, 8, 4, 0) \
    ATT_INSTANCE(HD, 4, 8, 4, 0) \
    ATT_INSTANCE(HD, 8, 4, 4, 1) \
    ATT_INSTANCE(HD, 8, 8, 4, 1) \
    ATT_INSTANCE(HD, 4, 4, 4, 1)

ATT_VARIANTS(16)
ATT_VARIANTS(32)
ATT_VARIANTS(64)
ATT_VARIANTS(128)
