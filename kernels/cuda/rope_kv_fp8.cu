// RoPE + the KV write into an FP8 cache (compiled after rope_kv.cu, Family::RopeFp8).

// The four entries of rope_kv_bf16.cu writing an FP8 (E4M3) cache: the same rotation (and norm), then k
// and v quantized with the layer's k_scale and v_scale (see kv_put), each key less the layer's
// k_shift first (null: none; see kv_put_key). The caches are bytes.
extern "C" __global__ void rope_write_kv_fp8(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                             const bf16_t* __restrict__ v, unsigned char* __restrict__ k_cache,
                                             unsigned char* __restrict__ v_cache, const int* __restrict__ positions,
                                             const long long* __restrict__ slots, const double* __restrict__ inv_freq,
                                             int n_heads, int n_kv_heads, int head_dim, int rot_half, float cs_scale,
                                             float k_scale, float v_scale, const float* __restrict__ k_shift) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<false, unsigned char>(q, (long long)n_heads * head_dim, q, k, kv_w, k, v, kv_w, k_cache,
                                             v_cache, positions, slots, inv_freq, n_heads, n_kv_heads, head_dim,
                                             rot_half, cs_scale, QkNormArgs{nullptr, nullptr, 0.f, 0.f}, k_scale, v_scale, nullptr, k_shift);
}

extern "C" __global__ void rope_qkv_write_kv_fp8(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ q_out,
                                                 unsigned char* __restrict__ k_cache,
                                                 unsigned char* __restrict__ v_cache, const int* __restrict__ positions,
                                                 const long long* __restrict__ slots,
                                                 const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                                 int head_dim, int rot_half, float cs_scale, float k_scale, float v_scale, const float* __restrict__ k_shift) {
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<false, unsigned char>(qkv, stride, q_out, qkv + qd, stride, nullptr, qkv + qd + kvd, stride,
                                             k_cache, v_cache, positions, slots, inv_freq, n_heads, n_kv_heads,
                                             head_dim, rot_half, cs_scale, QkNormArgs{nullptr, nullptr, 0.f, 0.f}, k_scale,
                                             v_scale, nullptr, k_shift);
}

extern "C" __global__ void rope_qknorm_write_kv_fp8(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                                    const bf16_t* __restrict__ v, unsigned char* __restrict__ k_cache,
                                                    unsigned char* __restrict__ v_cache,
                                                    const int* __restrict__ positions,
                                                    const long long* __restrict__ slots,
                                                    const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                                    int head_dim, int rot_half, float cs_scale,
                                                    const bf16_t* __restrict__ q_w, const bf16_t* __restrict__ k_w,
                                                    float eps, float offset, float k_scale, float v_scale, const float* __restrict__ k_shift) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<true, unsigned char>(q, (long long)n_heads * head_dim, q, k, kv_w, k, v, kv_w, k_cache,
                                            v_cache, positions, slots, inv_freq, n_heads, n_kv_heads, head_dim,
                                            rot_half, cs_scale, QkNormArgs{q_w, k_w, eps, offset}, k_scale, v_scale, nullptr, k_shift);
}

extern "C" __global__ void rope_qkv_qknorm_write_kv_fp8(
    const bf16_t* __restrict__ qkv, bf16_t* __restrict__ q_out, unsigned char* __restrict__ k_cache,
    unsigned char* __restrict__ v_cache, const int* __restrict__ positions, const long long* __restrict__ slots,
    const double* __restrict__ inv_freq, int n_heads, int n_kv_heads, int head_dim, int rot_half, float cs_scale,
    const bf16_t* __restrict__ q_w, const bf16_t* __restrict__ k_w, float eps, float offset, float k_scale,
    float v_scale, const float* __restrict__ k_shift) {
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<true, unsigned char>(qkv, stride, q_out, qkv + qd, stride, nullptr, qkv + qd + kvd, stride,
                                            k_cache, v_cache, positions, slots, inv_freq, n_heads, n_kv_heads,
                                            head_dim, rot_half, cs_scale, QkNormArgs{q_w, k_w, eps, offset}, k_scale, v_scale, nullptr, k_shift);
}
