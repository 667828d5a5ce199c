// FP8 KV scale calibration passes over RoPE + the KV write (compiled after rope_kv.cu,
// Family::RopeAmax).

// The four entries of rope_kv_bf16.cu as FP8 KV scale calibration passes (AMAX, see amax_put): the same
// inputs, rotation and norm; the largest stored |k| and |v| of the rows with a slot go to
// amax[0] and amax[1]; nothing is written but amax.
extern "C" __global__ void rope_write_kv_amax(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                              const bf16_t* __restrict__ v, float* __restrict__ amax,
                                              const int* __restrict__ positions, const long long* __restrict__ slots,
                                              const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                              int head_dim, int rot_half, float cs_scale) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<false, unsigned char, true>(q, (long long)n_heads * head_dim, nullptr, k, kv_w, nullptr, v, kv_w,
                                                   nullptr, nullptr, positions, slots, inv_freq, n_heads, n_kv_heads,
                                                   head_dim, rot_half, cs_scale, QkNormArgs{nullptr, nullptr, 0.f, 0.f},
                                                   1.f, 1.f, amax);
}

extern "C" __global__ void rope_qkv_write_kv_amax(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_out,
                                                  float* __restrict__ amax, const int* __restrict__ positions,
                                                  const long long* __restrict__ slots,
                                                  const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                                  int head_dim, int rot_half, float cs_scale) {
    (void)q_out;
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<false, unsigned char, true>(qkv, stride, nullptr, qkv + qd, stride, nullptr, qkv + qd + kvd,
                                                   stride, nullptr, nullptr, positions, slots, inv_freq, n_heads,
                                                   n_kv_heads, head_dim, rot_half, cs_scale,
                                                   QkNormArgs{nullptr, nullptr, 0.f, 0.f}, 1.f, 1.f, amax);
}

extern "C" __global__ void rope_qknorm_write_kv_amax(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                                     const bf16_t* __restrict__ v, float* __restrict__ amax,
                                                     const int* __restrict__ positions,
                                                     const long long* __restrict__ slots,
                                                     const double* __restrict__ inv_freq, int n_heads,
                                                     int n_kv_heads, int head_dim, int rot_half, float cs_scale,
                                                     const bf16_t* __restrict__ q_w, const bf16_t* __restrict__ k_w,
                                                     float eps, float offset) {
    const long long kv_w = (long long)n_kv_heads * head_dim;
    rope_write_kv_body<true, unsigned char, true>(q, (long long)n_heads * head_dim, nullptr, k, kv_w, nullptr, v, kv_w,
                                                  nullptr, nullptr, positions, slots, inv_freq, n_heads, n_kv_heads,
                                                  head_dim, rot_half, cs_scale, QkNormArgs{q_w, k_w, eps, offset}, 1.f,
                                                  1.f, amax);
}

extern "C" __global__ void rope_qkv_qknorm_write_kv_amax(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_out, float* __restrict__ amax,
    const int* __restrict__ positions, const long long* __restrict__ slots, const double* __restrict__ inv_freq,
    int n_heads, int n_kv_heads, int head_dim, int rot_half, float cs_scale, const bf16_t* __restrict__ q_w,
    const bf16_t* __restrict__ k_w, float eps, float offset) {
    (void)q_out;
    const long long qd = (long long)n_heads * head_dim, kvd = (long long)n_kv_heads * head_dim;
    const long long stride = qd + 2 * kvd;
    rope_write_kv_body<true, unsigned char, true>(qkv, stride, nullptr, qkv + qd, stride, nullptr, qkv + qd + kvd,
                                                  stride, nullptr, nullptr, positions, slots, inv_freq, n_heads,
                                                  n_kv_heads, head_dim, rot_half, cs_scale,
                                                  QkNormArgs{q_w, k_w, eps, offset}, 1.f, 1.f, amax);
}
