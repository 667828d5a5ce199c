// Paged causal attention with what some architectures add to it (reference:
// paged_attention_ext in kernels/src/cpu/attention.rs): a sliding window (Gemma 2/3,
// Mistral, gpt-oss, Phi-3), logit soft-capping (Gemma 2), attention sinks (gpt-oss), and any
// head_dim up to 256 (Gemma's 256, Phi's 96, the tiny fixtures' 24). A first, simple kernel
// that is correct for every row of a mixed batch (prefill chunks and decode rows alike: each
// row attends to its own context), for the layers the tuned kernels (attention.cu,
// prefill.cu) do not cover yet.
//
// Grid (n_heads, rows), EXT_WARPS warps. One CTA serves one query head of one row; warp w
// takes tokens lo + w, lo + w + EXT_WARPS, ... of the row's visible range [lo, ctx), where
// ctx = row_ctx[row] (position + 1) and lo = max(0, ctx - window) with a window, else 0:
// blocks before the window are never read. Lane l holds head dims l, l + 32, ... (DPL =
// ceil(head_dim / 32) of them), so a token's K or V row is one coalesced load per 32 dims;
// the dot product is a warp sum. Online softmax per warp in f32 (natural exp), warps merged
// through shared memory; a sink adds exp(sink - max) to the denominator there. ctx <= 0 (a
// padding row) writes zeros.
//
// The _fp8 entries read an FP8 (E4M3) cache, one byte an element, dequantized on load
// (code * the layer's k_scale or v_scale, as the CPU reference paged_attention_fp8); the bf16
// entries pass scales of 1 that kv_get ignores.
#define EXT_WARPS 4

__device__ __forceinline__ float kv_get(const bf16_t* c, long long i, float) { return bf2f(c[i]); }
__device__ __forceinline__ float kv_get(const unsigned char* c, long long i, float scale) { return e4m32f(c[i]) * scale; }

template <int DPL, typename C>
__device__ __forceinline__ void attention_ext_body(const bf16_t* __restrict__ q, const C* __restrict__ k_cache,
                                                   const C* __restrict__ v_cache, bf16_t* __restrict__ out,
                                                   const int* __restrict__ row_ctx, const int* __restrict__ row_bt,
                                                   const int* __restrict__ block_tables, int n_heads, int n_kv_heads,
                                                   int head_dim, int block_size, float scale, int window,
                                                   float softcap, const float* __restrict__ sinks, float k_scale,
                                                   float v_scale) {
    __shared__ float sm_m[EXT_WARPS], sm_l[EXT_WARPS];
    __shared__ float sm_acc[EXT_WARPS][DPL * 32];
    const int h = blockIdx.x, row = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long rh = (long long)row * n_heads + h;
    bf16_t* const o = out + rh * head_dim;
    const int ctx = row_ctx[row];
    if (ctx <= 0) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = f2bf(0.f);
        return;
    }
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int kvh = h / (n_heads / n_kv_heads);
    const long long kv_w = (long long)n_kv_heads * head_dim;
    const int* bt = block_tables + row_bt[row];
    float qv[DPL], acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? bf2f(q[rh * head_dim + d]) : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int p = lo + warp; p < ctx; p += EXT_WARPS) {
        const int lb = p / block_size;
        const long long base = ((long long)bt[lb] * block_size + (p - lb * block_size)) * kv_w + (long long)kvh * head_dim;
        float kd[DPL], vd[DPL];
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            kd[i] = d < head_dim ? kv_get(k_cache, base + d, k_scale) : 0.f;
            vd[i] = d < head_dim ? kv_get(v_cache, base + d, v_scale) : 0.f;
        }
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) s += qv[i] * kd[i];
        s = warp_sum(s) * scale;
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        const float mn = fmaxf(m, s);
        const float c = expf(m - mn), pr = expf(s - mn);  // m = -inf at the first token: c = 0
        l = l * c + pr;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] = acc[i] * c + pr * vd[i];
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DPL; i++) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    // At least one token is visible (ctx >= 1, window >= 1), so some warp's max is finite.
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < EXT_WARPS; w++) mx = fmaxf(mx, sm_m[w]);
    const float sink = sinks ? sinks[h] : NEG_INF;
    mx = fmaxf(mx, sink);
    float L = sinks ? expf(sink - mx) : 0.f;
    float f[EXT_WARPS];
#pragma unroll
    for (int w = 0; w < EXT_WARPS; w++) {
        f[w] = expf(sm_m[w] - mx);  // a warp that saw no token: exp(-inf) = 0
        L += sm_l[w] * f[w];
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc_d = 0.f;
#pragma unroll
        for (int w = 0; w < EXT_WARPS; w++) acc_d += sm_acc[w][d] * f[w];
        o[d] = f2bf(acc_d / L);
    }
}

#define ATT_EXT_PARAMS                                                                                            \
    const bf16_t *__restrict__ q, const bf16_t *__restrict__ k_cache, const bf16_t *__restrict__ v_cache,         \
        bf16_t *__restrict__ out, const int *__restrict__ row_ctx, const int *__restrict__ row_bt,                \
        const int *__restrict__ block_tables, int n_heads, int n_kv_heads, int head_dim, int block_size,          \
        float scale, int window, float softcap, const float *__restrict__ sinks
#define ATT_EXT_BODY(DPL)                                                                                         \
    PDL_ENTER();                                                                                                  \
    attention_ext_body<DPL, bf16_t>(q, k_cache, v_cache, out, row_ctx, row_bt, block_tables, n_heads, n_kv_heads, \
                                    head_dim, block_size, scale, window, softcap, sinks, 1.f, 1.f);

// One kernel per head dims a lane holds (head_dim 1..256), index DPL - 1 in the kernel table.
extern "C" __global__ void paged_attention_ext_d1(ATT_EXT_PARAMS) { ATT_EXT_BODY(1) }
extern "C" __global__ void paged_attention_ext_d2(ATT_EXT_PARAMS) { ATT_EXT_BODY(2) }
extern "C" __global__ void paged_attention_ext_d3(ATT_EXT_PARAMS) { ATT_EXT_BODY(3) }
extern "C" __global__ void paged_attention_ext_d4(ATT_EXT_PARAMS) { ATT_EXT_BODY(4) }
extern "C" __global__ void paged_attention_ext_d5(ATT_EXT_PARAMS) { ATT_EXT_BODY(5) }
extern "C" __global__ void paged_attention_ext_d6(ATT_EXT_PARAMS) { ATT_EXT_BODY(6) }
extern "C" __global__ void paged_attention_ext_d7(ATT_EXT_PARAMS) { ATT_EXT_BODY(7) }
extern "C" __global__ void paged_attention_ext_d8(ATT_EXT_PARAMS) { ATT_EXT_BODY(8) }

// The same over an FP8 cache (index DPL - 1 in the kernel table's attention_ext_fp8).
#define ATT_EXT_FP8_PARAMS                                                                                        \
    const bf16_t *__restrict__ q, const unsigned char *__restrict__ k_cache,                                      \
        const unsigned char *__restrict__ v_cache, bf16_t *__restrict__ out, const int *__restrict__ row_ctx,     \
        const int *__restrict__ row_bt, const int *__restrict__ block_tables, int n_heads, int n_kv_heads,        \
        int head_dim, int block_size, float scale, int window, float softcap, const float *__restrict__ sinks,    \
        float k_scale, float v_scale
#define ATT_EXT_FP8_BODY(DPL)                                                                                     \
    PDL_ENTER();                                                                                                  \
    attention_ext_body<DPL, unsigned char>(q, k_cache, v_cache, out, row_ctx, row_bt, block_tables, n_heads,      \
                                           n_kv_heads, head_dim, block_size, scale, window, softcap, sinks,       \
                                           k_scale, v_scale);

extern "C" __global__ void paged_attention_ext_fp8_d1(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(1) }
extern "C" __global__ void paged_attention_ext_fp8_d2(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(2) }
extern "C" __global__ void paged_attention_ext_fp8_d3(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(3) }
extern "C" __global__ void paged_attention_ext_fp8_d4(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(4) }
extern "C" __global__ void paged_attention_ext_fp8_d5(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(5) }
extern "C" __global__ void paged_attention_ext_fp8_d6(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(6) }
extern "C" __global__ void paged_attention_ext_fp8_d7(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(7) }
extern "C" __global__ void paged_attention_ext_fp8_d8(ATT_EXT_FP8_PARAMS) { ATT_EXT_FP8_BODY(8) }
