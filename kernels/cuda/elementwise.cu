// Row-wise and element-wise kernels: embedding gather into the f32 residual stream, RMSNorm
// of it (alone and fused with the residual add), SiLU*mul and GELU-tanh*mul, logit soft-capping, the bf16-rounded scale of the embedding, bias add, column split and row gather, bf16<->f32 conversion.
// bf16 storage, f32 arithmetic. One block per row where a row reduction is needed.

// The residual stream is f32 (the bf16 branch outputs are added to it without rounding the
// sum), so precision does not drain away over the layers; the normalized activation that
// feeds the next GEMM is rounded to bf16 once.

// out[row] = table[tokens[row]] widened to f32 (the residual stream), one block per row; four
// elements per thread and load when the width allows (dim % 4 == 0), so a row takes one pass.
extern "C" __global__ void embed_f32(const unsigned* __restrict__ tokens, const bf16_t* __restrict__ table,
                                     float* __restrict__ out, int dim) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    const bf16_t* src = table + (long long)tokens[row] * dim;
    float* dst = out + row * dim;
    if ((dim & 3) == 0) {
        for (int i = 4 * threadIdx.x; i < dim; i += 4 * blockDim.x) {
            const uint2 v = *reinterpret_cast<const uint2*>(src + i);
            *reinterpret_cast<float4*>(dst + i) = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                                              __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf2f(src[i]);
}

// The row kernels below keep a row in registers when it fits: NORM_V float4 (and 4-element
// bf16) chunks per thread, every load of the row issued before the first use, so a row costs
// one memory round trip instead of one per loop iteration (a 4096-wide row at b = 1 took
// ~10 us as a 16-iteration dependent loop). The launcher sizes the block so that
// dim <= 4 * NORM_V * blockDim.x; other widths take the loops.
#define NORM_V 4

__device__ __forceinline__ float4 bf4_to_f4(uint2 v) {
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}

__device__ __forceinline__ uint2 f4_to_bf4(float a, float b, float c, float d) {
    return make_uint2((unsigned)f2bf(a) | ((unsigned)f2bf(b) << 16), (unsigned)f2bf(c) | ((unsigned)f2bf(d) << 16));
}

__device__ __forceinline__ bool norm_fits(int dim) { return (dim & 3) == 0 && dim <= 4 * NORM_V * (int)blockDim.x; }

// The norm weight's chunks of this thread (as norm_store reads them), loaded before the PDL
// wait: weights are never written during a step, and from DRAM (the step streams gigabytes
// through L2) this load would otherwise be a second memory round trip after the row's.
__device__ __forceinline__ void norm_weight_load(const bf16_t* __restrict__ w, int dim, uint2* wv) {
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        wv[j] = i < dim ? *reinterpret_cast<const uint2*>(w + i) : make_uint2(0u, 0u);
    }
}

// out = r / rms(r) * (w + w_off) for the row r held as NORM_V float4 chunks per thread and the
// weight's chunks wv (norm_weight_load; w_off is 0, or 1 for Gemma's norms, which scale by 1 + w
// computed in f32).
__device__ __forceinline__ void norm_store(const float4* r, const uint2* wv, bf16_t* __restrict__ out, int dim,
                                           float eps, float ss, float w_off) {
    const float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        if (i < dim) {
            float4 w = bf4_to_f4(wv[j]);
            w = make_float4(w.x + w_off, w.y + w_off, w.z + w_off, w.w + w_off);
            *reinterpret_cast<uint2*>(out + i) =
                f4_to_bf4(r[j].x * inv * w.x, r[j].y * inv * w.y, r[j].z * inv * w.z, r[j].w * inv * w.w);
        }
    }
}

// out = x / rms(x) * (w + w_off) with an f32 input row (the residual stream), one block per row.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                        bf16_t* __restrict__ out, int dim, float eps, float w_off) {
    const long long base = (long long)blockIdx.x * dim;
    if (norm_fits(dim)) {
        uint2 wv[NORM_V];
        norm_weight_load(w, dim, wv);
        PDL_ENTER();
        float4 r[NORM_V];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < NORM_V; j++) {
            const int i = 4 * (j * blockDim.x + threadIdx.x);
            r[j] = i < dim ? *reinterpret_cast<const float4*>(x + base + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < NORM_V; j++) ss += r[j].x * r[j].x + r[j].y * r[j].y + r[j].z * r[j].z + r[j].w * r[j].w;
        norm_store(r, wv, out + base, dim, eps, ss, w_off);
        return;
    }
    PDL_ENTER();
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = x[base + i]; ss += v * v; }
    float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[base + i] = f2bf(x[base + i] * inv * (bf2f(w[i]) + w_off));
}

// residual += x for the row at base, held as NORM_V float4 chunks per thread (the norm_fits
// layout) and stored back; returns the thread's part of the sum of squares. Each thread re-reads
// only the residual elements it wrote itself, so no barrier is needed before the reduction.
__device__ __forceinline__ float add_residual_row(float* __restrict__ residual, const bf16_t* __restrict__ x,
                                                  long long base, int dim, float4* r) {
    uint2 xv[NORM_V];
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        if (i < dim) {
            r[j] = *reinterpret_cast<const float4*>(residual + base + i);
            xv[j] = *reinterpret_cast<const uint2*>(x + base + i);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        if (i < dim) {
            const float4 a = bf4_to_f4(xv[j]);
            r[j] = make_float4(r[j].x + a.x, r[j].y + a.y, r[j].z + a.z, r[j].w + a.w);
            *reinterpret_cast<float4*>(residual + base + i) = r[j];
            ss += r[j].x * r[j].x + r[j].y * r[j].y + r[j].z * r[j].z + r[j].w * r[j].w;
        } else {
            r[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    return ss;
}

// residual += x in f32 (x is a bf16 branch output); out = rms_norm(residual) * (w + w_off) in bf16.
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ residual, const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int dim,
                                            float eps, float w_off) {
    const long long base = (long long)blockIdx.x * dim;
    if (norm_fits(dim)) {
        uint2 wv[NORM_V];
        norm_weight_load(w, dim, wv);
        PDL_ENTER();
        float4 r[NORM_V];
        const float ss = add_residual_row(residual, x, base, dim, r);
        norm_store(r, wv, out + base, dim, eps, ss, w_off);
        return;
    }
    PDL_ENTER();
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float r = residual[base + i] + bf2f(x[base + i]);
        residual[base + i] = r;
        ss += r * r;
    }
    float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[base + i] = f2bf(residual[base + i] * inv * (bf2f(w[i]) + w_off));
}

// add_rms_norm_f32's add and norm with the normalized row quantized per token instead of stored:
// each value rounded to bf16 as add_rms_norm_f32 stores it, then codes[row] = e4m3(h / s) with
// s = amax(|h|) / 448 (1 for a row of zeros or without a finite maximum), scales[row] = s, as
// quantize_rows_e4m3 computes them from the stored row (fp8_linear.cu): the same codes and
// scales without the bf16 row's write and re-read. Rows that fit the registers only (the
// launcher checks norm_fits' condition).
extern "C" __global__ void add_rms_norm_quant_e4m3(float* __restrict__ residual, const bf16_t* __restrict__ x,
                                                   const bf16_t* __restrict__ w, unsigned char* __restrict__ codes,
                                                   float* __restrict__ scales, int dim, float eps, float w_off) {
    const long long base = (long long)blockIdx.x * dim;
    uint2 wv[NORM_V];
    norm_weight_load(w, dim, wv);
    PDL_ENTER();
    float4 r[NORM_V];
    const float inv = rsqrtf(block_sum(add_residual_row(residual, x, base, dim, r)) / (float)dim + eps);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        if (i < dim) {
            float4 wf = bf4_to_f4(wv[j]);
            wf = make_float4(wf.x + w_off, wf.y + w_off, wf.z + w_off, wf.w + w_off);
            r[j] = make_float4(bf2f(f2bf(r[j].x * inv * wf.x)), bf2f(f2bf(r[j].y * inv * wf.y)),
                               bf2f(f2bf(r[j].z * inv * wf.z)), bf2f(f2bf(r[j].w * inv * wf.w)));
            amax = fmaxf(fmaxf(amax, fmaxf(fabsf(r[j].x), fabsf(r[j].y))), fmaxf(fabsf(r[j].z), fabsf(r[j].w)));
        }
    }
    const float s = e4m3_row_scale(block_amax(amax));
#pragma unroll
    for (int j = 0; j < NORM_V; j++) {
        const int i = 4 * (j * blockDim.x + threadIdx.x);
        if (i < dim) {
            const unsigned q = f2e4m3x2(r[j].x / s, r[j].y / s) | (f2e4m3x2(r[j].z / s, r[j].w / s) << 16);
            *reinterpret_cast<unsigned*>(codes + base + i) = q;
        }
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = s;
}

// Rows of gate_up are [gate | up] of width 2d; out rows are act(gate) * up of width d. With
// d % 8 == 0 each thread takes 8 outputs (16-byte loads and store; the launcher sizes the grid
// for total / 8), else one. ACT is a functor: SiLU (SwiGLU) or GELU-tanh (GeGLU, Gemma).
// SiluAct and GeluTanhAct live in prelude.cuh: the skinny GEMM applies them in its epilogue
// (gemv.cu, the fused gate_up projection), bit-identical to gated_mul here.
template <typename ACT>
__device__ __forceinline__ void gated_mul(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, int d,
                                          long long total) {
    const ACT act;
    if ((d & 7) == 0) {
        const int d8 = d >> 3;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (total >> 3);
             i += (long long)gridDim.x * blockDim.x) {
            const long long r = i / d8, c = (i - r * d8) << 3;
            const uint4 g = *reinterpret_cast<const uint4*>(gate_up + r * 2 * d + c);
            const uint4 u = *reinterpret_cast<const uint4*>(gate_up + r * 2 * d + d + c);
            const unsigned gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
            unsigned o[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float g0 = __uint_as_float(gw[j] << 16), g1 = __uint_as_float(gw[j] & 0xffff0000u);
                const float u0 = __uint_as_float(uw[j] << 16), u1 = __uint_as_float(uw[j] & 0xffff0000u);
                o[j] = (unsigned)f2bf(act(g0) * u0) | ((unsigned)f2bf(act(g1) * u1) << 16);
            }
            *reinterpret_cast<uint4*>(out + (i << 3)) = make_uint4(o[0], o[1], o[2], o[3]);
        }
        return;
    }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d, c = i % d;
        float g = bf2f(gate_up[r * 2 * d + c]);
        float u = bf2f(gate_up[r * 2 * d + d + c]);
        out[i] = f2bf(act(g) * u);
    }
}

extern "C" __global__ void silu_mul_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, int d,
                                         long long total) {
    PDL_ENTER();
    gated_mul<SiluAct>(gate_up, out, d, total);
}

extern "C" __global__ void gelu_tanh_mul_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, int d,
                                              long long total) {
    PDL_ENTER();
    gated_mul<GeluTanhAct>(gate_up, out, d, total);
}

// x = cap * tanh(x / cap) in place over n f32 values (Gemma 2's final logit soft-capping).
extern "C" __global__ void softcap_f32(float* __restrict__ x, long long n, float cap) {
    PDL_ENTER();
    const float inv = 1.f / cap;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] * inv);
}

// x = bf16(x * s) in place over n f32 values: Gemma's embedding normalizer, which transformers
// multiplies in the model dtype (s is already rounded to bf16 by the launcher), so the scaled
// embedding is rounded once, as there.
extern "C" __global__ void scale_round_bf16_f32(float* __restrict__ x, long long n, float s) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = bf2f(f2bf(x[i] * s));
}

// x[r, j] += b[j] for rows of width n.
extern "C" __global__ void bias_add_bf16(bf16_t* __restrict__ x, const bf16_t* __restrict__ b, int n,
                                         long long total) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % n]));
}

// x[r, j] += b[j] for f32 rows of width n and a bf16 bias, in f32 (gpt-oss's router bias on
// its f32 logits).
extern "C" __global__ void bias_add_f32(float* __restrict__ x, const bf16_t* __restrict__ b, int n,
                                        long long total) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += bf2f(b[i % n]);
}

// dst[r, c] = src[r, col0 + c] for c < dst_w: one column band of a wider row-major matrix.
extern "C" __global__ void copy_cols_bf16(const bf16_t* __restrict__ src, int src_w, int col0,
                                          bf16_t* __restrict__ dst, int dst_w, long long total) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / dst_w, c = i % dst_w;
        dst[i] = src[r * src_w + col0 + c];
    }
}

// dst[i] = src[rows[i]] for rows of width w; one block per output row.
extern "C" __global__ void gather_rows_bf16(const bf16_t* __restrict__ src, const int* __restrict__ rows,
                                            bf16_t* __restrict__ dst, int w) {
    PDL_ENTER();
    const long long o = (long long)blockIdx.x * w, s = (long long)rows[blockIdx.x] * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) dst[o + i] = src[s + i];
}

// dst[i] = src[rows[i]] for f32 rows of width w (the residual stream); one block per output row.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, const int* __restrict__ rows,
                                           float* __restrict__ dst, int w) {
    PDL_ENTER();
    const long long o = (long long)blockIdx.x * w, s = (long long)rows[blockIdx.x] * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) dst[o + i] = src[s + i];
}

extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ src, float* __restrict__ dst, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = bf2f(src[i]);
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, bf16_t* __restrict__ dst, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = f2bf(src[i]);
}
