// The skinny GEMM over FP8 (E4M3) weights (W8A16, decode): out[m][n] = sum_k x[m][k] * w[n][k],
// x bf16 (m x k), w[n][k] = e4m3(codes[n][k]) * scales[n / rb][k / cb] (one f32 per rb x cb
// block: per tensor, per output channel, or 128 x 128), f32 accumulation, bf16 output.
// Reference: kernels/src/cpu/fp8_linear.rs (linear_fp8 with ActivationScale::None). Compiled
// after gemv.cu in modules of its own (gemv_fp8_m8, gemv_fp8_m16: gemv.cu without its instances,
// compile.rs's Family::GemvFp8): it uses that file's loads, mma, epilogues and prefetch.
//
// The scheme is gemv.cu's (weights as the mma A operand, 8 rows of x as B, NW warps splitting k
// in batches of U k-steps, partial sums meeting in shared memory, the first round prefetched
// into L2 before PDL's wait) with the unit changed: a thread's 16-byte load of w now holds 16
// weights (a "chunk"), so a k-step is 64 codes (4 threads x 16) and each chunk feeds 4 mma
// instructions. Fragment trick as in gemv.cu: thread (g, t) of k-step s holds chunk 4s + t
// (codes 16 (4s + t) .. + 15) of w rows g and g + 8 and the same 16 columns of x row g; mma
// i = 0..3 takes their bf16 pairs 2i (as the fragment's k 2t, 2t+1) and 2i + 1 (k 2t+8, 2t+9),
// the same map for A and B, so every product pairs the right x with the right w.
//
// Conversion: fp8x16_to_bf16 (prelude), four integer instructions and one bf16x2 FMA per two
// weights. The cvt-based e4m3x4_to_bf16x4 would cost ~8 conversion-pipe instructions per 4
// codes and cap the kernel near 2 TB/s.
//
// Scales: with one column block over the whole row (per tensor, per channel: cb >= k) the
// row's scale multiplies the sum in the epilogue (BLOCKED false). With column blocks (cb a
// multiple of 64, so a k-step never straddles two), each k-step's products go to fresh
// accumulators that are scaled by their rows' block scales and added (BLOCKED true).
//
// Rows of x: CTA b takes weight tile b / groups (16 rows of w) and x rows 8 NT (b % groups) ..
// + 8 NT - 1; with more rows of x than one CTA's tile (groups > 1) the CTAs sharing a weight
// tile are adjacent in launch order, so the tile is read from HBM once and from L2 after.
// Rows past m read row m - 1 (valid memory) and are never stored; weight rows past n read row
// n - 1 and are never stored. k must be a multiple of 16 (16-byte code rows); a last partial
// batch zeroes the chunks past k on both operands.
//
// Epilogues (ACT, gemv.cu's objects): plain (NoAct), gated (SiluAct, GeluTanhAct: w is
// [gate; up], n the intermediate size, a CTA's tile rows 8 gate and the 8 matching up rows), or
// RoPE + the KV write (RopeAct: the qkv product, a q/k CTA's tile rows a head's rotation pairs).
// The weight rows of a tile come from gemv_act_row, as in gemv.cu, and each sum is multiplied by
// its own row's scale before the epilogue rounds it, as the plain product stores it: the gated
// and RoPE kernels give bit for bit the plain product followed by gated_mul or by rope_kv.cu's
// fused-input kernel, one launch and one round trip of the product's rows fewer. x is bf16 here:
// the norm stays its own kernel before an FP8 product (normalizing on the loads of x cost more
// than the launch it saved; BENCHMARKS.md, session 16).

// d[h] += the 4 mma of one chunk: A rows g (pa) and g + 8 (pb), B = x pairs px.
__device__ __forceinline__ void fp8_chunk_mma(float (*d)[4], const unsigned* pa, const unsigned* pb,
                                              const unsigned* px) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        mma_bf16_16816(d[i & 1], pa[2 * i], pb[2 * i], pa[2 * i + 1], pb[2 * i + 1], px[2 * i], px[2 * i + 1]);
}

// NT: tiles of 8 x rows per CTA. NW: warps (k split). U: k-steps of 64 codes per batch (2 U
// 16-byte weight loads in flight per thread). BLOCKED: column-block scales (see above). ACT: the
// epilogue (see above); n is the output width (the intermediate size for a gated product).
template <int NT, int NW, int U, bool BLOCKED, typename ACT>
__device__ __forceinline__ void gemv_fp8_body(const bf16_t* __restrict__ x, const unsigned char* __restrict__ codes,
                                              const float* __restrict__ scales, bf16_t* __restrict__ out, int m,
                                              int n, int k, int rb, int cb, int groups, const ACT& act = ACT{}) {
    constexpr int BATCH = 4 * U;  // chunks per row per batch
    __shared__ float red[NW][NT * 4][32];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x / groups, m0 = (blockIdx.x - tile * groups) * 8 * NT;
    const int kc = k >> 4, ncb = (k + cb - 1) / cb;
    const auto wrow = [&](int i) -> long long { return gemv_act_row(act, tile, i, n); };
    const long long ra = wrow(g), rb8 = wrow(g + 8);
    const uint4* wa = reinterpret_cast<const uint4*>(codes + ra * k) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(codes + rb8 * k) + t;
    const float* sa = scales + (ra / rb) * ncb;
    const float* sb = scales + (rb8 / rb) * ncb;
    const uint4* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const long long xm = min(m0 + nt * 8 + g, m - 1);
        xr[nt] = reinterpret_cast<const uint4*>(x + xm * k) + 2 * t;
    }

    // The first round (batches 0..NW-1 of the tile's 16 rows), once per tile.
    if (m0 == 0) gemv_prefetch_l2(codes, k, NW * BATCH * 16, wrow);
    // The RoPE kernels let the next kernel (attention) launch only after their k loop, as
    // gemv.cu's fused-norm kernels do. Triggered at their start, Llama-3.1-8B's b = 1 ctx 8k
    // step over FP8 weights and cache took 3.56 ms against 3.37 with the RoPE kernel after the
    // plain product; triggered late, 3.41-3.45 (H200, bench/results/bench-cuda-fp8-pdl-callB-*;
    // the mechanism, as for the bf16 epilogue at that shape, was not isolated).
    constexpr bool late = IsRope<ACT>::value;
    if constexpr (late)
        pdl_wait();
    else
        PDL_ENTER();

    // Two accumulator sets per tile (even and odd mma of a chunk) halve the dependent chain.
    float acc[NT][2][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[nt][h][j] = 0.f;

    const int nb = (kc + BATCH - 1) / BATCH;
    for (int b = warp; b < nb; b += NW) {
        const int c0 = b * BATCH;
        uint4 va[U], vb[U], vx[NT][U][2];
        if (c0 + BATCH <= kc) {
            gemv_ld_w_batch<U>(wa, wb, c0, va, vb);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int u = 0; u < U; u++) {
                    vx[nt][u][0] = gemv_ld_cached(xr[nt] + 2 * (c0 + 4 * u));
                    vx[nt][u][1] = gemv_ld_cached(xr[nt] + 2 * (c0 + 4 * u) + 1);
                }
        } else {
            // The last, partial batch: chunks past k load chunk 0 (valid memory) and are zeroed
            // on both operands, so they add exact zeros.
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = c0 + 4 * u;
                const bool in = c + t < kc;
                const int cc = in ? c : -t;
                va[u] = gemv_ld_stream(wa + cc);
                vb[u] = gemv_ld_stream(wb + cc);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) vx[nt][u][h] = gemv_ld_cached(xr[nt] + 2 * cc + h);
                if (!in) {
                    const uint4 z = make_uint4(0, 0, 0, 0);
                    va[u] = vb[u] = z;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) vx[nt][u][0] = vx[nt][u][1] = z;
                }
            }
        }
        // The column-block scales of this batch's k-steps (a step past k clamps to the last
        // block: its products are zeros).
        float s_a[U], s_b[U];
        if constexpr (BLOCKED) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int blk = min((c0 + 4 * u) * 16 / cb, ncb - 1);
                s_a[u] = sa[blk];
                s_b[u] = sb[blk];
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            unsigned pa[8], pb[8];
            fp8x16_to_bf16(va[u], pa);
            fp8x16_to_bf16(vb[u], pb);
            unsigned px[NT][8];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 lo = vx[nt][u][0], hi = vx[nt][u][1];
                px[nt][0] = lo.x, px[nt][1] = lo.y, px[nt][2] = lo.z, px[nt][3] = lo.w;
                px[nt][4] = hi.x, px[nt][5] = hi.y, px[nt][6] = hi.z, px[nt][7] = hi.w;
            }
            if constexpr (BLOCKED) {
                float part[2][4];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int j = 0; j < 4; j++) part[h][j] = 0.f;
                    fp8_chunk_mma(part, pa, pb, px[nt]);
                    // Accumulators 0, 1 are row g, 2, 3 row g + 8.
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[nt][0][j] += (part[0][j] + part[1][j]) * (j < 2 ? s_a[u] : s_b[u]);
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    fp8_chunk_mma(acc[nt], pa, pb, px[nt]);
            }
        }
    }

    if constexpr (late) pdl_trigger();
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) red[warp][nt * 4 + j][lane] = acc[nt][0][j] + acc[nt][1][j];
    __syncthreads();
    const auto row_scale = [&](int row) { return BLOCKED ? 1.f : scales[(row / rb) * ncb]; };
    if constexpr (IsGated<ACT>::value)
        gemv_epilogue_gated<NT, NW>(red, act, out, m, n, tile, m0, row_scale);
    else if constexpr (IsRope<ACT>::value)
        gemv_epilogue_rope<NT, NW>(red, act, out, m, n, tile, m0, row_scale);
    else
        gemv_epilogue_plain<NT, NW>(red, out, m, n, tile * 16, m0, row_scale);
}

// One instantiation: gemv_fp8_m<MAXM>_w<NW>_u<U>_<row|blk><SUFFIX>, the plain and gated
// products (the same arguments; a gated product's n is the intermediate size).
#define GEMV_FP8_KERNEL(MAXM, NW, U, SCALING, BLOCKED, SUFFIX, ACT)                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemv_fp8_m##MAXM##_w##NW##_u##U##_##SCALING##SUFFIX( \
        const bf16_t* __restrict__ x, const unsigned char* __restrict__ codes, const float* __restrict__ scales,  \
        bf16_t* __restrict__ out, int m, int n, int k, int rb, int cb, int groups) {                           \
        gemv_fp8_body<MAXM / 8, NW, U, BLOCKED, ACT>(x, codes, scales, out, m, n, k, rb, cb, groups);           \
    }

// The RoPE-fused qkv product into a cache of C (gemv.cu's norm_rope arguments, with x and the
// FP8 weights in place of the norm's input and the bf16 weights).
#define GEMV_FP8_KERNEL_ROPE(MAXM, NW, U, SCALING, BLOCKED, SUFFIX, C)                                         \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemv_fp8_m##MAXM##_w##NW##_u##U##_##SCALING##SUFFIX( \
        const bf16_t* __restrict__ x, const unsigned char* __restrict__ codes, const float* __restrict__ scales,  \
        bf16_t* __restrict__ q_out, C* __restrict__ k_cache, C* __restrict__ v_cache,                           \
        const int* __restrict__ positions, const long long* __restrict__ slots,                                 \
        const double* __restrict__ inv_freq, const bf16_t* __restrict__ bias, int n_heads, int n_kv_heads,    \
        int head_dim, float cs_scale, float k_scale, float v_scale, const float* __restrict__ k_shift, int m,   \
        int n, int k, int rb, int cb, int groups) {                                                             \
        const RopeAct<C> act{k_cache, v_cache, positions, slots,  inv_freq, bias, n_heads,                      \
                             n_kv_heads, head_dim, cs_scale, k_scale, v_scale, k_shift};                        \
        gemv_fp8_body<MAXM / 8, NW, U, BLOCKED, RopeAct<C>>(x, codes, scales, q_out, m, n, k, rb, cb, groups,   \
                                                             act);                                              \
    }

// Every epilogue of one scaling, in the order of Fp8Epilogue::ALL (kernels/src/cuda/fp8_linear.rs).
#define GEMV_FP8_EPILOGUES(MAXM, NW, U, SCALING, BLOCKED)                             \
    GEMV_FP8_KERNEL(MAXM, NW, U, SCALING, BLOCKED, , NoAct)                           \
    GEMV_FP8_KERNEL(MAXM, NW, U, SCALING, BLOCKED, _silu, SiluAct)                    \
    GEMV_FP8_KERNEL(MAXM, NW, U, SCALING, BLOCKED, _gelu_tanh, GeluTanhAct)           \
    GEMV_FP8_KERNEL_ROPE(MAXM, NW, U, SCALING, BLOCKED, _rope, bf16_t)                \
    GEMV_FP8_KERNEL_ROPE(MAXM, NW, U, SCALING, BLOCKED, _rope_fp8, unsigned char)

#define GEMV_FP8_INSTANCE(MAXM, NW, U)              \
    GEMV_FP8_EPILOGUES(MAXM, NW, U, row, false)     \
    GEMV_FP8_EPILOGUES(MAXM, NW, U, blk, true)

// The variants (warps, k-steps per batch), in the order of GEMV_FP8_VARIANTS in
// kernels/src/cuda/fp8_linear.rs, for up to 8 and up to 16 rows of x per CTA: one top-level line
// each, a module of its own (as gemv.cu's).
GEMV_FP8_INSTANCE(8, 4, 4)
GEMV_FP8_INSTANCE(8, 8, 4)
GEMV_FP8_INSTANCE(8, 4, 2)
GEMV_FP8_INSTANCE(8, 8, 2)
GEMV_FP8_INSTANCE(16, 4, 4)
GEMV_FP8_INSTANCE(16, 8, 4)
GEMV_FP8_INSTANCE(16, 4, 2)
GEMV_FP8_INSTANCE(16, 8, 2)
