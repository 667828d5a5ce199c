// RoPE + the KV write into a bf16 cache: the four entries over rope_kv.cu's body (compiled after
// it, Family::Rope).

// Separate q (rows × n_heads × head_dim), k and v (rows × n_kv_heads × head_dim): q and k
// rotated in place.
extern "C" __global__ void rope_write_kv_bf16(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                              const bf16_t* __restrict__ v, bf16_t* __restrict__ k_cache,
                                              bf16_t* __restrict__ v_cache, const int* __restrict__ positions,
                                              const long long* __restrict__ slots,
                                              const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                              int head_dim, int rot_half, float cs_scale) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<false, bf16_t>(q, (long long)n_heads * head_dim, q, k, kv_w, k, v, kv_w, k_cache, v_cache, positions,
                              slots, inv_freq, n_heads, n_kv_heads, head_dim, rot_half, cs_scale,
                              QkNormArgs{nullptr, nullptr, 0.f, 0.f}, 1.f, 1.f);
}

// Rows [q | k | v] of the QKV projection: rotated q to q_out, rotated k and v to the cache only.
extern "C" __global__ void rope_qkv_write_kv_bf16(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ q_out,
                                                  bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                                  const int* __restrict__ positions,
                                                  const long long* __restrict__ slots,
                                                  const double* __restrict__ inv_freq, int n_heads,
                                                  int n_kv_heads, int head_dim, int rot_half, float cs_scale) {
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<false, bf16_t>(qkv, stride, q_out, qkv + qd, stride, nullptr, qkv + qd + kvd, stride, k_cache,
                              v_cache, positions, slots, inv_freq, n_heads, n_kv_heads, head_dim, rot_half, cs_scale,
                              QkNormArgs{nullptr, nullptr, 0.f, 0.f}, 1.f, 1.f);
}

// The two entries above with the per-head q/k RMSNorm before the rotation (QK_NORM): q_w and
// k_w are head_dim weights each, scaled by (offset + w). Blocks of round_up(head_dim / 2, 32).
extern "C" __global__ void rope_qknorm_write_kv_bf16(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                                     const bf16_t* __restrict__ v, bf16_t* __restrict__ k_cache,
                                                     bf16_t* __restrict__ v_cache, const int* __restrict__ positions,
                                                     const long long* __restrict__ slots,
                                                     const double* __restrict__ inv_freq, int n_heads,
                                                     int n_kv_heads, int head_dim, int rot_half, float cs_scale, const bf16_t* __restrict__ q_w,
                                                     const bf16_t* __restrict__ k_w, float eps, float offset) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<true, bf16_t>(q, (long long)n_heads * head_dim, q, k, kv_w, k, v, kv_w, k_cache, v_cache, positions,
                             slots, inv_freq, n_heads, n_kv_heads, head_dim, rot_half, cs_scale,
                             QkNormArgs{q_w, k_w, eps, offset}, 1.f, 1.f);
}

extern "C" __global__ void rope_qkv_qknorm_write_kv_bf16(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ q_out,
                                                         bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                                         const int* __restrict__ positions,
                                                         const long long* __restrict__ slots,
                                                         const double* __restrict__ inv_freq, int n_heads,
                                                         int n_kv_heads, int head_dim, int rot_half, float cs_scale, const bf16_t* __restrict__ q_w,
                                                         const bf16_t* __restrict__ k_w, float eps, float offset) {
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<true, bf16_t>(qkv, stride, q_out, qkv + qd, stride, nullptr, qkv + qd + kvd, stride, k_cache, v_cache,
                             positions, slots, inv_freq, n_heads, n_kv_heads, head_dim, rot_half, cs_scale,
                             QkNormArgs{q_w, k_w, eps, offset}, 1.f, 1.f);
}
