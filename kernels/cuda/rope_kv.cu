// RoPE ("rotate half" layout: element i pairs with i + head_dim/2) applied to q and k at
// each row's position, fused with the write of the rotated k and of v into the paged cache.
// Angles are position * inv_freq in f64 (the same inverse-frequency table as the CPU, which
// already holds the linear / Llama 3 scaling), so long positions keep their accuracy.
// One block per row; thread t owns frequency t % half for heads t / half, t / half + step, ...
// Cache layout per layer: [num_blocks * block_size slots][n_kv_heads][head_dim];
// slots[row] is the row's physical slot (block * block_size + offset); a negative slot marks
// a padding row (a CUDA-graph bucket's unused rows): rotated in place, written nowhere.

extern "C" __global__ void rope_write_kv_bf16(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                              const bf16_t* __restrict__ v, bf16_t* __restrict__ k_cache,
                                              bf16_t* __restrict__ v_cache, const int* __restrict__ positions,
                                              const long long* __restrict__ slots,
                                              const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                              int head_dim) {
    const int row = blockIdx.x;
    const int half = head_dim >> 1;
    const int i = threadIdx.x % half;
    const int h0 = threadIdx.x / half;
    const int hstep = blockDim.x / half;
    double sd, cd;
    sincos((double)positions[row] * inv_freq[i], &sd, &cd);
    const float s = (float)sd, c = (float)cd;
    bf16_t* qr = q + (long long)row * n_heads * head_dim;
    for (int h = h0; h < n_heads; h += hstep) {
        bf16_t* p = qr + h * head_dim;
        float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * c - b * s);
        p[i + half] = f2bf(b * c + a * s);
    }
    const long long kv_w = (long long)n_kv_heads * head_dim;
    const long long slot = slots[row];
    if (slot < 0) return;
    bf16_t* kr = k + row * kv_w;
    bf16_t* kc = k_cache + slot * kv_w;
    for (int h = h0; h < n_kv_heads; h += hstep) {
        bf16_t* p = kr + h * head_dim;
        float a = bf2f(p[i]), b = bf2f(p[i + half]);
        bf16_t ra = f2bf(a * c - b * s), rb = f2bf(b * c + a * s);
        p[i] = ra;
        p[i + half] = rb;
        kc[h * head_dim + i] = ra;
        kc[h * head_dim + i + half] = rb;
    }
    const bf16_t* vr = v + row * kv_w;
    bf16_t* vc = v_cache + slot * kv_w;
    for (int j = threadIdx.x; j < kv_w; j += blockDim.x) vc[j] = vr[j];
}
