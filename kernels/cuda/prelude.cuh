// Shared device helpers for every Baton kernel. Prepended to each kernel source by the
// Rust loader (NVRTC compiles one translation unit), so it needs no include paths.
// bf16 is carried as its raw 16 bits: conversion is a shift one way and a
// round-to-nearest-even the other, so no toolkit header is needed at run time.

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < nw ? partial[lane] : 0.f;
    return warp_sum(t);
}

// The largest of the block's non-negative values (|x|: 0 is the identity; fmaxf skips NaN, as
// the CPU reference's f32::max does); every thread gets it. The order does not matter: max is
// exact.
__device__ __forceinline__ float block_amax(float v) {
    __shared__ float partial_max[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial_max[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial_max[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The per-token E4M3 scale of a row whose largest magnitude is amax: amax / 448, or 1 for a
// row of zeros or without a finite maximum (the CPU reference's quantize_rows_per_token).
__device__ __forceinline__ float e4m3_row_scale(float amax) {
    return (amax > 0.f && amax <= __int_as_float(0x7f7fffff)) ? amax / 448.f : 1.f;
}

// Programmatic dependent launch (Hopper): a kernel launched with the programmatic-serialization
// attribute may start while the kernel before it on the stream still runs. Every kernel
// calls PDL_ENTER before it touches memory that kernel may write or read: `griddepcontrol.wait`
// returns once the previous grid has completed and its writes are visible (at once when the
// launch had no such attribute), and `launch_dependents` lets the next kernel's CTAs start
// as soon as all of this grid's CTAs are running, so its launch and prologue overlap this
// kernel's tail. Work that only reads data no kernel of the step writes (weights) may come
// before the wait: the skinny GEMM prefetches its first weight tiles there.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define PDL_ENTER() \
    do {            \
        pdl_wait();    \
        pdl_trigger(); \
    } while (0)

// NVRTC has no math.h; -inf spelled through its bit pattern.
#define NEG_INF __int_as_float(0xff800000)

// FP8 E4M3 (the FP8 KV cache), bit for bit as the CPU reference (kernels/src/cpu/fp8.rs) and
// the hardware's cvt.rn.satfinite.e4m3x2.f32: round to nearest even, finite values past 448
// saturate to +-448, NaN becomes 0x7F. Integer arithmetic only, so every architecture NVRTC
// targets compiles it (the hardware instruction needs sm_89); f2e4m3 and f2e4m3x2 below use the
// instruction where it exists.
__device__ __forceinline__ unsigned char f2e4m3_soft(float x) {
    const unsigned bits = __float_as_uint(x);
    const unsigned char sign = (unsigned char)((bits >> 24) & 0x80u);
    const unsigned a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    if (a >= 0x43e80000u) return sign | 0x7e;  // >= 464.0f (halfway to the absent 480): 448
    const int exp = (int)(a >> 23) - 127;
    if (exp >= -6) {
        const unsigned man = a & 0x7fffffu;
        unsigned code = ((unsigned)(exp + 7) << 3) | (man >> 20);
        const unsigned rest = man & 0xfffffu;
        if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) code += 1;  // a carry bumps the exponent
        return sign | (unsigned char)code;
    }
    // Subnormal: |x| / 2^-9 rounded to an integer, ties to even (the scaling is exact).
    return sign | (unsigned char)rintf(__uint_as_float(a) * 512.0f);
}

// The E4M3 codes of lo (low byte) and hi (high byte). On sm_89 and later one
// cvt.rn.satfinite.e4m3x2.f32 for the pair (~30 integer instructions with branches each in
// f2e4m3_soft: the quantizing row kernels were bound by them), with a NaN input's code set to
// 0x7F afterwards whatever its sign, so that no rule of the instruction's NaN is relied on.
__device__ __forceinline__ unsigned f2e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    unsigned r = d;
    if ((__float_as_uint(lo) & 0x7fffffffu) > 0x7f800000u) r = (r & 0xff00u) | 0x7fu;
    if ((__float_as_uint(hi) & 0x7fffffffu) > 0x7f800000u) r = (r & 0x00ffu) | 0x7f00u;
    return r;
#else
    return (unsigned)f2e4m3_soft(lo) | ((unsigned)f2e4m3_soft(hi) << 8);
#endif
}

// The E4M3 code of x (f2e4m3_soft's rule).
__device__ __forceinline__ unsigned char f2e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (unsigned char)(f2e4m3x2(x, 0.f) & 0xffu);
#else
    return f2e4m3_soft(x);
#endif
}

// A KV-cache element write, one rule for every kernel that writes the cache (rope_kv.cu, and
// the RoPE epilogue of gemv.cu), so the fused and unfused paths store the same bits: a bf16
// cache stores the value as it is; an FP8 cache (one byte an element) the E4M3 code of
// value / scale, the layer's K or V scale (the CPU reference's write_kv_fp8 on the same
// bf16-rounded values).
__device__ __forceinline__ void kv_put(bf16_t* c, bf16_t x, float) { *c = x; }
__device__ __forceinline__ void kv_put(unsigned char* c, bf16_t x, float scale) { *c = f2e4m3(bf2f(x) / scale); }
// A key's store with the layer's smoothing shift (kv_fp8.rs: e4m3((k - shift) / scale); a bf16
// cache stores keys as they are and is never given a shift). x - 0 is x, so no shift stores
// exactly what kv_put does.
__device__ __forceinline__ void kv_put_key(bf16_t* c, bf16_t x, float, float) { *c = x; }
__device__ __forceinline__ void kv_put_key(unsigned char* c, bf16_t x, float scale, float shift) {
    *c = f2e4m3((bf2f(x) - shift) / scale);
}
// Element i of a layer's key shift (n_kv_heads * head_dim floats), 0 without one.
__device__ __forceinline__ float k_shift_at(const float* __restrict__ shift, long long i) { return shift ? shift[i] : 0.f; }

// The value of an E4M3 code (0x7F / 0xFF: NaN).
__device__ __forceinline__ float e4m32f(unsigned char c) {
    const unsigned e = (c >> 3) & 0xfu, m = c & 7u;
    const unsigned sign = ((unsigned)c & 0x80u) << 24;
    if (e == 0xfu && m == 7u) return __uint_as_float(0x7fc00000u);
    const float mag = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return __uint_as_float(__float_as_uint(mag) | sign);
}

// Four E4M3 codes (the bytes of u, lowest first) as four bf16 values, exactly: every E4M3
// value is a bf16 value, so no rounding happens and the cache's scales can be applied
// outside (the tuned attention kernels fold the K scale into the softmax scale and the V scale
// into the output). lo holds codes 0 and 1, hi codes 2 and 3, the lower code in the low half.
// On sm_89+ the hardware converts pairs to f16x2; elsewhere e4m32f per code.
__device__ __forceinline__ void e4m3x4_to_bf16x4(unsigned u, unsigned& lo, unsigned& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{\n"
        " .reg .b16 c0, c1, a0, a1, a2, a3;\n"
        " .reg .b32 h0, h1;\n"
        " .reg .f32 f0, f1, f2, f3;\n"
        " mov.b32 {c0, c1}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 h0, c0;\n"
        " cvt.rn.f16x2.e4m3x2 h1, c1;\n"
        " mov.b32 {a0, a1}, h0;\n"
        " mov.b32 {a2, a3}, h1;\n"
        " cvt.f32.f16 f0, a0;\n"
        " cvt.f32.f16 f1, a1;\n"
        " cvt.f32.f16 f2, a2;\n"
        " cvt.f32.f16 f3, a3;\n"
        " cvt.rn.bf16x2.f32 %0, f1, f0;\n"
        " cvt.rn.bf16x2.f32 %1, f3, f2;\n"
        "}"
        : "=r"(lo), "=r"(hi)
        : "r"(u));
#else
    // The f32 value is a bf16 value: its upper half is the bf16.
    const unsigned b0 = __float_as_uint(e4m32f((unsigned char)(u & 0xffu))) >> 16;
    const unsigned b1 = __float_as_uint(e4m32f((unsigned char)((u >> 8) & 0xffu))) & 0xffff0000u;
    const unsigned b2 = __float_as_uint(e4m32f((unsigned char)((u >> 16) & 0xffu))) >> 16;
    const unsigned b3 = __float_as_uint(e4m32f((unsigned char)(u >> 24))) & 0xffff0000u;
    lo = b0 | b1;
    hi = b2 | b3;
#endif
}

// Four E4M3 codes (the bytes of u, lowest first) as four f16 values, exactly (every E4M3 value,
// subnormals included, is a normal f16): lo holds codes 0 and 1, hi codes 2 and 3, the lower
// code in the low half. One hardware conversion per pair on sm_89+, against the four extra
// conversions through f32 that bf16 needs (e4m3x4_to_bf16x4): the FP8-cache decode kernel
// runs its products in f16 for that reason.
__device__ __forceinline__ void e4m3x4_to_f16x4(unsigned u, unsigned& lo, unsigned& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{\n"
        " .reg .b16 c0, c1;\n"
        " mov.b32 {c0, c1}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, c0;\n"
        " cvt.rn.f16x2.e4m3x2 %1, c1;\n"
        "}"
        : "=r"(lo), "=r"(hi)
        : "r"(u));
#else
    unsigned short h[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h[j]) : "f"(e4m32f((unsigned char)((u >> (8 * j)) & 0xffu))));
    lo = (unsigned)h[0] | ((unsigned)h[1] << 16);
    hi = (unsigned)h[2] | ((unsigned)h[3] << 16);
#endif
}

// 16 E4M3 codes as 16 bf16 values (e4m3x4_to_bf16x4 on each word): out[0..1] hold codes 0..7.
__device__ __forceinline__ void e4m3x16_to_bf16x16(const uint4 u, uint4* out) {
    e4m3x4_to_bf16x4(u.x, out[0].x, out[0].y);
    e4m3x4_to_bf16x4(u.y, out[0].z, out[0].w);
    e4m3x4_to_bf16x4(u.z, out[1].x, out[1].y);
    e4m3x4_to_bf16x4(u.w, out[1].z, out[1].w);
}

// Fast E4M3 -> bf16 for the FP8 weight kernels (gemv_fp8.cu, fp8_linear.cu), exact for every
// non-NaN code: PRMT puts each code in the low byte of a 16-bit half with its sign replicated
// over the high byte; << 4 moves the 7 exponent+mantissa bits to bf16 bits 4..10 and a sign
// copy to bit 15; the mask clears the other copies. That bf16's bits are the code's re-biased
// by 127 - 7: exactly value * 2^-120 for normal codes (bf16 exponent field = E4M3's) and for
// subnormal ones (bf16 subnormal m/8 * 2^-126 = m * 2^-9 * 2^-120). One bf16x2 FMA by 2^120
// (+ -0) restores the value exactly (bf16 arithmetic keeps subnormal inputs; every E4M3 value
// is a normal bf16). Four integer instructions and one FMA per two codes, no conversion-pipe
// instruction. The NaN codes (0x7F, 0xFF) read as +-480; quantization (satfinite) never
// produces them.
//
// Two E4M3 codes (the bytes of q that `sel` picks) as a bf16x2 of their exact values.
__device__ __forceinline__ unsigned fp8_pair_bf16(unsigned q, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(q), "r"(sel));
    r = (r << 4) & 0x87f087f0u;
    // x 2^120 (bf16 0x7b80) + -0: exact, and keeps the sign of a zero.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(0x7b807b80u), "r"(0x80008000u));
    return r;
}

// 16 codes (a 16-byte load) as 8 bf16 pairs (p[j] = codes 2j, 2j + 1, the lower in the low half).
// Selectors: bytes (0, sign of 0, 1, sign of 1) = 0x9180; (2, sign 2, 3, sign 3) = 0xb3a2.
__device__ __forceinline__ void fp8x16_to_bf16(const uint4 v, unsigned* p) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        p[2 * j] = fp8_pair_bf16(w[j], 0x9180u);
        p[2 * j + 1] = fp8_pair_bf16(w[j], 0xb3a2u);
    }
}

// The gated MLP activations, one formula each for every kernel that applies them (gated_mul in
// elementwise.cu and the fused gate_up epilogue of gemv.cu), so fused and unfused paths agree bit
// for bit. SiLU: g / (1 + e^-g).
struct SiluAct {
    __device__ __forceinline__ float operator()(float g) const { return g / (1.f + __expf(-g)); }
};

// PyTorch's gelu(x, approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
struct GeluTanhAct {
    __device__ __forceinline__ float operator()(float g) const {
        return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    }
};
