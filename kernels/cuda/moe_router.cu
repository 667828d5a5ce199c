// The MoE router for decode-sized steps, fused with the routing and the permutation: one
// launch instead of three (the router GEMV, then moe_route_permute). References:
// kernels/src/cpu/linear.rs (the logits), kernels/src/cpu/moe.rs (routing, permutation);
// launcher: kernels/src/cuda/moe_router.rs. Compiled after moe.cu and moe_skinny.cu (same
// module): it uses moe_route_row, moe_scan_offsets and moe_ld_stream.
//
// Grid: ceil(n_experts / warps) CTAs of MOE_RRP_WARPS warps. Warp w of CTA c computes the
// logits of expert c * warps + w for every row (its weight row streamed once, 8 16-byte loads a
// lane in flight; the rows of x come from L1/L2), f32, plus the router bias in f32, and stores
// them. Each CTA then arrives on *counter (release: a fence after its stores); the last CTA to
// arrive (acquire: a fence, then loads through L2) reads all rows x n_experts logits into
// shared memory, routes row r with warp r (moe_route_row, as moe_route_f32: same ids and
// weights for the same logits), and permutes the rows * k ids by ranking: assignment i goes to
// offsets[e] + #{i' < i with id e}, the stable order moe_permute gives. It leaves *counter at
// zero for the next launch (CUDA graph replays).
//
// Limits: rows <= MOE_RRP_MAX_ROWS (one routing warp per row), n_experts <= MOE_MAX_EXPERTS,
// k <= MOE_MAX_K, h % 8 == 0.

#define MOE_RRP_WARPS 16
#define MOE_RRP_MAX_ROWS 16

// Eight bf16 products of a 16-byte chunk of x and of w, accumulated in order into acc.
__device__ __forceinline__ float moe_dot8(uint4 xv, uint4 wv, float acc) {
    const unsigned xw[4] = {xv.x, xv.y, xv.z, xv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        acc = fmaf(__uint_as_float(xw[q] << 16), __uint_as_float(ww[q] << 16), acc);
        acc = fmaf(__uint_as_float(xw[q] & 0xffff0000u), __uint_as_float(ww[q] & 0xffff0000u), acc);
    }
    return acc;
}

// Parameters: moe_route_permute's (the routing's, then the permutation's outputs), then the
// router's operands and the counter.
extern "C" __global__ __launch_bounds__(MOE_RRP_WARPS * 32) void moe_router_route_permute(
    float* logits, int rows, int n_experts, int k, int sigmoid, int renormalize, float scale, int* __restrict__ ids,
    float* __restrict__ weights, int* __restrict__ offsets, int* __restrict__ order, int* __restrict__ position,
    const bf16_t* __restrict__ x, int h, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    unsigned* counter) {
    __shared__ float sl[MOE_RRP_MAX_ROWS * MOE_MAX_EXPERTS];
    __shared__ int sids[MOE_RRP_MAX_ROWS * MOE_MAX_K];
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];
    __shared__ int last;
    PDL_ENTER();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int kc = h >> 3;
    for (int e = blockIdx.x * warps + warp; e < n_experts; e += gridDim.x * warps) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)e * h);
        float acc[MOE_RRP_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < MOE_RRP_MAX_ROWS; r++) acc[r] = 0.f;
        for (int c0 = lane; c0 < kc; c0 += 8 * 32) {
            // 8 chunks of the weight row in flight a lane (the whole row at h = 2,048); chunks
            // past the row are zero and skipped.
            uint4 wv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int c = c0 + 32 * u;
                wv[u] = c < kc ? moe_ld_stream(wr + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int r = 0; r < MOE_RRP_MAX_ROWS; r++) {
                if (r < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)r * h);
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const int c = c0 + 32 * u;
                        if (c < kc) acc[r] = moe_dot8(xr[c], wv[u], acc[r]);
                    }
                }
            }
        }
        const float b = bias ? bf2f(bias[e]) : 0.f;
#pragma unroll
        for (int r = 0; r < MOE_RRP_MAX_ROWS; r++) {
            if (r < rows) {
                const float s = warp_sum(acc[r]);
                if (lane == 0) logits[(long long)r * n_experts + e] = s + b;
            }
        }
    }
    // Release this CTA's logits, then arrive; only the last CTA goes on.
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (tid == 0) *counter = 0;
    for (int i = tid; i < rows * n_experts; i += blockDim.x) sl[i] = __ldcg(logits + i);
    __syncthreads();
    // Routing: warp r routes row r into shared ids (the weights go straight out).
    for (int r = warp; r < rows; r += warps) moe_route_row(sl, r, n_experts, k, sigmoid, renormalize, scale, sids, weights);
    for (int e = tid; e <= n_experts; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    const int n = rows * k;
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = sids[i];
        ids[i] = e;
        if ((unsigned)e < (unsigned)n_experts) atomicAdd(&cursor[e], 1);
    }
    __syncthreads();
    if (warp == 0) moe_scan_offsets(cursor, n_experts, offsets);
    __syncthreads();
    // Stable placement by rank (n <= 512: a linear count per assignment, all in parallel).
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = sids[i];
        if ((unsigned)e >= (unsigned)n_experts) continue;
        int rank = 0;
        for (int j = 0; j < i; j++) rank += sids[j] == e;
        const int p = cursor[e] + rank;
        order[p] = i;
        position[i] = p;
    }
}
