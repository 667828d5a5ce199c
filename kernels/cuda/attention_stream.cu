// ---------------------------------------------------------------------------------------------
// Streaming decode attention (`paged_attention_st_*`): the contract of the decode kernels in
// attention.cu (arguments, split_chunk cut here, padding rows, partials for attention_combine),
// a different grid and copy engine. Included after attention.cu (its helpers: smem_addr,
// ldmatrix, tc_mma_*, pack_bf16x2, soft_cap, add_sink, window_start, split_chunk).
//
// Why. The tensor-core kernel (paged_attention_tc_*) gives each CTA one KV head, so a CTA reads
// one 256-byte row out of every 2 KB token slot (Llama-3.1-8B: 8 KV heads x 128 dims), with
// four threads per row issuing 16-byte cp.async copies; ncu at 256 rows x 1k (8dcc311) showed
// 2.53 TB/s of DRAM (75 % of peak) with L2 82 % busy and 6 small CTAs per SM in 2.6 waves. A
// block of the cache, [block_size][n_kv_heads][head_dim], is one contiguous run of memory: here
// one CTA takes every KV head of a row (up to `warps`; more KV heads are split over CTAs) and
// streams the row's blocks with the bulk copy engine (cp.async.bulk, one instruction per token
// row of up to 2 KB, completing on an mbarrier), so the SM issues 32 copies where it issued
// 2,048, every DRAM access is a whole contiguous row, and no register holds a load in flight.
//
// Grid: (n_kv_heads / KVC * group chunks, rows, splits), KVC * 32 threads; KVC (the CTA's KV
// heads, a divisor of n_kv_heads, at most the variant's warps) is blockDim.x / 32. Warp w takes
// KV head kvh0 + w and its query heads (up to MG; a larger GQA group is split over CTAs along
// x, as in the tensor-core kernel) over every token of the chunk, so no cross-warp merge: each
// warp writes its own heads' output or partial.
//
// Ring: NS stages of ST = 16 tokens, K rows then V rows, each row the CTA's KVC heads (KVC *
// HD bf16) padded by 16 bytes so that ldmatrix's 8 rows at one column fall in 8 bank groups.
// Warp 0's lanes each copy one token's K or V row (ST * 2 = 32 lanes); lane 0 first announces
// the stage's bytes on the stage's mbarrier (arrive.expect_tx), every warp waits on its phase.
// A slot is refilled only after a CTA barrier at the top of the next iteration (every warp is
// done with it). Tokens past the chunk (only in its last stage) are not copied: their lanes write
// zeros into their V rows instead, before lane 0 arrives on the stage's barrier (a warp barrier
// orders those stores before its release), so that a zero probability never meets uninitialized
// shared memory that could be NaN; their scores are masked to -inf. Nothing is copied into the
// ring after the last stage, so these ordinary stores never race the copy engine.
//
// Every warp computes its KV head the same way whatever the CTA's KVC and ring depth, so the
// variants (warps, stages) give bit-identical rows for the same split count: the launcher picks
// the variant from the batch without making a row's output depend on the rows beside it.
//
// Products (per warp, per stage of 16 tokens): S (MG x 16) = Q K^T as two m16n8k16 N tiles of
// 8 tokens (K rows by ldmatrix, non-transposed), online softmax per query head over the 16
// scores (a row lives in one quad: two shuffles), O (MG x HD) += P V by m16n8k16 with the 16
// tokens as k (P's A fragment is the two S tiles' accumulators; V by ldmatrix.trans).
//
// Shared memory: NS * 2 * 16 * (KVC * HD * E + 16) bytes (E: 2 for bf16, 1 for FP8 codes) + NS
// mbarriers, all dynamic (the launcher passes `stream_smem_bytes`,
// kernels/src/cuda/paged_attention.rs). Llama-3.1-8B heads (KVC 8, HD 128): 66 KB a bf16 stage,
// 132 KB at 2 stages: one CTA per SM; 33 KB an FP8 stage.
//
// The FP8-cache kernel (`paged_attention_st_fp8_*`) streams code rows the same way and runs one
// Fp8WarpTile (attention_tc_fp8.cu: the 16 tokens of a stage as the mma's M) per warp.
//
// Warp copies (WC, the one-warp variants: one KV head a CTA). A bulk copy costs the copy engine
// about the same time whatever its size (H100: ~55 ns for 256 bytes or 2 KB, session 20), so a
// CTA of one KV head, whose rows are 256 bytes, streamed at ~4.9 GB/s: at one row of the batch
// every split is such a CTA, and the step was 2-7 % slower than with the tensor-core kernel. WC
// rings fill each stage with 16-byte cp.async copies instead (consecutive lanes along a row, a
// commit group a stage; tokens past the chunk zero-filled, K and V alike), into the same padded
// layout, so the products, and the rows they give, are the bulk-copy ring's bit for bit.
//
// The body needs sm_90 (the bulk copy engine); other targets get an entry that traps, which the
// launcher never selects (CudaDevice::stream_attention_capable).
// ---------------------------------------------------------------------------------------------

// Tokens a stage.
#define ST_TOKENS 16

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// One arrival that also raises the phase's expected transaction bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "ST_WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra ST_WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Global -> shared bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned),
// counted on `bar`'s transaction bytes when it lands.
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// The factor that normalizes a finished softmax state (max mx, sum L) of query head h for one
// split: the sink (if any) joins the denominator here; `scale` multiplies the output (an FP8
// cache's V scale, 1 for bf16).
__device__ __forceinline__ float st_norm(const float* __restrict__ sinks, int h, float mx, float L, float scale) {
    float f = 1.f;
    add_sink(sinks, h, mx, L, f);
    return f * scale / L;
}

// Two adjacent outputs (i even) as one bf16 pair.
__device__ __forceinline__ void st_out2(bf16_t* __restrict__ out, long long i, float a, float b) {
    *reinterpret_cast<unsigned*>(out + i) = pack_bf16x2(a, b);
}

// Two adjacent partial outputs (i even).
__device__ __forceinline__ void st_part2(float* __restrict__ part_o, long long i, float a, float b) {
    *reinterpret_cast<float2*>(part_o + i) = make_float2(a, b);
}

// The CTA's share of a row and its ring, shared by the bf16 and FP8 streaming kernels: the grid
// mapping (KV heads, query-head chunk, row, split), the chunk [c0, c1) of the row's context,
// the ring of NS stages of ST tokens (K rows then V rows of KVC heads of C, rows padded
// by 16 bytes) with one mbarrier a stage, and warp 0's copy state. `run` is false when the CTA
// has nothing to do: a padding row (whose zeros the first split writes here) or a split past the
// row's context.
template <typename C, int HD, int NS, int MG, bool WC>
struct StRing {
    static constexpr int ST = ST_TOKENS;
    int kvh0, gc, ng, group, row, split, n_splits, c0, c1, n_tiles;
    int row_b, rb, tile_b;
    unsigned ring, bars;
    bool run;
    // Warp 0's copy state: lane l copies token l % 16 of each stage, its K row (l < 16) or V
    // row; the block id of its token in the next stage is read one stage ahead.
    const C* src;
    const C* ksrc;  // WC: this CTA's KV head in the K and V caches
    const C* vsrc;
    const int* bt;
    long long kv_w;
    int block_size, cp, clb, coff, cblk, ctok;
    bool cv;

    __device__ __forceinline__ StRing(unsigned char* smem, const C* __restrict__ k_cache,
                                      const C* __restrict__ v_cache, bf16_t* __restrict__ out,
                                      const int* __restrict__ row_ctx, const int* __restrict__ row_bt,
                                      const int* __restrict__ block_tables, int n_heads, int n_kv_heads,
                                      int block_size_, int min_chunk, int window) {
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
        const int kvc = blockDim.x >> 5;
        group = n_heads / n_kv_heads;
        const int gchunks = (group + MG - 1) / MG;
        const int cta_heads = blockIdx.x / gchunks;
        gc = blockIdx.x - cta_heads * gchunks;
        kvh0 = cta_heads * kvc;
        ng = min(MG, group - gc * MG);
        row = blockIdx.y;
        split = blockIdx.z;
        n_splits = gridDim.z;
        run = false;
        const int ctx = row_ctx[row];
        if (ctx <= 0) {
            // A padding row: zeros, so that nothing downstream reads uninitialized memory.
            if (split == 0) {
                for (int i = tid; i < kvc * ng * HD; i += blockDim.x) {
                    const int w = i / (ng * HD), r = (i / HD) % ng;
                    out[((long long)row * n_heads + (kvh0 + w) * group + gc * MG + r) * HD + i % HD] = f2bf(0.f);
                }
            }
            return;
        }
        const int lo = window_start(ctx, window);
        const int chunk = split_chunk(ctx - lo, n_splits, min_chunk);
        c0 = lo + split * chunk;
        c1 = min(ctx, c0 + chunk);
        if (c0 >= c1) return;  // a split past the row's context: the combine never reads it
        run = true;
        n_tiles = (c1 - c0 + ST - 1) / ST;
        row_b = kvc * HD * (int)sizeof(C);
        rb = row_b + 16;
        tile_b = ST * rb;
        ring = smem_addr(smem);
        bars = ring + (unsigned)(NS * 2 * tile_b);  // 16-byte aligned: tile_b is

        // The barriers, visible to the copy engine before any copy names them.
        if (!WC && tid == 0) {
#pragma unroll
            for (int s = 0; s < NS; s++) mbar_init(bars + 8 * s, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();

        ctok = lane % ST;
        cv = lane >= ST;
        bt = block_tables + row_bt[row];
        kv_w = (long long)n_kv_heads * HD;
        src = (cv ? v_cache : k_cache) + (long long)kvh0 * HD;
        ksrc = k_cache + (long long)kvh0 * HD;
        vsrc = v_cache + (long long)kvh0 * HD;
        block_size = block_size_;
        cp = c0 + ctok;
        clb = cp / block_size;
        coff = cp - clb * block_size;
        cblk = (warp == 0 && cp < c1) ? bt[clb] : 0;
        if (warp == 0) {
            for (int j = 0; j < NS - 1 && j < n_tiles; j++) issue(j, lane);
            // WC: NS - 1 commit groups whatever the chunk's length, so that next()'s wait counts
            // right (empty groups complete at once).
            if constexpr (WC)
                for (int j = n_tiles; j < NS - 1; j++) cp_async_commit();
        }
    }

    // WC: stage j's rows by 16-byte copies into ring slot j % NS, one commit group. Chunk c of
    // the stage (32 rows: 16 K then 16 V, CPR chunks a row) is copied by lane c % 32, so a warp
    // instruction reads whole rows; each lane's token slot (lane % 16) is shuffled to the lanes
    // copying that token's rows. Tokens past the chunk read nothing and land as zeros.
    __device__ __forceinline__ void issue_warp(int j, int lane) {
        constexpr int CPR = HD * (int)sizeof(C) / 16;
        constexpr int EPC = 16 / (int)sizeof(C);
        const unsigned dst0 = ring + (unsigned)((j % NS) * 2 * tile_b);
        const int my_slot = cp < c1 ? cblk * block_size + coff : -1;
#pragma unroll
        for (int i = 0; i < CPR; i++) {
            const int c = i * 32 + lane, r = c / CPR, col = c - (c / CPR) * CPR;
            const int tok = r & (ST - 1);
            const bool v = r >= ST;
            const int slot = __shfl_sync(0xffffffffu, my_slot, tok);
            const C* from = (v ? vsrc : ksrc) + (long long)max(slot, 0) * kv_w + col * EPC;
            cp_async16(dst0 + (unsigned)((v ? tile_b : 0) + tok * rb + col * 16), from, slot >= 0 ? 16 : 0);
        }
        cp_async_commit();
    }

    // Warp 0: copies stage j (the next one in order) into ring slot j % NS; the lanes of tokens
    // past the chunk zero their V rows first (see the header).
    __device__ __forceinline__ void issue(int j, int lane) {
        if constexpr (WC) {
            issue_warp(j, lane);
            advance();
            return;
        }
        const int s = j % NS;
        const unsigned bar = bars + 8 * s;
        const unsigned dst = ring + (unsigned)(s * 2 * tile_b + (cv ? tile_b : 0) + ctok * rb);
        if (cp >= c1 && cv) {
            for (int b = 0; b < row_b; b += 16)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst + b), "r"(0u) : "memory");
        }
        __syncwarp();
        if (lane == 0) mbar_arrive_expect_tx(bar, (unsigned)(2 * min(ST, c1 - (c0 + j * ST)) * row_b));
        __syncwarp();
        if (cp < c1) bulk_copy_g2s(dst, src + ((long long)cblk * block_size + coff) * kv_w, (unsigned)row_b, bar);
        advance();
    }

    // This lane's token moves one stage on: its position, block and block id.
    __device__ __forceinline__ void advance() {
        cp += ST;
        coff += ST;
        while (coff >= block_size) {
            coff -= block_size;
            clb++;
        }
        cblk = cp < c1 ? bt[clb] : 0;
    }

    // The top of iteration it: once every warp is done with the slot the next copy overwrites
    // (consumed in iteration it - 1), warp 0 refills it; then waits for stage it. Returns the
    // stage's K rows (its V rows are tile_b further).
    __device__ __forceinline__ unsigned next(int it, int warp, int lane) {
        __syncthreads();
        if (warp == 0 && it + NS - 1 < n_tiles) issue(it + NS - 1, lane);
        const int s = it % NS;
        if constexpr (WC) {
            // One group a call (empty past the last stage): stage it is group it, and NS - 1
            // groups were committed after it.
            if (it + NS - 1 >= n_tiles) cp_async_commit();
            cp_async_wait<NS - 1>();
            __syncwarp();
        } else {
            mbar_wait(bars + 8 * s, (unsigned)((it / NS) & 1));
        }
        return ring + (unsigned)(s * 2 * tile_b);
    }

    // First query head of warp w (its KV head kvh0 + w, this CTA's chunk of the group).
    __device__ __forceinline__ int head0(int w) const { return (kvh0 + w) * group + gc * MG; }
};

// One warp's query heads over its KV head in the bf16 streaming kernel: Q as A fragments, the
// running softmax state, the products of one stage of 16 tokens, and the finished output or
// partial.
template <int HD, int MG>
struct StBf16Warp {
    static constexpr int RH = MG / 8;  // accumulator row halves per thread (g, g + 8)
    unsigned qa[HD / 16][2 * RH];
    float m[RH], l[RH], acc[HD / 8][2 * RH];
    // ldmatrix lane addresses within a stage, bytes: K (non-transposed, 8 tokens x 8 dims per
    // matrix): lane l gives token l % 8 at dims (l / 8) * 8; V (transposed, 16 tokens as k):
    // lane l gives token (l % 8) + 8 * ((l / 8) % 2) at dims (l / 16) * 8.
    unsigned lk, lk2, lv;

    __device__ __forceinline__ StBf16Warp(int warp, int lane, int rb) {
        const unsigned head_b = (unsigned)(warp * HD * 2);
        lk = (unsigned)((lane & 7) * rb + (lane >> 3) * 16) + head_b;
        lk2 = (unsigned)((lane & 7) * rb + ((lane >> 3) & 1) * 16) + head_b;
        lv = (unsigned)(((lane & 7) + ((lane >> 3) & 1) * 8) * rb + (lane >> 4) * 16) + head_b;
    }

    // Loads Q for query heads h0 .. h0 + ng - 1 of `row` and clears the softmax state.
    __device__ __forceinline__ void start(const bf16_t* __restrict__ q, int row, int n_heads, int h0, int ng, int g,
                                          int t) {
        tc_load_q<HD, MG>(q, row, n_heads, h0, ng, g, t, qa);
        tc_clear_state<HD, RH>(m, l, acc);
    }

    // Consumes one stage: K rows at ks, V rows at vs (row stride rb bytes); pt is the position
    // of this lane's first token (the stage's first + 2t); tokens at or past c1 are masked.
    __device__ __forceinline__ void stage(unsigned ks, unsigned vs, int rb, int pt, int c1, float qscale, float cap2) {
        // S = Q K^T: two N tiles of 8 tokens.
        float sc[2][2 * RH];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int i = 0; i < 2 * RH; i++) sc[nt][i] = 0.f;
            const unsigned kt = ks + (unsigned)(nt * 8 * rb);
            if constexpr (HD >= 32) {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk += 2) {
                    unsigned b[4];
                    ldsm_x4(kt + lk + kk * 32, b);
                    tc_mma_k16<MG>(sc[nt], qa[kk], b[0], b[1]);
                    tc_mma_k16<MG>(sc[nt], qa[kk + 1], b[2], b[3]);
                }
            } else {
                unsigned b[2];
                ldsm_x2(kt + lk2, b);
                tc_mma_k16<MG>(sc[nt], qa[0], b[0], b[1]);
            }
        }
        // Online softmax (log2 domain) per query head over the 16 tokens; a head lives in one
        // quad. P goes straight into the A fragment of the P V product (k = the 16 tokens).
        unsigned pa[2 * RH];
        float corr[RH];
#pragma unroll
        for (int h = 0; h < RH; h++) {
            float sv[4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                sv[2 * nt] = pt + 8 * nt < c1 ? soft_cap(sc[nt][2 * h] * qscale, cap2) : NEG_INF;
                sv[2 * nt + 1] = pt + 8 * nt + 1 < c1 ? soft_cap(sc[nt][2 * h + 1] * qscale, cap2) : NEG_INF;
            }
            float tm = fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3]));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
            const float mn = fmaxf(m[h], tm);
            // No valid token seen yet by this quad: keep everything at zero.
            const float mu = mn == NEG_INF ? 0.f : mn;
            corr[h] = exp2f(m[h] - mu);
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; i++) p[i] = exp2f(sv[i] - mu);
            l[h] = l[h] * corr[h] + (p[0] + p[1]) + (p[2] + p[3]);
            m[h] = mn;
            // A fragment order: a0 (row g, k 2t), a1 (row g+8, k 2t), a2 (row g, k 2t+8),
            // a3 (row g+8, k 2t+8); with MG = 8 only a0, a2 (tc_mma_k16 supplies the rest).
            pa[h] = pack_bf16x2(p[0], p[1]);
            pa[RH + h] = pack_bf16x2(p[2], p[3]);
        }
        // The rescale is skipped when no head of the warp moved its max (every corr is exactly
        // 1, so the product would be the identity), as after the first tiles it rarely does.
        bool moved = false;
#pragma unroll
        for (int h = 0; h < RH; h++) moved |= corr[h] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int j = 0; j < HD / 8; j++)
#pragma unroll
                for (int i = 0; i < 2 * RH; i++) acc[j][i] *= corr[i / 2];
        }
        // O += P V: the 16 tokens are k, head dims n (two N tiles of 8 per ldmatrix.x4).
#pragma unroll
        for (int nb = 0; nb < HD / 16; nb++) {
            unsigned b[4];
            ldsm_x4_t(vs + lv + nb * 32, b);
            tc_mma_k16<MG>(acc[2 * nb], pa, b[0], b[1]);
            tc_mma_k16<MG>(acc[2 * nb + 1], pa, b[2], b[3]);
        }
    }

    // The warp saw every token of its chunk (at least one valid), so its max is finite: writes
    // the normalized output (one split; the sink joins the softmax here) or split `split`'s
    // partial.
    __device__ __forceinline__ void finish(bf16_t* __restrict__ out, float* __restrict__ part_o,
                                           float* __restrict__ part_ml, int row, int n_heads, int h0, int ng,
                                           int n_splits, int split, const float* __restrict__ sinks, int g, int t) {
#pragma unroll
        for (int h = 0; h < RH; h++) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
            const int r = g + 8 * h;
            if (r >= ng) continue;
            const long long rh = (long long)row * n_heads + h0 + r;
            if (n_splits == 1) {
                const float norm = st_norm(sinks, h0 + r, m[h], l[h], 1.f);
#pragma unroll
                for (int j = 0; j < HD / 8; j++)
                    st_out2(out, rh * HD + j * 8 + 2 * t, acc[j][2 * h] * norm, acc[j][2 * h + 1] * norm);
            } else {
                const long long ps = rh * n_splits + split;
#pragma unroll
                for (int j = 0; j < HD / 8; j++)
                    st_part2(part_o, ps * HD + j * 8 + 2 * t, acc[j][2 * h], acc[j][2 * h + 1]);
                if (t == 0) {
                    part_ml[ps * 2] = m[h];
                    part_ml[ps * 2 + 1] = l[h];
                }
            }
        }
    }
};

// The FP8 kernel's end of a chunk: lane (g, t) writes heads
// 8 nt + 2t + c, dims 16i + 2g and + 1, normalized (one split; the sink joins the softmax here)
// or as split `split`'s partial; v_scale multiplies either.
template <int HD, int MG>
__device__ __forceinline__ void st_fp8_finish(const Fp8WarpTile<HD, MG>& tile, bf16_t* __restrict__ out,
                                              float* __restrict__ part_o, float* __restrict__ part_ml, int row,
                                              int n_heads, int h0, int ng, int n_splits, int split,
                                              const float* __restrict__ sinks, float v_scale, int g, int t) {
    using Tile = Fp8WarpTile<HD, MG>;
#pragma unroll
    for (int nt = 0; nt < Tile::NT; nt++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float lc = tile.sum(nt, c);
            const int h = 8 * nt + 2 * t + c;
            if (h >= ng) continue;
            const long long rh = (long long)row * n_heads + h0 + h;
            if (n_splits == 1) {
                const float norm = st_norm(sinks, h0 + h, tile.m[nt][c], lc, v_scale);
#pragma unroll
                for (int i = 0; i < Tile::SEGS; i++)
                    st_out2(out, rh * HD + i * 16 + 2 * g, tile.acc[i][nt][c] * norm, tile.acc[i][nt][2 + c] * norm);
            } else {
                const long long ps = rh * n_splits + split;
#pragma unroll
                for (int i = 0; i < Tile::SEGS; i++)
                    st_part2(part_o, ps * HD + i * 16 + 2 * g, tile.acc[i][nt][c] * v_scale,
                             tile.acc[i][nt][2 + c] * v_scale);
                if (g == 0) {
                    part_ml[ps * 2] = tile.m[nt][c];
                    part_ml[ps * 2 + 1] = lc;
                }
            }
        }
    }
}

template <int HD, int NS, int MG, bool WC>
__device__ __forceinline__ void paged_attention_st_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, int window, float cap2, const float* __restrict__ sinks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "head_dim: a multiple of 16, at most 256");
    static_assert(MG == 8 || MG == 16, "8 or 16 query heads a warp (the mma's M rows)");
    static_assert(NS >= 2, "at least double buffering");
    extern __shared__ __align__(16) unsigned char st_smem[];
    StRing<bf16_t, HD, NS, MG, WC> ring(st_smem, k_cache, v_cache, out, row_ctx, row_bt, block_tables, n_heads,
                                    n_kv_heads, block_size, min_chunk, window);
    if (!ring.run) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int h0 = ring.head0(warp);
    StBf16Warp<HD, MG> w(warp, lane, ring.rb);
    w.start(q, ring.row, n_heads, h0, ring.ng, g, t);
    for (int it = 0; it < ring.n_tiles; it++) {
        const unsigned ks = ring.next(it, warp, lane);
        w.stage(ks, ks + (unsigned)ring.tile_b, ring.rb, ring.c0 + it * ST_TOKENS + 2 * t, ring.c1, qscale, cap2);
    }
    w.finish(out, part_o, part_ml, ring.row, n_heads, h0, ring.ng, ring.n_splits, ring.split, sinks, g, t);
#else
    __trap();
#endif
}

// The FP8-cache streaming kernel: the ring above over code rows (KVC * HD bytes a token), each
// warp one Fp8WarpTile (attention_tc_fp8.cu: tokens as M, the 16 tokens of a stage) for its KV
// head. qscale already holds the K scale; v_scale multiplies the output (or the partial).
template <int HD, int NS, int MG, bool WC>
__device__ __forceinline__ void paged_attention_st_fp8_body(
    const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(NS >= 2, "at least double buffering");
    using Tile = Fp8WarpTile<HD, MG>;
    extern __shared__ __align__(16) unsigned char st_smem[];
    StRing<unsigned char, HD, NS, MG, WC> ring(st_smem, k_cache, v_cache, out, row_ctx, row_bt, block_tables, n_heads,
                                           n_kv_heads, block_size, min_chunk, window);
    if (!ring.run) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int h0 = ring.head0(warp);
    Tile tile(q, ring.row, n_heads, h0, ring.ng, qscale, g, t);
    const unsigned lrow = (unsigned)(warp * HD) + Tile::lane_row(lane, ring.rb);
    for (int it = 0; it < ring.n_tiles; it++) {
        const unsigned ks = ring.next(it, warp, lane);
        tile.stage(ks + lrow, ks + (unsigned)ring.tile_b + lrow, ring.c0 + it * ST_TOKENS + g, ring.c1, cap2);
    }
    // As the bf16 kernel: every warp saw a valid token.
    st_fp8_finish<HD, MG>(tile, out, part_o, part_ml, ring.row, n_heads, h0, ring.ng, ring.n_splits, ring.split, sinks,
                          v_scale, g, t);
#else
    __trap();
#endif
}

#define ATT_ST_INSTANCE(HD, NW, NS, MG)                                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, 1) paged_attention_st_hd##HD##_w##NW##_s##NS##_g##MG(    \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                        \
        const int* __restrict__ row_ctx, const int* __restrict__ row_bt, const int* __restrict__ block_tables,    \
        int n_heads, int n_kv_heads, int block_size, float qscale, int min_chunk, int window, float cap2,          \
        const float* __restrict__ sinks) { PDL_ENTER();                                                           \
        paged_attention_st_body<HD, NS, MG, NW == 1>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx,         \
                                                     row_bt, block_tables, n_heads, n_kv_heads, block_size,       \
                                                     qscale, min_chunk, window, cap2, sinks);                     \
    }

// Over an FP8 (E4M3) cache: the FP8 tensor-core kernel's arguments (qscale holds the K scale).
#define ATT_ST_FP8_INSTANCE(HD, NW, NS, MG)                                                                        \
    extern "C" __global__ void __launch_bounds__(NW * 32, 1) paged_attention_st_fp8_hd##HD##_w##NW##_s##NS##_g##MG( \
        const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache,                                  \
        const unsigned char* __restrict__ v_cache, bf16_t* __restrict__ out, float* __restrict__ part_o,          \
        float* __restrict__ part_ml, const int* __restrict__ row_ctx, const int* __restrict__ row_bt,             \
        const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size, float qscale,          \
        int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks) { PDL_ENTER();     \
        paged_attention_st_fp8_body<HD, NS, MG, NW == 1>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx,     \
                                                         row_bt, block_tables, n_heads, n_kv_heads, block_size,   \
                                                         qscale, min_chunk, v_scale, window, cap2, sinks);        \
    }

// The streaming variants (most KV heads a CTA = warps, ring stages, query heads a warp; one warp:
// the ring of 16-byte copies, see WC in the header), in the
// order they follow the tensor-core variants in ATTN_VARIANTS, then the FP8 ones in the order
// they follow the tensor-core ones in ATTN_FP8_VARIANTS.
#define ATT_ST_VARIANTS(HD)          \
    ATT_ST_INSTANCE(HD, 8, 3, 8)     \
    ATT_ST_INSTANCE(HD, 8, 2, 8)     \
    ATT_ST_INSTANCE(HD, 4, 3, 8)     \
    ATT_ST_INSTANCE(HD, 8, 2, 16)    \
    ATT_ST_INSTANCE(HD, 1, 4, 8)     \
    ATT_ST_FP8_INSTANCE(HD, 8, 3, 8) \
    ATT_ST_FP8_INSTANCE(HD, 8, 6, 8) \
    ATT_ST_FP8_INSTANCE(HD, 4, 4, 8) \
    ATT_ST_FP8_INSTANCE(HD, 8, 3, 16) \
    ATT_ST_FP8_INSTANCE(HD, 1, 4, 8)

ATT_ST_VARIANTS(16)
ATT_ST_VARIANTS(32)
ATT_ST_VARIANTS(64)
ATT_ST_VARIANTS(128)
ATT_ST_VARIANTS(256)
