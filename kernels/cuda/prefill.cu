// Paged causal flash attention for the prefill chunks of a mixed batch (FA2 structure on the
// tensor cores: mma.sync m16n8k16 bf16 -> f32), GQA, bf16 or FP8 (E4M3) K/V cache.
//
// Grid: (n_kv_heads, work items). A work item is one query tile of one prefill chunk; the CTA
// serves every query head of its KV head's group at once: packed row p of the BM-row tile is
// token p / group of the tile and head p % group of the group, so each K/V tile it loads
// serves all heads (tq = BM / group tokens per tile; packed rows past tq * group, or past
// the chunk's last token, are padding: computed on a clamped copy of a real row and never
// stored). NW warps of 16 packed rows each, BM = 16 * NW: NW = 4 (BM 64, three CTAs per SM at
// HD 128) or NW = 8 (BM 128: half the K/V traffic from L2 per FLOP, one CTA per SM).
//
// Work items are enumerated in-kernel from the per-sequence list the host built in
// StepMeta::set (row_start, n_tokens, start_pos, block-table offset), heaviest sequence
// first; within a sequence, item 0 is its last (longest-context) tile, so the CTAs that
// start first are the longest ones (load balance for the causal triangle).
//
// Loop: KV tiles of BN = 64 tokens from position 0 up to the tile's last position. Tokens
// are gathered through the block table into shared memory with 16-byte cp.async (zero-fill
// past the needed range, so no uninitialized value ever meets the P*V product), two stages:
// tile j+1 is in flight while tile j is consumed. Shared rows are padded by 16 bytes (row
// stride HD + 8 elements), which puts the 8 row addresses of every ldmatrix phase in
// distinct 16-byte bank groups for HD in {16, 32, 64, 128, 256}.
//
// Per KV tile, per warp: S = Q K^T (Q fragments live in registers for the whole loop, K
// fragments by ldmatrix), online softmax in f32 in the log2 domain (the max is taken on raw
// scores, then p = 2^(s * qscale - m * qscale) with one FFMA; qscale = scale * log2(e)),
// P rounded to bf16 in registers and used directly as the A operand of O += P V (V
// fragments by ldmatrix.trans). Only tiles that reach past the tile's first query position
// apply the causal mask. Every real row sees key 0 in tile 0, so the running max is finite
// after the first tile and no row ever divides by zero. Row sums stay per-thread partials
// until the end (one quad reduction). Output: O / l, bf16, in q's layout.
//
// FP8 cache (prefill_attention_fp8_*): the two-stage ring holds the codes (rows of HD + 16
// bytes); after a stage lands, the CTA converts it into one bf16 K/V tile (exact: every E4M3
// value is a bf16 value) and the loop above runs on that tile unchanged. The K scale is folded
// into qscale by the launcher, the V scale into the final 1 / l.
//
// Options (prefill_attention_opt_* and prefill_attention_fp8_opt_*: runtime arguments, as the
// decode kernel's in attention.cu; the plain entries compile them out, OPT = false, because
// the option code costs registers: at head_dim 128 and 4 warps 175 instead of 168, two CTAs
// per SM instead of three, and at 64 a 24-byte stack frame): window > 0: the query
// at position p sees keys [p + 1 - window, p] only; the KV loop starts at the tile holding the
// tile's first query's first key, so no block before the window is read, and keys before a
// row's window are masked. A row may then see no key in a tile (its window starts later), so
// the running max guards against -inf (as the decode kernel does). cap2 > 0: each score is
// soft-capped in the log2 domain (cap2 * tanh(s * qscale / cap2)), then divided by qscale
// again so the running max stays on the kernel's raw scale (tanh is monotonic). sinks
// non-null: head h's sink logit joins the denominator once, at the output.
//
// Block ids are divided with a host-computed magic number (bs_magic = ceil(2^32 / block_size),
// block_size 1 bypassed), exact for position * block_size < 2^32 (the launcher checks): the
// GPU has no integer divider, and a software division per gathered token (8 per thread per
// tile at HD 128) would cost about as many issue slots as the tile's matrix work.

#define PF_BN 64

__device__ __forceinline__ unsigned pf_smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async global->shared copy; when !ok the source is not read and the 16 bytes are zeroed.
__device__ __forceinline__ void pf_cp16(unsigned dst, const void* src, bool ok) {
    const int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void pf_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void pf_ldsm4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void pf_ldsm4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// d += A (16x16 row-major fragment a) * B (16x8 col-major fragment b0, b1), f32 accumulators.
__device__ __forceinline__ void pf_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    // Not volatile: a pure register operation, free for the scheduler to interleave.
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to a bf16 pair (round to nearest even): lo in bits 0..15, hi in 16..31.
__device__ __forceinline__ unsigned pf_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float pf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---- Pieces both prefill kernels share (this file's and prefill_wg.cu's, compiled after it) --

// A CTA's query tile and the thread's two packed rows (g and g + 8 of its warp's 16).
struct PfTile {
    int row_start, t0, nt_here, pos_first;
    int n_kv;         // keys 0 .. the tile's last position
    const int* bt;    // the sequence's block table
    int rpos[2];      // the rows' positions (a padding row copies the tile's last real one)
    long long roff[2];  // the rows' offsets in q and out
    bool rvalid[2];   // whether the row is a real (token, head) of the chunk
};

// Finds this CTA's (sequence, tile) of tq tokens: work items run over the sequences in list
// order (heaviest first), and within a sequence from its last tile down. False past the list
// (the grid never exceeds the item count; defensive only).
template <int HD>
__device__ __forceinline__ bool pf_find_tile(const int* __restrict__ seqs, int n_seqs,
                                             const int* __restrict__ block_tables, int tq, int group, int n_heads,
                                             int kvh, int warp, int g, PfTile& tl) {
    int item = blockIdx.y, s = 0, tile = -1;
    for (; s < n_seqs; s++) {
        const int tiles = (seqs[4 * s + 1] + tq - 1) / tq;
        if (item < tiles) {
            tile = tiles - 1 - item;
            break;
        }
        item -= tiles;
    }
    if (tile < 0) return false;
    const int n_tok = seqs[4 * s + 1], start_pos = seqs[4 * s + 2];
    tl.row_start = seqs[4 * s];
    tl.bt = block_tables + seqs[4 * s + 3];
    tl.t0 = tile * tq;
    tl.nt_here = min(tq, n_tok - tl.t0);
    tl.pos_first = start_pos + tl.t0;
    tl.n_kv = tl.pos_first + tl.nt_here;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int p = warp * 16 + g + 8 * i;
        const int tk = p / group, hg = p - tk * group;
        tl.rvalid[i] = tk < tl.nt_here;
        const int tkc = min(tk, tl.nt_here - 1);
        tl.rpos[i] = tl.pos_first + tkc;
        tl.roff[i] = ((long long)(tl.row_start + tl.t0 + tkc) * n_heads + (long long)kvh * group + hg) * HD;
    }
    return true;
}

// Q as A fragments (mma.sync m16n8k16's, which is also wgmma's register A per warp):
// a0 = row g cols 2t.., a1 = row g+8, a2 = row g cols 2t+8.., a3 = row g+8.
template <int KS>
__device__ __forceinline__ void pf_load_q(const bf16_t* __restrict__ q, const PfTile& tl, int t, unsigned (&qf)[KS][4]) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        const int c = kk * 16 + 2 * t;
        qf[kk][0] = *reinterpret_cast<const unsigned*>(q + tl.roff[0] + c);
        qf[kk][1] = *reinterpret_cast<const unsigned*>(q + tl.roff[1] + c);
        qf[kk][2] = *reinterpret_cast<const unsigned*>(q + tl.roff[0] + c + 8);
        qf[kk][3] = *reinterpret_cast<const unsigned*>(q + tl.roff[1] + c + 8);
    }
}

// The causal mask of the key tile starting at kv0 (only where it reaches past the tile's
// first query position; keys past n_kv - 1 are past every row's position, so they are masked
// here too). sc holds the accumulator layout: column tile n, (row g | g + 8) x (2t, 2t + 1).
template <int NT>
__device__ __forceinline__ void pf_causal_mask(float (&sc)[NT][4], int kv0, const PfTile& tl, int t) {
    if (kv0 + NT * 8 - 1 > tl.pos_first) {
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = kv0 + n * 8 + 2 * t + (e & 1);
                if (key > tl.rpos[e >> 1]) sc[n][e] = NEG_INF;
            }
    }
}

// Online softmax over one key tile: new max per row (quad reduction), O and l rescaled,
// sc := P = 2^(s - m) (log2 domain: the max is taken on raw scores, qscale = scale * log2 e),
// l += the row sums of P (per-thread partials, one quad reduction at the end).
template <int NT, int OT>
__device__ __forceinline__ void pf_softmax_tile(float (&sc)[NT][4], float (&o)[OT][4], float (&m)[2], float (&l)[2],
                                                float qscale) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < NT; n++) {
        mx[0] = fmaxf(mx[0], fmaxf(sc[n][0], sc[n][1]));
        mx[1] = fmaxf(mx[1], fmaxf(sc[n][2], sc[n][3]));
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    float ms[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        // m[i] is -inf before the first tile: exp2(-inf) = 0 and O, l are still 0. With a
        // window a row may have seen no key yet (mx = -inf): subtract 0, every p is 0.
        ms[i] = mx[i] == NEG_INF ? 0.f : mx[i] * qscale;
        corr[i] = pf_exp2(m[i] * qscale - ms[i]);
        m[i] = mx[i];
        l[i] *= corr[i];
    }
#pragma unroll
    for (int n = 0; n < OT; n++) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float pe = pf_exp2(sc[n][e] * qscale - ms[e >> 1]);
            sc[n][e] = pe;
            l[e >> 1] += pe;
        }
}

// The real rows of O times inv (v_scale / l per row) into out, bf16, in q's layout.
template <int OT>
__device__ __forceinline__ void pf_store_out(bf16_t* __restrict__ out, const PfTile& tl, int t, const float (&o)[OT][4],
                                             const float (&inv)[2]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (!tl.rvalid[i]) continue;
        bf16_t* orow = out + tl.roff[i] + 2 * t;
#pragma unroll
        for (int n = 0; n < OT; n++)
            *reinterpret_cast<unsigned*>(orow + n * 8) = pf_pack(o[n][2 * i] * inv[i], o[n][2 * i + 1] * inv[i]);
    }
}

template <int HD, int NW, typename C, bool OPT>
__device__ __forceinline__ void prefill_attention_body(
    const bf16_t* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    bf16_t* __restrict__ out, const int* __restrict__ seqs, int n_seqs, const int* __restrict__ block_tables,
    int n_heads, int n_kv_heads, int block_size, unsigned bs_magic, float qscale, float v_scale, int window,
    float cap2, const float* __restrict__ sinks) {
    constexpr bool FP8 = sizeof(C) == 1;
    if constexpr (!OPT) {
        // Constants: the option code below folds away.
        window = 0;
        cap2 = 0.f;
        sinks = nullptr;
    }
    constexpr int RS = HD + 8;                    // bf16 tile row stride, elements
    constexpr int TILE = PF_BN * RS;              // elements of one bf16 K (or V) tile
    constexpr int RB = FP8 ? HD + 16 : RS * 2;    // ring row stride, bytes
    constexpr int STAGE_B = 2 * PF_BN * RB;       // bytes of one ring stage (K then V)
    constexpr int CPR = HD * (int)sizeof(C) / 16;  // 16-byte chunks per token row
    constexpr int EPC = 16 / (int)sizeof(C);      // elements per chunk
    constexpr int BM = 16 * NW;                   // packed query rows per CTA
    constexpr int TPP = NW * 32 / CPR;            // token rows per load pass
    constexpr int PASSES = (PF_BN + TPP - 1) / TPP;  // load passes per tile (HD 16, NW 8: TPP > BN)
    constexpr int KS = HD / 16;                   // k-steps of Q K^T
    constexpr int NT = PF_BN / 8;                 // 8-key column tiles of S
    constexpr int OT = HD / 8;                    // 8-wide column tiles of O
    static_assert(PF_BN % TPP == 0 || TPP % PF_BN == 0, "tile rows must split evenly over the passes");
    static_assert(NT % 2 == 0 && OT % 2 == 0, "ldmatrix.x4 covers two column tiles");
    extern __shared__ __align__(16) unsigned char pf_smem[];
    // [stage][K, V][PF_BN][RB bytes]; with FP8 then the converted bf16 tile [K, V][PF_BN][RS].
    bf16_t* const conv = reinterpret_cast<bf16_t*>(pf_smem + 2 * STAGE_B);

    const int group = n_heads / n_kv_heads;
    const int tq = BM / group;  // tokens per tile (the launcher guarantees group <= BM)
    const int kvh = blockIdx.x;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    PfTile tl;
    if (!pf_find_tile<HD>(seqs, n_seqs, block_tables, tq, group, n_heads, kvh, warp, g, tl)) return;
    const int* __restrict__ bt = tl.bt;
    const int pos_first = tl.pos_first, n_kv = tl.n_kv;
    const int n_tiles = (n_kv + PF_BN - 1) / PF_BN;
    // With a window, the first tile holding a key the tile's first query sees.
    const int j0 = window > 0 ? max(0, pos_first + 1 - window) / PF_BN : 0;
    const int* rpos = tl.rpos;

    unsigned qf[KS][4];
    pf_load_q<KS>(q, tl, t, qf);

    const long long kv_w = (long long)n_kv_heads * HD;
    const int lc = threadIdx.x % CPR, lr = threadIdx.x / CPR;
    const long long head_off = (long long)kvh * HD + lc * EPC;
    // Gathers KV tile j into stage st: this thread copies chunk lc of rows lr + k * TPP.
    auto load_tile = [&](int j, int st) {
        const unsigned ks = pf_smem_addr(pf_smem + st * STAGE_B);
#pragma unroll
        for (int ps = 0; ps < PASSES; ps++) {
            const int r = lr + ps * TPP;
            if (TPP > PF_BN && r >= PF_BN) break;  // more threads than chunks: the rest idle
            const int p = j * PF_BN + r;
            const bool ok = p < n_kv;
            long long off = head_off;
            if (ok) {
                const int lb = block_size == 1 ? p : (int)__umulhi((unsigned)p, bs_magic);
                off += ((long long)bt[lb] * block_size + (p - lb * block_size)) * kv_w;
            }
            const unsigned d = ks + r * RB + lc * 16;
            pf_cp16(d, k_cache + off, ok);
            pf_cp16(d + PF_BN * RB, v_cache + off, ok);
        }
    };

    float o[OT][4];
#pragma unroll
    for (int n = 0; n < OT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF};  // running max of raw scores
    float l[2] = {0.f, 0.f};          // this thread's partial row sums

    // ldmatrix lane addressing (see the fragment notes above each use).
    const int lm_row = lane & 7, lm_sel = (lane >> 3) & 1, lm_hi = lane >> 4;

    load_tile(j0, j0 & 1);
    pf_commit();
    for (int j = j0; j < n_tiles; j++) {
        const int st = j & 1;
        if (j + 1 < n_tiles) load_tile(j + 1, st ^ 1);
        // Always commit (an empty group when nothing was issued) so wait<1> means "tile j landed".
        pf_commit();
        pf_wait<1>();
        __syncthreads();
        const bf16_t* ks = reinterpret_cast<const bf16_t*>(pf_smem + st * STAGE_B);
        if constexpr (FP8) {
            // Stage st's codes -> the bf16 tile (16 codes a chunk), then every warp reads it.
            const unsigned char* const ring = pf_smem + st * STAGE_B;
            for (int c = threadIdx.x; c < 2 * PF_BN * CPR; c += NW * 32) {
                const int r = c / CPR, col = c - r * CPR;  // r: K rows, then V rows
                uint4 b[2];
                e4m3x16_to_bf16x16(*reinterpret_cast<const uint4*>(ring + r * RB + col * 16), b);
                uint4* dst = reinterpret_cast<uint4*>(conv + r * RS + col * 16);
                dst[0] = b[0];
                dst[1] = b[1];
            }
            __syncthreads();
            ks = conv;
        }
        const bf16_t* vs = ks + TILE;
        const int kv0 = j * PF_BN;

        // S = Q K^T. K is [key][d] in shared memory = the col-major B operand. One ldmatrix.x4
        // covers keys n0..n0+15 x d k0..k0+15: matrices (keys lo, d lo), (keys lo, d hi),
        // (keys hi, d lo), (keys hi, d hi) = b0, b1 of column tile n0/8 and of the next.
        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                unsigned b0, b1, b2, b3;
                pf_ldsm4(pf_smem_addr(ks + (np * 16 + lm_hi * 8 + lm_row) * RS + kk * 16 + lm_sel * 8), b0, b1, b2, b3);
                pf_mma(sc[2 * np], qf[kk], b0, b1);
                pf_mma(sc[2 * np + 1], qf[kk], b2, b3);
            }
        }

        // The soft-cap, before any mask (a masked -inf must stay -inf).
        if (cap2 > 0.f) {
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) sc[n][e] = cap2 * tanhf(sc[n][e] * qscale / cap2) / qscale;
        }

        pf_causal_mask<NT>(sc, kv0, tl, t);

        // Window: keys before a row's window (only in tiles that start before the last row's).
        if (window > 0 && kv0 < n_kv - window) {
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kv0 + n * 8 + 2 * t + (e & 1);
                    if (key <= rpos[e >> 1] - window) sc[n][e] = NEG_INF;
                }
        }

        pf_softmax_tile<NT, OT>(sc, o, m, l, qscale);

        // O += P V. P's accumulator layout of column tiles 2kk and 2kk+1 is exactly the A
        // fragment of key step kk. V is [key][d]: ldmatrix.trans of (keys lo, d lo),
        // (keys hi, d lo), (keys lo, d hi), (keys hi, d hi) = b0, b1 of d tile n and of n+1.
#pragma unroll
        for (int kk = 0; kk < PF_BN / 16; kk++) {
            unsigned a[4];
            a[0] = pf_pack(sc[2 * kk][0], sc[2 * kk][1]);
            a[1] = pf_pack(sc[2 * kk][2], sc[2 * kk][3]);
            a[2] = pf_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            a[3] = pf_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < OT / 2; dp++) {
                unsigned b0, b1, b2, b3;
                pf_ldsm4_t(pf_smem_addr(vs + (kk * 16 + lm_sel * 8 + lm_row) * RS + dp * 16 + lm_hi * 8), b0, b1, b2, b3);
                pf_mma(o[2 * dp], a, b0, b1);
                pf_mma(o[2 * dp + 1], a, b2, b3);
            }
        }
        // Every warp is done with stage st before the next iteration refills it.
        __syncthreads();
    }
    pf_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    if (sinks != nullptr) {
        // The sink's column (log2 domain): the max moves to it when larger (see attention.cu).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int hg = (warp * 16 + g + 8 * i) % group;
            const float sk = sinks[kvh * group + hg] * 1.4426950408889634f;
            const float mr = m[i] * qscale, m2 = fmaxf(mr, sk);
            const float f = pf_exp2(mr - m2);
            l[i] = l[i] * f + pf_exp2(sk - m2);
#pragma unroll
            for (int n = 0; n < OT; n++) {
                o[n][2 * i] *= f;
                o[n][2 * i + 1] *= f;
            }
        }
    }
    const float inv[2] = {v_scale / l[0], v_scale / l[1]};
    pf_store_out<OT>(out, tl, t, o, inv);
}

// Dynamic shared memory: 2 stages x (K + V) x PF_BN x (HD + 8) bf16; the FP8 entry 2 stages x
// (K + V) x PF_BN x (HD + 16) bytes plus one bf16 K + V tile (see prefill.rs). Per (HD, NW):
// the plain entries, then the same with the options (window, soft-cap, sinks; `_opt_`).
#define PF_ENTRIES(HD, NW, OPT, TAG)                                                                           \
    extern "C" __global__ void __launch_bounds__(NW * 32) prefill_attention##TAG##hd##HD##_w##NW(              \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache, \
        bf16_t* __restrict__ out, const int* __restrict__ seqs, int n_seqs, const int* __restrict__ block_tables, \
        int n_heads, int n_kv_heads, int block_size, unsigned bs_magic, float qscale, int window, float cap2,  \
        const float* __restrict__ sinks) { PDL_ENTER();                                                        \
        prefill_attention_body<HD, NW, bf16_t, OPT>(q, k_cache, v_cache, out, seqs, n_seqs, block_tables,      \
                                       n_heads, n_kv_heads, block_size, bs_magic, qscale, 1.f, window, cap2,  \
                                       sinks);                                                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32) prefill_attention_fp8##TAG##hd##HD##_w##NW(          \
        const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache,                               \
        const unsigned char* __restrict__ v_cache, bf16_t* __restrict__ out, const int* __restrict__ seqs,     \
        int n_seqs, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,         \
        unsigned bs_magic, float qscale, float v_scale, int window, float cap2,                                \
        const float* __restrict__ sinks) { PDL_ENTER();                                                        \
        prefill_attention_body<HD, NW, unsigned char, OPT>(q, k_cache, v_cache, out, seqs, n_seqs,             \
                                       block_tables, n_heads, n_kv_heads, block_size, bs_magic, qscale,        \
                                       v_scale, window, cap2, sinks);                                          \
    }
#define PF_INSTANCE(HD, NW) PF_ENTRIES(HD, NW, false, _) PF_ENTRIES(HD, NW, true, _opt_)

// The variants, in the order of PREFILL_HEAD_DIMS x PREFILL_WARPS in kernels/src/cuda/prefill.rs.
PF_INSTANCE(16, 4)
PF_INSTANCE(16, 8)
PF_INSTANCE(32, 4)
PF_INSTANCE(32, 8)
PF_INSTANCE(64, 4)
PF_INSTANCE(64, 8)
PF_INSTANCE(128, 4)
PF_INSTANCE(128, 8)
PF_INSTANCE(256, 4)
PF_INSTANCE(256, 8)
