// FP8 (E4M3) weight matrices: w[n][k] = e4m3(codes[n][k]) * scales[n / rb][k / cb], the
// scales one f32 per rb x cb block ([ceil(n/rb)][ceil(k/cb)]: per tensor, per channel, or
// 128 x 128). Reference: kernels/src/cpu/fp8_linear.rs (Fp8Matrix, linear_fp8 with
// ActivationScale::None: these kernels are weights-only FP8, W8A16).

// w_bf16[i] = bf16(e4m3(codes[i]) * scale(i)): the dequantized matrix, for a bf16 GEMM
// (prefill: M > 16).
extern "C" __global__ void fp8_dequant_bf16(const unsigned char* __restrict__ codes, const float* __restrict__ scales,
                                            bf16_t* __restrict__ out, int k, int rb, int cb, long long total) {
    PDL_ENTER();
    const int ncb = (k + cb - 1) / cb;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / k;
        const int c = (int)(i - r * k);
        out[i] = f2bf(e4m32f(codes[i]) * scales[(r / rb) * ncb + c / cb]);
    }
}

// Skinny W8A16 GEMM for decode: out[m][n] = sum_k x[m][k] * w[n][k], x bf16 (m <= 16 rows),
// w FP8 as above, f32 accumulation, bf16 output. One warp per weight row: each lane reads 16
// consecutive codes (one 16-byte load, streamed: the weights are read once) and the matching
// 16 bf16 of every x row (L1-cached: every warp re-reads x), applies the 16-code chunk's one
// scale (the launcher requires k % 16 == 0 and cb % 16 == 0 or cb >= k, so a chunk never
// straddles a column block), and the warp reduces with shuffles.
template <int MAXM>
__device__ __forceinline__ void gemv_fp8_body(const bf16_t* __restrict__ x, const unsigned char* __restrict__ codes,
                                              const float* __restrict__ scales, bf16_t* __restrict__ out, int m, int n,
                                              int k, int rb, int cb) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    PDL_ENTER();
    if (row >= n) return;
    const int ncb = (k + cb - 1) / cb;
    const float* srow = scales + (long long)(row / rb) * ncb;
    const uint4* wrow = reinterpret_cast<const uint4*>(codes + (long long)row * k);
    float acc[MAXM];
#pragma unroll
    for (int i = 0; i < MAXM; i++) acc[i] = 0.f;
    for (int c = lane; c < (k >> 4); c += 32) {
        uint4 v;
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(wrow + c));
        const float s = srow[(c << 4) / cb];
        float w[16];
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 16; j++) w[j] = e4m32f((unsigned char)((words[j >> 2] >> ((j & 3) * 8)) & 0xffu)) * s;
#pragma unroll
        for (int i = 0; i < MAXM; i++) {
            if (i < m) {
                const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)i * k + (c << 4));
                const uint4 a = xr[0], b = xr[1];
                const unsigned xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    sum += bf2f((bf16_t)(xs[j] & 0xffffu)) * w[2 * j];
                    sum += bf2f((bf16_t)(xs[j] >> 16)) * w[2 * j + 1];
                }
                acc[i] += sum;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXM; i++) {
        float v = acc[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && i < m) out[(long long)i * n + row] = f2bf(v);
    }
}

extern "C" __global__ __launch_bounds__(256) void gemv_fp8_m16_bf16(const bf16_t* __restrict__ x,
                                                                    const unsigned char* __restrict__ codes,
                                                                    const float* __restrict__ scales,
                                                                    bf16_t* __restrict__ out, int m, int n, int k,
                                                                    int rb, int cb) {
    gemv_fp8_body<16>(x, codes, scales, out, m, n, k, rb, cb);
}
