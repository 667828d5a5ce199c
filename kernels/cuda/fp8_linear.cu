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
        unsigned q[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; j++) q[j >> 2] |= (unsigned)f2e4m3(v[j] / s) << (8 * (j & 3));
        cr[c] = make_uint2(q[0], q[1]);
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
// projection's input). One CTA per row, two forms:
// - SMQ_CHUNKS 8-value chunks a thread or fewer (d <= 8 * SMQ_CHUNKS * blockDim.x: Llama-3.1-8B's
//   14,336 at 256 threads): every chunk's gate and up loads are issued before the first product,
//   and the products stay in registers (packed bf16) for the codes. At a decode batch (256 rows,
//   two CTAs an SM) the loop form below kept one chunk's loads in flight per thread and ran at
//   ~30 % of copy;
// - any other d: a loop over the chunks, whose second pass re-reads the row of act this thread
//   just wrote (its own chunks: program order makes them visible; 2d bytes, from L2), not
//   gate_up (4d bytes, past L2 at prefill sizes: a first version that recomputed the products
//   from gate_up took as long as the two kernels it replaces).
#define SMQ_CHUNKS 8

// The eight bf16 products SiLU(g) * u of one chunk, as floats (g, u: eight bf16 each).
__device__ __forceinline__ void silu_products(uint4 g, uint4 u, float v[8]) {
    const SiluAct silu;
    const unsigned gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[2 * j] = bf2f(f2bf(silu(bf2f((bf16_t)(gw[j] & 0xffffu))) * bf2f((bf16_t)(uw[j] & 0xffffu))));
        v[2 * j + 1] = bf2f(f2bf(silu(bf2f((bf16_t)(gw[j] >> 16))) * bf2f((bf16_t)(uw[j] >> 16))));
    }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float v[8]) {
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = (unsigned)f2bf(v[2 * j]) | ((unsigned)f2bf(v[2 * j + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

extern "C" __global__ void silu_mul_quant_e4m3(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ act,
                                               unsigned char* __restrict__ codes, float* __restrict__ scales,
                                               int d, int in_registers) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    const bf16_t* g = gate_up + row * 2 * (long long)d;
    const bf16_t* u = g + d;
    uint4* ar = reinterpret_cast<uint4*>(act + row * (long long)d);
    uint2* cr = reinterpret_cast<uint2*>(codes + row * (long long)d);
    const int d8 = d >> 3;
    float amax = 0.f;
    if (in_registers) {
        uint4 gv[SMQ_CHUNKS], uv[SMQ_CHUNKS];
#pragma unroll
        for (int j = 0; j < SMQ_CHUNKS; j++) {
            const int c = j * blockDim.x + threadIdx.x;
            if (c < d8) {
                gv[j] = reinterpret_cast<const uint4*>(g)[c];
                uv[j] = reinterpret_cast<const uint4*>(u)[c];
            }
        }
        uint4 pv[SMQ_CHUNKS];
#pragma unroll
        for (int j = 0; j < SMQ_CHUNKS; j++) {
            const int c = j * blockDim.x + threadIdx.x;
            if (c < d8) {
                float v[8];
                silu_products(gv[j], uv[j], v);
                pv[j] = pack_bf16x8(v);
                ar[c] = pv[j];
#pragma unroll
                for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v[e]));
            }
        }
        const float s = e4m3_row_scale(block_amax(amax));
#pragma unroll
        for (int j = 0; j < SMQ_CHUNKS; j++) {
            const int c = j * blockDim.x + threadIdx.x;
            if (c < d8) {
                const unsigned w[4] = {pv[j].x, pv[j].y, pv[j].z, pv[j].w};
                unsigned q[2] = {0u, 0u};
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    const unsigned h = (e & 1) ? (w[e >> 1] >> 16) : (w[e >> 1] & 0xffffu);
                    q[e >> 2] |= (unsigned)f2e4m3(bf2f((bf16_t)h) / s) << (8 * (e & 3));
                }
                cr[c] = make_uint2(q[0], q[1]);
            }
        }
        if (threadIdx.x == 0) scales[row] = s;
        return;
    }
    for (int c = threadIdx.x; c < d8; c += blockDim.x) {
        float v[8];
        silu_products(reinterpret_cast<const uint4*>(g)[c], reinterpret_cast<const uint4*>(u)[c], v);
        ar[c] = pack_bf16x8(v);
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
