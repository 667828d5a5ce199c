// FP8 (E4M3) weight matrices: w[n][k] = e4m3(codes[n][k]) * scales[n / rb][k / cb], the
// scales one f32 per rb x cb block ([ceil(n/rb)][ceil(k/cb)]: per tensor, per channel, or
// 128 x 128). Reference: kernels/src/cpu/fp8_linear.rs (Fp8Matrix, linear_fp8 with
// ActivationScale::None: these kernels are weights-only FP8, W8A16). The skinny GEMM over such
// weights (decode) is gemv_fp8.cu.

// w_bf16[i] = bf16(e4m3(codes[i]) * scale(i)): the dequantized matrix, for a bf16 GEMM (more
// rows of x than the skinny kernel takes). Any shape, one weight a thread per step (the
// launcher's fallback: fp8_dequant16_bf16 takes the usual shapes).
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

// As fp8_dequant_bf16 (bit for bit on non-NaN codes) 16 weights a thread per step: one 16-byte
// load of codes, fp8x16_to_bf16 (exact), one scale (the launcher requires k % 16 == 0 and no
// 16-code chunk straddling a column block), two 16-byte stores. `chunks` = rows * k / 16.
extern "C" __global__ void fp8_dequant16_bf16(const unsigned char* __restrict__ codes,
                                              const float* __restrict__ scales, bf16_t* __restrict__ out, int k,
                                              int rb, int cb, long long chunks) {
    PDL_ENTER();
    const int ncb = (k + cb - 1) / cb, kc = k >> 4;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < chunks;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / kc;
        const int c = (int)(i - r * kc) << 4;
        const float s = scales[(r / rb) * ncb + c / cb];
        uint4 v;
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(codes + i * 16));
        unsigned p[8], q[8];
        fp8x16_to_bf16(v, p);
#pragma unroll
        for (int j = 0; j < 8; j++)
            q[j] = (unsigned)f2bf(bf2f((bf16_t)(p[j] & 0xffffu)) * s) |
                   ((unsigned)f2bf(bf2f((bf16_t)(p[j] >> 16)) * s) << 16);
        uint4* o = reinterpret_cast<uint4*>(out + i * 16);
        o[0] = make_uint4(q[0], q[1], q[2], q[3]);
        o[1] = make_uint4(q[4], q[5], q[6], q[7]);
    }
}

// Per-row E4M3 quantization: row r of x (k wide, k % 8 == 0) becomes codes[row0 + r][c] =
// e4m3(x[r][c] / s_r) with s_r = amax(|x[r]|) / 448 (1 for a row of zeros or without a finite
// maximum), scales[row0 + r] = s_r: bit for bit the CPU reference's rule (f32 division, f2e4m3 =
// the satfinite conversion). Two uses, one rule:
// - quantize_rows_e4m3 (bf16 x): dynamic per-token activation quantization (W8A8, the input of
//   the FP8 tensor-core GEMM), quantize_rows_per_token's codes and scales;
// - quantize_rows_e4m3_f32 (f32 x): per-channel weight quantization of random weights drawn on
//   the device (Fp8Matrix::quantize_per_channel's codes and scales; row0 places a chunk of rows).
// One CTA per row, 8 values a thread per step (16-byte loads per 8 bf16, two per 8 f32; 8-byte
// stores); the second pass re-reads the row from L1/L2. amax by warp shuffles and one
// shared-memory round (NaN inputs are skipped by fmaxf, as the reference's f32::max skips them;
// max is exact, so the order of the reduction does not change it).
__device__ __forceinline__ void load8(const bf16_t* p, float v[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[2 * j] = bf2f((bf16_t)(w[j] & 0xffffu));
        v[2 * j + 1] = bf2f((bf16_t)(w[j] >> 16));
    }
}
__device__ __forceinline__ void load8(const float* p, float v[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
// A row's second pass: the E4M3 codes of its k8 * 8 values divided by the row's scale s, 8 a
// store (every thread its chunks c = threadIdx.x, + blockDim.x, ...). xr is not __restrict__:
// SiLU·mul reads back the act row it wrote, which the read-only load path must not serve.
template <typename T>
__device__ __forceinline__ void store_row_codes(const T* xr, uint2* __restrict__ cr, int k8, float s) {
    for (int c = threadIdx.x; c < k8; c += blockDim.x) {
        float v[8];
        load8(xr + 8 * c, v);
        cr[c] = make_uint2(f2e4m3x2(v[0] / s, v[1] / s) | (f2e4m3x2(v[2] / s, v[3] / s) << 16),
                           f2e4m3x2(v[4] / s, v[5] / s) | (f2e4m3x2(v[6] / s, v[7] / s) << 16));
    }
}

template <typename T>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, unsigned char* __restrict__ codes,
                                              float* __restrict__ scales, int k, long long row0) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    const T* xr = x + row * k;
    uint2* cr = reinterpret_cast<uint2*>(codes + (row0 + row) * k);
    const int k8 = k >> 3;
    float amax = 0.f;
    for (int c = threadIdx.x; c < k8; c += blockDim.x) {
        float v[8];
        load8(xr + 8 * c, v);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
    }
    const float s = e4m3_row_scale(block_amax(amax));
    store_row_codes(xr, cr, k8, s);
    if (threadIdx.x == 0) scales[row0 + row] = s;
}

extern "C" __global__ void quantize_rows_e4m3(const bf16_t* __restrict__ x, unsigned char* __restrict__ codes,
                                              float* __restrict__ scales, int k, long long row0) {
    quantize_rows(x, codes, scales, k, row0);
}

// SiLU(gate) * up of each row of gate_up ([gate | up], 2d wide), rounded to bf16 as silu_mul_bf16
// stores it, written to act, and quantized per token as quantize_rows_e4m3 quantizes those bf16
// values: the same act, codes and scale bit for bit, with one read of gate_up (the W8A8 down
// projection's input at prefill). One CTA per row; the second pass re-reads the row of act this
// thread just wrote (its own chunks: program order makes them visible; 2d bytes, from L2),
// not gate_up (4d bytes, past L2 at prefill sizes: a first version that recomputed the products
// from gate_up took as long as the two kernels it replaces). A form holding the row in registers
// with every load issued at once (100 registers, two CTAs an SM) was slower at 256 rows and at
// 2,048 (4d14f82, H100): the kernel is bound by its instructions, not by its loads' latency,
// and the loop's occupancy serves it better.
extern "C" __global__ void silu_mul_quant_e4m3(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ act,
                                               unsigned char* __restrict__ codes, float* __restrict__ scales,
                                               int d) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    const bf16_t* g = gate_up + row * 2 * (long long)d;
    const bf16_t* u = g + d;
    uint4* ar = reinterpret_cast<uint4*>(act + row * (long long)d);
    uint2* cr = reinterpret_cast<uint2*>(codes + row * (long long)d);
    const SiluAct silu;
    const int d8 = d >> 3;
    // The eight bf16 products of chunk c, as floats.
    auto products = [&](int c, float v[8]) {
        float gv[8], uv[8];
        load8(g + 8 * c, gv);
        load8(u + 8 * c, uv);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = bf2f(f2bf(silu(gv[j]) * uv[j]));
    };
    float amax = 0.f;
    for (int c = threadIdx.x; c < d8; c += blockDim.x) {
        float v[8];
        products(c, v);
        unsigned w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) w[j] = (unsigned)f2bf(v[2 * j]) | ((unsigned)f2bf(v[2 * j + 1]) << 16);
        ar[c] = make_uint4(w[0], w[1], w[2], w[3]);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
    }
    const float s = e4m3_row_scale(block_amax(amax));
    store_row_codes<bf16_t>(act + row * (long long)d, cr, d8, s);
    if (threadIdx.x == 0) scales[row] = s;
}

extern "C" __global__ void quantize_rows_e4m3_f32(const float* __restrict__ x, unsigned char* __restrict__ codes,
                                                  float* __restrict__ scales, int k, long long row0) {
    quantize_rows(x, codes, scales, k, row0);
}
