// The grouped expert product for decode-sized steps (few entries per expert) on the tensor
// cores, launched over the experts in use only, optionally with the gated activation fused
// into its epilogue (reference: kernels/src/cpu/moe.rs; launcher: kernels/src/cuda/moe.rs).
// Compiled after moe.cu (same module): it uses moe_clamped_swiglu, and SiluAct from
// elementwise.cu.
//
// Grid (column tiles, min(n_experts, assignments)): CTA y takes the y-th expert that has
// entries (moe_active_expert, a warp scan of the permutation's offsets), so a decode step of
// one token at top-8 launches 8 columns of CTAs instead of one per expert; the grid's height
// is a bound the host knows without reading the routing, so the launch records into a CUDA
// graph. CTAs past the last expert in use return at once.
//
// The product is gemv.cu's skinny GEMM applied to one expert: mma.sync m16n8k16 with 16
// weight rows as the A operand and 8 of the expert's entries (rows of x, gathered through
// order when per_token) as B, the NW warps splitting the input dimension in batches of U
// k-steps of 32 (2·U 16-byte weight loads in flight per thread, streamed past L1), partial
// sums meeting in shared memory. An expert with more than 8 entries repeats the product per
// 8 (its weights then come from L2). Entries past the expert's segment read its last entry's
// row (valid memory) and are never stored.
//
// ACT picks the 16 weight rows of a CTA and its epilogue:
// - MOE_ACT_NONE: rows c0 .. c0 + 15, out[p, c] = bf16(sum + bias[e, c]) (16 columns a CTA);
// - MOE_ACT_SILU: gate rows c0 .. c0 + 7 and up rows I + c0 .. (w is [gate | up], I = n / 2);
// - MOE_ACT_SWIGLU: gate rows 2c, up rows 2c + 1 (gpt-oss's interleaved columns);
// - MOE_ACT_UNPERMUTE: as MOE_ACT_NONE, then the un-permute of its 16 columns fused in (below);
// - MOE_ACT_UNPERMUTE_RESID: as MOE_ACT_UNPERMUTE, the un-permuted rows added to the f32
//   residual stream with their sums of squares (gemv.cu's residual epilogue), not stored;
// the fused epilogue rounds gate and up to bf16 exactly as MOE_ACT_NONE stores them (same sum
// order over the warps, same bias add), then applies the activation kernels' formula, so its
// output is bit-identical to the unfused product followed by silu_mul_bf16 /
// clamped_swiglu_bf16 (8 output columns a CTA, out is entries x I).

#define MOE_ACT_NONE 0
#define MOE_ACT_SILU 1
#define MOE_ACT_SWIGLU 2
#define MOE_ACT_UNPERMUTE 3
#define MOE_ACT_UNPERMUTE_RESID 4
#define MOE_SK_WARPS 4

// The y-th expert, in index order, with at least one entry: its id and segment. Every lane of
// the calling warp must call it (ballots); the result is warp-uniform. Lane l reads experts
// l, l + 32, ... (at most MOE_MAX_EXPERTS / 32 pairs of offsets, all loads independent).
__device__ __forceinline__ bool moe_active_expert(const int* __restrict__ offsets, int n_experts, int y, int& e,
                                                  int& begin, int& end) {
    const int lane = threadIdx.x & 31;
    bool found = false;
#pragma unroll
    for (int t = 0; t < MOE_PER_LANE; t++) {
        const int x = lane + 32 * t;
        const int b0 = x < n_experts ? offsets[x] : 0;
        const int b1 = x < n_experts ? offsets[x + 1] : 0;
        const unsigned m = __ballot_sync(0xffffffffu, b1 > b0);
        const int c = __popc(m);
        if (!found) {
            if (y < c) {
                const bool mine = ((m >> lane) & 1u) && __popc(m & ((1u << lane) - 1u)) == y;
                const int src = __ffs(__ballot_sync(0xffffffffu, mine)) - 1;
                e = 32 * t + src;
                begin = __shfl_sync(0xffffffffu, b0, src);
                end = __shfl_sync(0xffffffffu, b1, src);
                found = true;
            } else {
                y -= c;
            }
        }
    }
    return found;
}

__device__ __forceinline__ uint4 moe_ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The fused un-permute of the down product (MOE_ACT_UNPERMUTE), for decode-sized steps: the
// CTAs of one column tile (blockIdx.x: 16 output columns, every expert in use) each store
// their entries' bf16 outputs to y as the plain product does, then arrive on the tile's counter
// (counters[blockIdx.x], release: a fence after the stores); the last of the gridDim.y CTAs to
// arrive (inactive ones arrive too) reads the tile back through L2 and writes
// final[r, c] = bf16(moe_unpermute_at(...)) for every token row r and its 16 columns, so the
// un-permute launch disappears and the result is bit-identical to moe_unpermute_bf16 after the
// plain product (same stored y, same helper). It leaves the counter at zero for the next
// launch (CUDA graph replays). Every thread of the CTA calls it (barriers).
//
// With RESID (MOE_ACT_UNPERMUTE_RESID) the tile's rows are not stored: res[r, c] += bf16 of
// the same sum, and stats[r][tile] = the sum over the tile's 16 columns of the new residual
// squared (0 past n), as gemv.cu's gemv_epilogue_resid leaves them for a norm-input product
// (the same formulas, the columns summed in the same order, gridDim.x = n / 16 parts), so the
// next layer's RMSNorm needs no launch of its own. rows <= 16 (MOE_ROUTER_MAX_ROWS).
template <bool RESID>
__device__ __forceinline__ void moe_unpermute_tile(const bf16_t* y, int n, const int* __restrict__ position,
                                                   const float* __restrict__ weights, int k, int rows,
                                                   bf16_t* __restrict__ final_out, float* __restrict__ res,
                                                   float* __restrict__ stats, unsigned* counters) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    // Acquire: the other CTAs' stores to y, fenced before their arrivals, are visible now.
    __threadfence();
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
    const int c0 = blockIdx.x * 16;
    if constexpr (RESID) {
        __shared__ float sq[16][16];  // [column of the tile][row]
        for (int i = threadIdx.x; i < rows * 16; i += blockDim.x) {
            const int r = i >> 4, ci = i & 15, col = c0 + ci;
            float q = 0.f;
            if (col < n) {
                const long long at = (long long)r * n + col;
                const float v = res[at] + bf2f(f2bf(moe_unpermute_at(y, position, weights, k, nullptr, r, n, col)));
                res[at] = v;
                q = v * v;
            }
            sq[ci][r] = q;
        }
        __syncthreads();
        if (threadIdx.x < rows) {
            float s = 0.f;
#pragma unroll
            for (int ci = 0; ci < 16; ci++) s += sq[ci][threadIdx.x];
            stats[(long long)threadIdx.x * gridDim.x + blockIdx.x] = s;
        }
    } else {
        for (int i = threadIdx.x; i < rows * 16; i += blockDim.x) {
            const int r = i >> 4, col = c0 + (i & 15);
            if (col < n)
                final_out[(long long)r * n + col] = f2bf(moe_unpermute_at(y, position, weights, k, nullptr, r, n, col));
        }
    }
}

// The un-permute's operands of a MOE_ACT_UNPERMUTE(_RESID) launch (unused otherwise): the
// bf16 rows out, or (RESID) the residual stream and its stats.
struct MoeUnpermuteArgs {
    const int* position;
    const float* weights;
    int rows;
    bf16_t* out;
    float* res;
    float* stats;
    unsigned* counters;
};

template <int ACT, int U>
__device__ __forceinline__ void moe_skinny_body(const bf16_t* __restrict__ x, int per_token, int k,
                                                const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
                                                const int* __restrict__ offsets, const int* __restrict__ order,
                                                bf16_t* __restrict__ out, int n, int d, int n_experts, float alpha,
                                                float limit, MoeUnpermuteArgs un) {
    constexpr int NW = MOE_SK_WARPS;
    constexpr bool UNPERMUTE = ACT == MOE_ACT_UNPERMUTE || ACT == MOE_ACT_UNPERMUTE_RESID;
    constexpr bool PLAIN = ACT == MOE_ACT_NONE || UNPERMUTE;
    constexpr int BATCH = 4 * U;  // 16-byte chunks per row per batch
    __shared__ float red[NW][4][32];
    PDL_ENTER();
    int e = 0, begin = 0, end = 0;
    if (!moe_active_expert(offsets, n_experts, blockIdx.y, e, begin, end)) {
        if constexpr (UNPERMUTE)
            moe_unpermute_tile<ACT == MOE_ACT_UNPERMUTE_RESID>(out, n, un.position, un.weights, k, un.rows, un.out,
                                                               un.res, un.stats, un.counters);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kc = d >> 3;
    // Output columns of this CTA, and the two weight rows of lane group g (A rows g, g + 8).
    const int half = n >> 1;
    const int c0 = blockIdx.x * (PLAIN ? 16 : 8);
    long long ra, rb;
    if (PLAIN) {
        ra = min(c0 + g, n - 1);
        rb = min(c0 + g + 8, n - 1);
    } else {
        const int c = min(c0 + g, half - 1);
        ra = ACT == MOE_ACT_SILU ? c : 2 * c;
        rb = ACT == MOE_ACT_SILU ? half + c : 2 * c + 1;
    }
    const bf16_t* we = w + (long long)e * n * d;
    const uint4* wa = reinterpret_cast<const uint4*>(we + ra * d) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(we + rb * d) + t;
    const int nb = (kc + BATCH - 1) / BATCH;
    for (int p0 = begin; p0 < end; p0 += 8) {
        const int pe = min(p0 + g, end - 1);
        const long long src = per_token ? order[pe] / k : pe;
        const uint4* xr = reinterpret_cast<const uint4*>(x + src * d) + t;
        // Two accumulator sets (even and odd mma of a step) halve the dependent mma chain.
        float acc[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[h][j] = 0.f;
        for (int b = warp; b < nb; b += NW) {
            const int cb = b * BATCH;
            uint4 va[U], vb[U], vx[U];
            if (cb + BATCH <= kc) {
#pragma unroll
                for (int u = 0; u < U; u++) {
                    va[u] = moe_ld_stream(wa + cb + 4 * u);
                    vb[u] = moe_ld_stream(wb + cb + 4 * u);
                }
#pragma unroll
                for (int u = 0; u < U; u++) vx[u] = xr[cb + 4 * u];
            } else {
                // The last, partial batch: chunks past d load chunk 0 (valid memory) and are
                // zeroed on both operands, so they add exact zeros.
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int c = cb + 4 * u;
                    const bool in = c + t < kc;
                    const int cc = in ? c : -t;
                    va[u] = moe_ld_stream(wa + cc);
                    vb[u] = moe_ld_stream(wb + cc);
                    vx[u] = xr[cc];
                    if (!in) {
                        va[u] = make_uint4(0, 0, 0, 0);
                        vb[u] = make_uint4(0, 0, 0, 0);
                        vx[u] = make_uint4(0, 0, 0, 0);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const unsigned lo[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y};
                const unsigned hi[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
                moe_mma(acc[0], lo, vx[u].x, vx[u].y);
                moe_mma(acc[1], hi, vx[u].z, vx[u].w);
            }
        }
        // Accumulator j in lane (g, t) is D[g + 8 (j / 2)][2t + j % 2]: D's rows are the A rows
        // (ra for g, rb for g + 8), its columns the entries p0 + 2t + j % 2.
#pragma unroll
        for (int j = 0; j < 4; j++) red[warp][j][lane] = acc[0][j] + acc[1][j];
        __syncthreads();
        if (PLAIN) {
            for (int i = threadIdx.x; i < 4 * 32; i += NW * 32) {
                const int j = i >> 5, l = i & 31;
                float s = 0.f;
#pragma unroll
                for (int v = 0; v < NW; v++) s += red[v][j][l];
                const int col = c0 + (l >> 2) + ((j & 2) ? 8 : 0);
                const int p = p0 + 2 * (l & 3) + (j & 1);
                if (col < n && p < end) {
                    const float bb = bias ? bf2f(bias[(long long)e * n + col]) : 0.f;
                    out[(long long)p * n + col] = f2bf(s + bb);
                }
            }
        } else {
            // 8 columns x 8 entries: thread i takes column c0 + i % 8 of entry p0 + i / 8, its
            // gate in D row i % 8 and its up in D row i % 8 + 8.
            for (int i = threadIdx.x; i < 64; i += NW * 32) {
                const int ci = i & 7, mm = i >> 3;
                const int l = 4 * ci + (mm >> 1), j = mm & 1;
                float sg = 0.f, su = 0.f;
#pragma unroll
                for (int v = 0; v < NW; v++) sg += red[v][j][l];
#pragma unroll
                for (int v = 0; v < NW; v++) su += red[v][2 + j][l];
                const int col = c0 + ci;
                const int p = p0 + mm;
                if (col < half && p < end) {
                    const int rg = ACT == MOE_ACT_SILU ? col : 2 * col;
                    const int ru = ACT == MOE_ACT_SILU ? half + col : 2 * col + 1;
                    const float bg = bias ? bf2f(bias[(long long)e * n + rg]) : 0.f;
                    const float bu = bias ? bf2f(bias[(long long)e * n + ru]) : 0.f;
                    const float gv = bf2f(f2bf(sg + bg)), uv = bf2f(f2bf(su + bu));
                    const float o = ACT == MOE_ACT_SILU ? SiluAct()(gv) * uv : moe_clamped_swiglu(gv, uv, alpha, limit);
                    out[(long long)p * half + col] = f2bf(o);
                }
            }
        }
        // Every thread is done reading red before the next entry batch writes it.
        __syncthreads();
    }
    if constexpr (UNPERMUTE)
        moe_unpermute_tile<ACT == MOE_ACT_UNPERMUTE_RESID>(out, n, un.position, un.weights, k, un.rows, un.out, un.res,
                                                           un.stats, un.counters);
}

// Six CTAs an SM (__launch_bounds__(128, 6): at most 80 registers, none spilled with NVRTC
// 13.0 on sm_90a, against 88 to 104 uncapped): gate_up with its activation at b = 1 is 96 x 8 =
// 768 CTAs, one wave over the H100's 132 x 6 slots instead of 1.2 waves at five an SM.
// The entries: ACT x U (k-steps of 32 per batch: 4 for inputs of 2,048 and more, else 2), in
// the order of MOE_SKINNY_VARIANTS in kernels/src/cuda/moe.rs. Written out (not by a macro) so
// each entry's name appears as it is looked up.

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_bf16_u2(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_NONE, 2>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_bf16_u4(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_NONE, 4>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_silu_bf16_u2(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_SILU, 2>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_silu_bf16_u4(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_SILU, 4>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_swiglu_bf16_u2(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_SWIGLU, 2>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_swiglu_bf16_u4(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit) {
    moe_skinny_body<MOE_ACT_SWIGLU, 4>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                       MoeUnpermuteArgs{});
}

// The down product with the un-permute fused (MOE_ACT_UNPERMUTE), for decode-sized steps.
// u2 (expert widths below 2,048: Qwen3-30B-A3B's 768) runs eight CTAs an SM (64 registers, no
// stack with NVRTC 13.0 on sm_90a): at b = 1 down is 128 column tiles x 8 experts = 1,024 CTAs,
// one wave over the H100's 132 x 8 slots instead of 1.3 waves at six. u4 keeps six (at eight
// it spilled 48 bytes).
extern "C" __global__ __launch_bounds__(128, 8) void moe_skinny_unpermute_bf16_u2(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit, const int* __restrict__ position, const float* __restrict__ weights,
    int rows, bf16_t* __restrict__ final_out, unsigned* counters) {
    moe_skinny_body<MOE_ACT_UNPERMUTE, 2>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                          MoeUnpermuteArgs{position, weights, rows, final_out, nullptr, nullptr, counters});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_unpermute_bf16_u4(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit, const int* __restrict__ position, const float* __restrict__ weights,
    int rows, bf16_t* __restrict__ final_out, unsigned* counters) {
    moe_skinny_body<MOE_ACT_UNPERMUTE, 4>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha, limit,
                                          MoeUnpermuteArgs{position, weights, rows, final_out, nullptr, nullptr, counters});
}

// The down product with the un-permute and the residual add fused (MOE_ACT_UNPERMUTE_RESID):
// the launch bounds of the plain un-permute entries above.
extern "C" __global__ __launch_bounds__(128, 8) void moe_skinny_unpermute_resid_bf16_u2(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit, const int* __restrict__ position, const float* __restrict__ weights,
    int rows, float* __restrict__ res, float* __restrict__ stats, unsigned* counters) {
    moe_skinny_body<MOE_ACT_UNPERMUTE_RESID, 2>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha,
                                                limit, MoeUnpermuteArgs{position, weights, rows, nullptr, res, stats, counters});
}

extern "C" __global__ __launch_bounds__(128, 6) void moe_skinny_unpermute_resid_bf16_u4(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts, float alpha, float limit, const int* __restrict__ position, const float* __restrict__ weights,
    int rows, float* __restrict__ res, float* __restrict__ stats, unsigned* counters) {
    moe_skinny_body<MOE_ACT_UNPERMUTE_RESID, 4>(x, per_token, k, w, bias, offsets, order, out, n, d, n_experts, alpha,
                                                limit, MoeUnpermuteArgs{position, weights, rows, nullptr, res, stats, counters});
}
