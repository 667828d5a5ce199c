// Row-wise and element-wise kernels: embedding gather into the f32 residual stream, RMSNorm
// of it (alone and fused with the residual add), SiLU*mul, bias add, column split and row gather, bf16<->f32 conversion.
// bf16 storage, f32 arithmetic. One block per row where a row reduction is needed.

// The residual stream is f32 (the bf16 branch outputs are added to it without rounding the
// sum), so precision does not drain away over the layers; the normalized activation that
// feeds the next GEMM is rounded to bf16 once.

// out[row] = table[tokens[row]] widened to f32 (the residual stream), one block per row.
extern "C" __global__ void embed_f32(const unsigned* __restrict__ tokens, const bf16_t* __restrict__ table,
                                     float* __restrict__ out, int dim) {
    const long long row = blockIdx.x;
    const bf16_t* src = table + (long long)tokens[row] * dim;
    float* dst = out + row * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf2f(src[i]);
}

// out = x / rms(x) * w with an f32 input row (the residual stream), one block per row.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                        bf16_t* __restrict__ out, int dim, float eps) {
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = x[base + i]; ss += v * v; }
    float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[base + i] = f2bf(x[base + i] * inv * bf2f(w[i]));
}

// residual += x in f32 (x is a bf16 branch output); out = rms_norm(residual) * w in bf16.
// Each thread re-reads only the residual elements it wrote itself, so no barrier is needed
// between the add and the normalization beyond the one inside block_sum.
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ residual, const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int dim,
                                            float eps) {
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float r = residual[base + i] + bf2f(x[base + i]);
        residual[base + i] = r;
        ss += r * r;
    }
    float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[base + i] = f2bf(residual[base + i] * inv * bf2f(w[i]));
}

// Rows of gate_up are [gate | up] of width 2d; out rows are silu(gate) * up of width d.
extern "C" __global__ void silu_mul_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, int d,
                                         long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d, c = i % d;
        float g = bf2f(gate_up[r * 2 * d + c]);
        float u = bf2f(gate_up[r * 2 * d + d + c]);
        out[i] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}

// x[r, j] += b[j] for rows of width n.
extern "C" __global__ void bias_add_bf16(bf16_t* __restrict__ x, const bf16_t* __restrict__ b, int n,
                                         long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % n]));
}

// dst[r, c] = src[r, col0 + c] for c < dst_w: one column band of a wider row-major matrix.
extern "C" __global__ void copy_cols_bf16(const bf16_t* __restrict__ src, int src_w, int col0,
                                          bf16_t* __restrict__ dst, int dst_w, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / dst_w, c = i % dst_w;
        dst[i] = src[r * src_w + col0 + c];
    }
}

// dst[i] = src[rows[i]] for rows of width w; one block per output row.
extern "C" __global__ void gather_rows_bf16(const bf16_t* __restrict__ src, const int* __restrict__ rows,
                                            bf16_t* __restrict__ dst, int w) {
    const long long o = (long long)blockIdx.x * w, s = (long long)rows[blockIdx.x] * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) dst[o + i] = src[s + i];
}

// dst[i] = src[rows[i]] for f32 rows of width w (the residual stream); one block per output row.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, const int* __restrict__ rows,
                                           float* __restrict__ dst, int w) {
    const long long o = (long long)blockIdx.x * w, s = (long long)rows[blockIdx.x] * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) dst[o + i] = src[s + i];
}

extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ src, float* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = bf2f(src[i]);
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, bf16_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = f2bf(src[i]);
}
