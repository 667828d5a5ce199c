// Tensor-core decode attention over an FP8 (E4M3) KV cache (`paged_attention_tc_fp8_*`): the
// contract of the bf16 tensor-core kernel in attention.cu (arguments plus the V scale, grid
// (n_kv_heads * group chunks, rows, splits), split_chunk cut per row, padding rows, partials for
// attention_combine, window / soft-cap / sinks), with its ring copy (TcRing), chunk (tc_chunk)
// and end-of-kernel merge (tc_merge_write); the K scale is folded into qscale by the launcher,
// the V scale multiplies the output (or the split's partial).
//
// Why a kernel of its own. An FP8 stage carries half the bytes of a bf16 one for the same
// tensor-core and softmax work, so instructions per byte matter twice as much. The bf16
// kernel puts the CTA's query heads in the mma's M rows; with a GQA group of 4 to 8 heads half
// of M is zero padding, and ptxas spends ~100 register moves a stage building the padded
// operands (cuobjdump -sass of the session-14 FP8 variant of that kernel: ~390 instructions a
// warp per 8 tokens; ncu at 256 x 1024: 50 % of cycles issuing, 68 % of DRAM bandwidth). Here
// the TOKENS are M: each warp takes 16 tokens of a stage, every mma row is real, and the heads
// are N (8 per n-tile: groups of up to 8, or 16 in two n-tiles).
//
//   S^T (16 tokens x 8 heads)  = K (16 tokens x HD) . Q^T (HD x 8 heads)      m16n8k16, A = K
//   O^T (16 dims x 8 heads)   += V^T (16 dims x 16 tokens) . P^T (16 x 8)     m16n8k16, A = V^T
//
// Products in f16 from the codes: ldmatrix over the code rows gives each lane four codes of a
// row (a 16-bit element is a pair of codes) and one hardware conversion per pair makes them
// f16 (exact: every E4M3 value is an f16 value); nothing converted goes through shared memory.
// - K as A: ldmatrix (tokens 0-7 | 8-15) x (16-byte segment i) gives lane (g, t) bytes 4t..4t+3
//   of segment i of tokens g and g + 8, i.e. head dims 16i + 4t + 0..3. The A fragment wants
//   k = 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3), so a segment's k order is a permutation of
//   its dims; Q^T's B fragments (b0 = dims 16i + 4t + 0..1 of head g, b1 = + 2..3) take the
//   same one, and the dot products are unchanged.
// - V^T as A: ldmatrix.trans over the V rows gives lane (g, t) the code pairs (dims 16i + 2g,
//   + 1) of tokens 2t and 2t + 1 (and of 2t + 8, 2t + 9 from the second matrix); a byte
//   permutation turns each into (token 2t, 2t + 1) pairs of the even and of the odd dim: A rows
//   g and g + 8 are dims 16i + 2g and 16i + 2g + 1, so O^T's accumulators of segment i hold
//   (dim 16i + 2g, heads 2t, 2t + 1) and (dim 16i + 2g + 1, heads 2t, 2t + 1).
// - P^T as B: the S^T accumulators hold (tokens g, g + 8; heads 2t, 2t + 1) while the B
//   fragment wants (tokens 2t, 2t + 1, 2t + 8, 2t + 9; head g): four shuffles of f16 pairs and
//   two byte permutations a warp per 16 tokens and n-tile.
// - Q in f16: exact for |q| in f16's normal range; a CTA whose largest |q| exceeds 2^14 scales
//   Q down by a power of two (exact) and its scores back up by it, so nothing overflows.
// - P in f16 (11 significant bits against bf16's 8: no less accurate than the bf16 kernel).
// The softmax is per head (a column of S^T): the max over a warp's 16 tokens takes three
// shuffles across the lanes that share t; each lane keeps partial sums that the merge adds.

// d (16 x 8, f32) += A (16 x 16, f16) B (16 x 8, f16): the full mma, every row real.
__device__ __forceinline__ void mma_f16_k16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One warp's tokens-as-M products over an FP8 cache, shared by the tensor-core kernel here
// (a warp takes 16 of a stage's tokens, every warp the CTA's heads) and the streaming kernel
// (attention_stream.cu: a warp takes all 16 tokens of a stage for its own KV head): Q^T as B
// fragments for up to MG heads, the running softmax state per head and O^T. Lane (g, t) holds
// heads 2t + c (+ 8 per n-tile): the running max (the whole warp's), its own partial sum, and
// O^T's (dim 16i + 2g, head) and (dim 16i + 2g + 1, head) in acc[i][nt][c] and [2 + c].
template <int HD, int MG>
struct Fp8WarpTile {
    static constexpr int NT = MG / 8;                      // n-tiles of 8 heads
    static constexpr int SEGS = HD / 16;                   // 16-byte code segments of a row
    static constexpr int SEG_N = SEGS >= 2 ? 2 : 1;        // segments per ldmatrix (x4, or x2 at head_dim 16)
    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "head_dim: a multiple of 16, at most 256");
    static_assert(MG == 8 || MG == 16, "8 or 16 query heads (one or two n-tiles)");

    unsigned qb[NT][SEGS][2];
    float qs;  // the scores' scale, times the power of two Q was scaled down by
    float m[NT][2], l[NT][2], acc[SEGS][NT][4];
    // The P^T exchange: this lane's B fragment (tokens 2t, 2t + 1, 2t + 8, 2t + 9; head g) comes
    // from lanes (2t, g / 2) and (2t + 1, g / 2), the half of their head pair that is g.
    int src_a, src_b;
    unsigned half_sel;

    // Loads Q^T for heads h0 .. h0 + ng - 1 of `row` (lane (g, t): head g (+ 8 per n-tile), dims
    // 16i + 4t + 0..3 of each segment i, the code fragments' order) in f16, and clears the state.
    __device__ __forceinline__ Fp8WarpTile(const bf16_t* __restrict__ q, int row, int n_heads, int h0, int ng,
                                           float qscale, int g, int t) {
        qs = qscale;
        float qf[NT][SEGS][4];
        float amax = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int h = g + 8 * nt;
#pragma unroll
            for (int i = 0; i < SEGS; i++) {
                uint2 v = make_uint2(0, 0);
                if (h < ng)
                    v = *reinterpret_cast<const uint2*>(q + ((long long)row * n_heads + h0 + h) * HD + i * 16 + 4 * t);
                qf[nt][i][0] = __uint_as_float(v.x << 16);
                qf[nt][i][1] = __uint_as_float(v.x & 0xffff0000u);
                qf[nt][i][2] = __uint_as_float(v.y << 16);
                qf[nt][i][3] = __uint_as_float(v.y & 0xffff0000u);
#pragma unroll
                for (int j = 0; j < 4; j++) amax = fmaxf(amax, fabsf(qf[nt][i][j]));
            }
        }
        // Every lane ends with the warp's maximum, so the warp shares one scale.
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float down = 1.f;
        if (amax > 16384.f && amax <= 3.0e38f) {
            int e;
            frexpf(amax, &e);  // amax < 2^e
            down = ldexpf(1.f, 14 - e);
            qs = qscale * ldexpf(1.f, e - 14);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < SEGS; i++) {
                qb[nt][i][0] = pack_f16x2(qf[nt][i][0] * down, qf[nt][i][1] * down);
                qb[nt][i][1] = pack_f16x2(qf[nt][i][2] * down, qf[nt][i][3] * down);
            }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            m[nt][0] = m[nt][1] = NEG_INF;
            l[nt][0] = l[nt][1] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < SEGS; i++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][nt][j] = 0.f;
        src_a = 8 * t + (g >> 1);
        src_b = src_a + 4;
        half_sel = (g & 1) ? 0x7632u : 0x5410u;
    }

    // The ldmatrix address of lane l within 16 code rows of stride rb bytes: row l % 8 of
    // matrix l / 8; matrices alternate the tokens 0-7 and 8-15, two per 16-byte segment.
    static __device__ __forceinline__ unsigned lane_row(int lane, int rb) {
        return (unsigned)(((lane & 7) + ((lane >> 3) & 1) * 8) * rb + (lane >> 4) * 16);
    }

    // Consumes 16 tokens: K and V code rows at the lane's ldmatrix addresses ks and vs
    // (lane_row past the tile's first row), token g at position pt (g + 8 at pt + 8); tokens at
    // or past c1 are masked.
    __device__ __forceinline__ void stage(unsigned ks, unsigned vs, int pt, int c1, float cap2) {
        // S^T = K Q^T over the 16 tokens.
        float sc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int j = 0; j < 4; j++) sc[nt][j] = 0.f;
#pragma unroll
        for (int i0 = 0; i0 < SEGS; i0 += SEG_N) {
            unsigned c[2 * SEG_N];
            ldsm_n<2 * SEG_N, false>(ks + i0 * 16, c);
#pragma unroll
            for (int j = 0; j < SEG_N; j++) {
                unsigned a[4];
                e4m3x4_to_f16x4(c[2 * j], a[0], a[2]);      // token g: k 2t.., 2t+8..
                e4m3x4_to_f16x4(c[2 * j + 1], a[1], a[3]);  // token g + 8
#pragma unroll
                for (int nt = 0; nt < NT; nt++) mma_f16_k16(sc[nt], a, qb[nt][i0 + j][0], qb[nt][i0 + j][1]);
            }
        }
        // Online softmax (log2 domain) per head over the 16 tokens.
        const bool v0 = pt < c1, v1 = pt + 8 < c1;
        unsigned pb[NT][2];
        float corr[NT][2];
        bool moved = false;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float p[4];
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float s0 = v0 ? soft_cap(sc[nt][c] * qs, cap2) : NEG_INF;      // token g
                const float s1 = v1 ? soft_cap(sc[nt][2 + c] * qs, cap2) : NEG_INF;  // token g + 8
                float tm = fmaxf(s0, s1);
                tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 4));
                tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 8));
                tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 16));
                const float mn = fmaxf(m[nt][c], tm);
                // No valid token seen yet by this warp: keep everything at zero.
                const float mu = mn == NEG_INF ? 0.f : mn;
                corr[nt][c] = exp2f(m[nt][c] - mu);
                moved |= corr[nt][c] != 1.f;
                p[c] = exp2f(s0 - mu);
                p[2 + c] = exp2f(s1 - mu);
                l[nt][c] = l[nt][c] * corr[nt][c] + p[c] + p[2 + c];
                m[nt][c] = mn;
            }
            // P^T to B fragments: f16 pairs (heads 2t, 2t + 1) of tokens g and g + 8, gathered.
            const unsigned p_lo = pack_f16x2(p[0], p[1]), p_hi = pack_f16x2(p[2], p[3]);
            const unsigned a_lo = __shfl_sync(0xffffffffu, p_lo, src_a);
            const unsigned a_hi = __shfl_sync(0xffffffffu, p_hi, src_a);
            const unsigned b_lo = __shfl_sync(0xffffffffu, p_lo, src_b);
            const unsigned b_hi = __shfl_sync(0xffffffffu, p_hi, src_b);
            pb[nt][0] = __byte_perm(a_lo, b_lo, half_sel);  // tokens 2t, 2t + 1
            pb[nt][1] = __byte_perm(a_hi, b_hi, half_sel);  // tokens 2t + 8, 2t + 9
        }
        // The rescale is skipped when no head of the warp moved its max (every corr is exactly
        // 1, so the product would be the identity), as after the first tiles it rarely does.
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int i = 0; i < SEGS; i++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[i][nt][j] *= corr[nt][j & 1];
        }
        // O^T += V^T P^T.
#pragma unroll
        for (int i0 = 0; i0 < SEGS; i0 += SEG_N) {
            unsigned c[2 * SEG_N];
            ldsm_n<2 * SEG_N, true>(vs + i0 * 16, c);
#pragma unroll
            for (int j = 0; j < SEG_N; j++) {
                // Bytes (tok 2t: even dim, odd dim; tok 2t+1: even, odd) -> (even: 2t, 2t+1;
                // odd: 2t, 2t+1); a0/a1 from tokens 0-7, a2/a3 from tokens 8-15.
                unsigned a[4];
                e4m3x4_to_f16x4(__byte_perm(c[2 * j], 0u, 0x3120), a[0], a[1]);
                e4m3x4_to_f16x4(__byte_perm(c[2 * j + 1], 0u, 0x3120), a[2], a[3]);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) mma_f16_k16(acc[i0 + j][nt], a, pb[nt][0], pb[nt][1]);
            }
        }
    }

    // The warp's sum of head 8 nt + 2t + c over its lanes (every lane gets it).
    __device__ __forceinline__ float sum(int nt, int c) const {
        float lc = l[nt][c];
        lc += __shfl_xor_sync(0xffffffffu, lc, 4);
        lc += __shfl_xor_sync(0xffffffffu, lc, 8);
        lc += __shfl_xor_sync(0xffffffffu, lc, 16);
        return lc;
    }
};

template <int HD, int NW, int NS, int MG>
__device__ __forceinline__ void paged_attention_tc_fp8_body(
    const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks) {
    static_assert(NS >= 2, "at least double buffering");
    using Tile = Fp8WarpTile<HD, MG>;
    constexpr int THREADS = NW * 32;
    constexpr int TT = tc_warp_tokens(1) * NW;  // tokens per stage (16 per warp)
    constexpr int RB = tc_ring_row(HD, 1);      // ring row stride, bytes (HD codes + 16)
    constexpr int SMEM = tc_smem_bytes(HD, NW, NS, MG, 1);
    using Ring = TcRing<unsigned char, HD, TT, THREADS, RB, NS>;
    static_assert(SMEM >= NS * 2 * Ring::TILE_B && SMEM >= NW * MG * (HD + 2) * 4, "ring and merge fit");
    static_assert(SMEM <= 227 * 1024, "a CTA's shared memory limit");
    unsigned char* const smem = tc_smem_base<SMEM>();

    const TcChunk ck = tc_chunk<HD, MG>(row_ctx, n_heads, n_kv_heads, min_chunk, window, out);
    if (!ck.run) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int c0 = ck.c0, c1 = ck.c1, ng = ck.ng;
    const int n_tiles = (c1 - c0 + TT - 1) / TT;
    Ring ring(smem_addr(smem), k_cache, v_cache, ck.kvh, n_kv_heads, block_size, block_tables + row_bt[ck.row], c0,
              c1, tid);
    // Every warp holds all of the CTA's heads.
    Tile tile(q, ck.row, n_heads, ck.h0, ng, qscale, g, t);

#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < n_tiles) ring.issue(s);
        cp_async_commit();
    }
    // The warp's 16 tokens of each stage.
    const unsigned lrow = (unsigned)(warp * 16 * RB) + Tile::lane_row(lane, RB);
    for (int it = 0; it < n_tiles; it++) {
        cp_async_wait<NS - 2>();
        // Stage `it` is visible to every warp, and every warp is done with the slot that the
        // next copy overwrites (consumed in the previous iteration).
        __syncthreads();
        if (it + NS - 1 < n_tiles) ring.issue((it + NS - 1) % NS);
        cp_async_commit();

        const int s = it % NS;
        tile.stage(ring.sk + (unsigned)(s * Ring::TILE_B) + lrow, ring.sv + (unsigned)(s * Ring::TILE_B) + lrow,
                   c0 + it * TT + warp * 16 + g, c1, cap2);
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reuse it for the merge

    // Merge the warps: each writes its heads' (max, sum, O) and the CTA combines per output.
    float* const sm_o = reinterpret_cast<float*>(smem);  // [NW][MG][HD]
    float* const sm_ml = sm_o + NW * MG * HD;            // [NW][MG][2]
#pragma unroll
    for (int nt = 0; nt < Tile::NT; nt++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float lc = tile.sum(nt, c);
            const int h = 8 * nt + 2 * t + c;
            if (g == 0) {
                sm_ml[(warp * MG + h) * 2] = tile.m[nt][c];
                sm_ml[(warp * MG + h) * 2 + 1] = lc;
            }
#pragma unroll
            for (int i = 0; i < Tile::SEGS; i++) {
                sm_o[(warp * MG + h) * HD + i * 16 + 2 * g] = tile.acc[i][nt][c];
                sm_o[(warp * MG + h) * HD + i * 16 + 2 * g + 1] = tile.acc[i][nt][2 + c];
            }
        }
    }
    __syncthreads();
    tc_merge_write<HD, NW, MG>(sm_o, sm_ml, ng, ck.row, ck.h0, n_heads, ck.split, ck.n_splits, v_scale, sinks, out,
                               part_o, part_ml);
}

// Over an FP8 (E4M3) cache: qscale already holds the K scale; v_scale is the layer's V scale.
#define ATT_TC_FP8_INSTANCE(HD, NW, NS, MG)                                                                        \
    extern "C" __global__ void __launch_bounds__(NW * 32, tc_min_ctas(HD, NW, NS, MG, 1)) paged_attention_tc_fp8_hd##HD##_w##NW##_s##NS##_g##MG( \
        const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache,                                  \
        const unsigned char* __restrict__ v_cache, bf16_t* __restrict__ out, float* __restrict__ part_o,          \
        float* __restrict__ part_ml, const int* __restrict__ row_ctx, const int* __restrict__ row_bt,             \
        const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size, float qscale,          \
        int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks) { PDL_ENTER();     \
        paged_attention_tc_fp8_body<HD, NW, NS, MG>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,   \
                                                    block_tables, n_heads, n_kv_heads, block_size, qscale,        \
                                                    min_chunk, v_scale, window, cap2, sinks);                     \
    }

// The FP8-cache variants (warps, stages of 16 tokens a warp, heads per CTA), in the order of
// ATTN_FP8_VARIANTS.
#define ATT_TC_FP8_VARIANTS(HD)          \
    ATT_TC_FP8_INSTANCE(HD, 2, 3, 8)     \
    ATT_TC_FP8_INSTANCE(HD, 2, 4, 8)     \
    ATT_TC_FP8_INSTANCE(HD, 2, 4, 16)

ATT_TC_FP8_VARIANTS(16)
ATT_TC_FP8_VARIANTS(32)
ATT_TC_FP8_VARIANTS(64)
ATT_TC_FP8_VARIANTS(128)
ATT_TC_FP8_VARIANTS(256)
