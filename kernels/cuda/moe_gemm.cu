// The grouped expert GEMM for prefill-sized steps with many entries per expert (reference:
// kernels/src/cpu/moe.rs moe_grouped_linear; launcher: kernels/src/cuda/moe.rs,
// MoeExpertKernel::GemmWide). Compiled after moe.cu (same module): it uses moe_smem, moe_cp16,
// moe_ldsm4, moe_mma and moe_warp_incl_scan.
//
// out[p, c] = x[src(p)] . w[e, c] (+ bias[e, c]) as moe_grouped_gemm_bf16 computes it, on
// wider tiles: a CTA of 8 warps computes 64 entries of one expert x 128 columns, each warp
// 32 x 32 (2 x 4 mma.sync m16n8k16 tiles, bf16 -> f32), so each 16-input step loads 4 ldmatrix
// x4 per 8 mma (the 64 x 64 kernel: 5 per 8) and the x tile is re-read half as often. Three
// cp.async stages of 32 inputs (d % 32 == 0) in 46 KB of static shared memory, rows padded to
// 40 elements (conflict-free ldmatrix phases). 64 entries rather than 128: a 2,048-token
// Qwen3-30B-A3B prefill gives each expert 128 +- 11 entries, so 128-entry tiles would run
// half-empty second tiles for half the experts.
//
// Grid (ceil(n / 128), tiles): tile t is found by a warp-parallel scan of the experts' tile
// counts (ceil(count / 64) each; lane l sums experts 8l .. 8l + 7), so finding it costs a few
// shuffles rather than a walk over every expert; a CTA past the last tile returns. Entries
// past the expert's segment and columns past n are zero-filled and never stored.
#define MOE_GW_BM 64
#define MOE_GW_BN 128
#define MOE_GW_BK 32
#define MOE_GW_RS (MOE_GW_BK + 8)
#define MOE_GW_STAGES 3

// Expert and entry range of tile t (tiles of bm entries, experts in index order); false past
// the last tile. Every lane of the calling warp must call it; the result is warp-uniform.
__device__ __forceinline__ bool moe_find_tile(const int* __restrict__ offsets, int n_experts, int t, int bm, int& e,
                                              int& begin, int& end) {
    constexpr int PER = MOE_MAX_EXPERTS / 32;
    const int lane = threadIdx.x & 31;
    int tiles[PER];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int x = lane * PER + i;
        const int c = x < n_experts ? offsets[x + 1] - offsets[x] : 0;
        tiles[i] = (c + bm - 1) / bm;
        sum += tiles[i];
    }
    const int incl = moe_warp_incl_scan(sum);
    // The lane whose experts hold tile t: the first with t < incl.
    const unsigned m = __ballot_sync(0xffffffffu, t < incl);
    if (m == 0) return false;
    const int src = __ffs(m) - 1;
    int found_e = 0, found_t = 0;
    if (lane == src) {
        int rest = t - (incl - sum);
#pragma unroll
        for (int i = 0; i < PER; i++) {
            if (rest >= 0 && rest < tiles[i]) {
                found_e = lane * PER + i;
                found_t = rest;
            }
            rest -= tiles[i];
        }
    }
    e = __shfl_sync(0xffffffffu, found_e, src);
    const int tt = __shfl_sync(0xffffffffu, found_t, src);
    begin = offsets[e] + tt * bm;
    end = offsets[e + 1];
    return true;
}

extern "C" __global__ __launch_bounds__(256, 2) void moe_grouped_gemm_wide_bf16(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts) {
    PDL_ENTER();
    __shared__ __align__(16) bf16_t xs[MOE_GW_STAGES][MOE_GW_BM * MOE_GW_RS];
    __shared__ __align__(16) bf16_t ws[MOE_GW_STAGES][MOE_GW_BN * MOE_GW_RS];
    int e = 0, begin = 0, end = 0;
    if (!moe_find_tile(offsets, n_experts, blockIdx.y, MOE_GW_BM, e, begin, end)) return;
    const int col0 = blockIdx.x * MOE_GW_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // warp tile: entries 32 wm .., columns 32 wn ..
    // Copies per stage: x tile 64 rows x 4 chunks (one a thread), w tile 128 rows x 4 chunks
    // (two a thread); chunk c is row c / 4, inputs 8 (c % 4).
    const int xr = tid >> 2, part = tid & 3;
    const int p = begin + xr;
    const bool xok = p < end;
    const bf16_t* xsrc = x + (xok ? (long long)(per_token ? order[p] / k : p) * d : 0) + part * 8;
    const unsigned xdst = (unsigned)((xr * MOE_GW_RS + part * 8) * 2);
    const bf16_t* wsrc[2];
    bool wok[2];
    unsigned wdst[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = xr + 64 * i;
        const int col = col0 + r;
        wok[i] = col < n;
        wsrc[i] = w + (wok[i] ? ((long long)e * n + col) * d : 0) + part * 8;
        wdst[i] = (unsigned)((r * MOE_GW_RS + part * 8) * 2);
    }
    auto load = [&](int k0, int s) {
        const unsigned xb = moe_smem(xs[s]), wb = moe_smem(ws[s]);
        moe_cp16(xb + xdst, xsrc + k0, xok);
#pragma unroll
        for (int i = 0; i < 2; i++) moe_cp16(wb + wdst[i], wsrc[i] + k0, wok[i]);
    };
    float acc[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[a][j][q] = 0.f;
    const int nk = d / MOE_GW_BK;
    // Prologue: stages 0 .. STAGES - 2 in flight (a commit group each, empty past nk, so the
    // wait count below is the same every iteration).
#pragma unroll
    for (int s = 0; s < MOE_GW_STAGES - 1; s++) {
        if (s < nk) load(s * MOE_GW_BK, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int kt = 0; kt < nk; kt++) {
        // Stage kt has landed (at most STAGES - 2 younger groups still in flight).
        asm volatile("cp.async.wait_group %0;\n" ::"n"(MOE_GW_STAGES - 2));
        __syncthreads();
        // Refill the stage consumed in the previous iteration (every warp passed the barrier
        // above, so none still reads it).
        const int next = kt + MOE_GW_STAGES - 1;
        if (next < nk) load(next * MOE_GW_BK, next % MOE_GW_STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        const int s = kt % MOE_GW_STAGES;
        const unsigned xa = moe_smem(xs[s]), wb = moe_smem(ws[s]);
#pragma unroll
        for (int kk = 0; kk < MOE_GW_BK; kk += 16) {
            // A: entries 32 wm + 16 a + (lane & 15), inputs kk + 8 (lane >> 4).
            unsigned af[2][4];
#pragma unroll
            for (int a = 0; a < 2; a++)
                moe_ldsm4(xa + (unsigned)(((wm * 32 + a * 16 + (lane & 15)) * MOE_GW_RS + kk + (lane >> 4) * 8) * 2),
                          af[a]);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                // B: w rows (columns of out) 32 wn + 16 np + ..., as in moe_grouped_gemm_bf16.
                unsigned b[4];
                moe_ldsm4(wb + (unsigned)(((wn * 32 + np * 16 + (lane >> 4) * 8 + (lane & 7)) * MOE_GW_RS + kk +
                                           ((lane >> 3) & 1) * 8) *
                                          2),
                          b);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    moe_mma(acc[a][2 * np], af[a], b[0], b[1]);
                    moe_mma(acc[a][2 * np + 1], af[a], b[2], b[3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    // Accumulator q of tile (a, j) in lane (g, tq): entry 32 wm + 16 a + g + 8 (q / 2), column
    // 32 wn + 8 j + 2 tq + q % 2; the pair (q, q + 1) is two adjacent columns, one 4-byte store.
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int a = 0; a < 2; a++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int pp = begin + wm * 32 + a * 16 + g + 8 * hh;
            if (pp >= end) continue;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = col0 + wn * 32 + j * 8 + 2 * tq;
                const float b0 = bias && c < n ? bf2f(bias[(long long)e * n + c]) : 0.f;
                const float b1 = bias && c + 1 < n ? bf2f(bias[(long long)e * n + c + 1]) : 0.f;
                const bf16_t v0 = f2bf(acc[a][j][2 * hh] + b0), v1 = f2bf(acc[a][j][2 * hh + 1] + b1);
                bf16_t* o = out + (long long)pp * n + c;
                if (c + 1 < n && (n & 1) == 0) {
                    *reinterpret_cast<unsigned*>(o) = (unsigned)v0 | ((unsigned)v1 << 16);
                } else {
                    if (c < n) o[0] = v0;
                    if (c + 1 < n) o[1] = v1;
                }
            }
        }
    }
}
