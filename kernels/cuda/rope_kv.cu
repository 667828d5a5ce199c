// RoPE ("rotate half" layout: element i pairs with i + head_dim/2) applied to q and k at
// each row's position, fused with the write of the rotated k and of v into the paged cache.
// Angles are position * inv_freq in f64 (the same inverse-frequency table as the CPU, which
// already holds the linear / Llama 3 scaling), so long positions keep their accuracy.
// Cache layout per layer: [num_blocks * block_size slots][n_kv_heads][head_dim];
// slots[row] is the row's physical slot (block * block_size + offset); a negative slot marks
// a padding row (a CUDA-graph bucket's unused rows): q rotated, nothing written to the cache.
//
// Inputs are read with a row stride, so the fused entry takes q, k and v straight from the
// QKV projection's rows [q | k | v] (no split copies) and writes only the rotated q out; the
// in-place entry keeps separate q/k/v buffers (rotated q and k written back).

// Grid (rows, n_heads + 2 * n_kv_heads) at decode, head_dim / 2 threads: CTA (row, y) rotates
// query head y (y < n_heads), rotates and caches key head y - n_heads (y < n_heads +
// n_kv_heads), or copies value head y - n_heads - n_kv_heads into the cache; thread i owns the
// pair (i, i + head_dim / 2). A prefill chunk's grid, and a decode batch's from 129 rows (rope.rs:
// ROPE_GROUPED_MIN_ROWS), has fewer y, each CTA looping over heads y, y + gridDim.y, ...
// (rope_write_kv_body). One pass per CTA and every head in parallel: at one row (decode at b = 1)
// a CTA per row looping over 40 heads took ~10 us, latency-bound. Eight heads per CTA (512
// threads) halved this kernel at 256 rows but, under programmatic dependent launch, made the
// attention kernel after it 3.7 ms a step slower at b=32 ctx 8k (its few long CTAs were
// placed unevenly beside the larger RoPE CTAs; BENCHMARKS.md): keep these CTAs small.
//
// q_in/q_out and k_in/k_out may alias (the in-place entry), hence no __restrict__ on them.
//
// QK_NORM (Qwen3, Gemma 3): before the rotation, each query and key head is RMS-normalized
// over its head_dim values and scaled by (norm_offset + w[j]) (q_norm for query heads, k_norm
// for key heads; offset 0, or 1 for Gemma's `1 + w` weights), in f32 with the rotation, so
// the normalized head is rounded to bf16 once. The head's sum of squares is a block reduction,
// so these CTAs have head_dim / 2 threads rounded up to a multiple of 32; the extra threads
// hold zeros and write nothing. Without QK_NORM the code is the plain kernel's.
// Heads a CTA loads up front (rope_write_kv_body): rope.rs's ROPE_HEADS_PER_CTA.
#define ROPE_MAX_HEADS 8

struct QkNormArgs {
    const bf16_t* q_w;
    const bf16_t* k_w;
    float eps;
    float offset;
};

// Partial rotary (Phi-4-mini, rot_half < head_dim / 2): only the first 2 * rot_half dims of a
// head rotate, in pairs (i, i + rot_half); the rest pass through. Thread i < rot_half owns a
// rotation pair, thread i >= rot_half the two pass-through elements 2i and 2i + 1, so the
// threads of a head still own disjoint elements (in place stays safe). rot_half = head_dim / 2
// is the full rotation.
// The cache write: kv_put (prelude.cuh).

// FP8 KV scale calibration (AMAX): the same rotation (and norm), but instead of writing, the
// largest |k| (as stored: rotated, rounded to bf16) and |v| over the rows with a slot are
// raised into amax[0] and amax[1] (zeroed by the caller); q, k and the cache are untouched.
// The maximum is taken on the bits: a non-negative float orders as an unsigned int, and a NaN
// (sign cleared) exceeds every finite value and infinity, so a NaN in K or V comes out NaN
// (the CPU reference's abs_max propagates it the same way). One atomic per warp.
__device__ __forceinline__ void amax_put(float* amax, float x) {
    const unsigned mask = __activemask();
    const unsigned m = __reduce_max_sync(mask, __float_as_uint(fabsf(x)));
    if ((threadIdx.x & 31) == (unsigned)(__ffs(mask) - 1)) atomicMax(reinterpret_cast<unsigned*>(amax), m);
}

// The head's norm weights, (offset + w) of the thread's two elements (query heads q_w, key
// heads k_w; nothing for value heads or without QK_NORM).
template <bool QK_NORM>
__device__ __forceinline__ void rope_norm_weights(const QkNormArgs& norm, int head, int n_heads, int n_kv_heads,
                                                  bool active, int e0, int e1, float* w0, float* w1) {
    if (QK_NORM && active && head < n_heads + n_kv_heads) {
        const bf16_t* nw = head < n_heads ? norm.q_w : norm.k_w;
        *w0 = norm.offset + bf2f(nw[e0]);
        *w1 = norm.offset + bf2f(nw[e1]);
    }
}

// The two input values of the thread for head `head` of row `row` (what rope_one_head then
// rotates, normalizes or stores): elements e0 and e1 of a query or key head, elements i and
// i + head_dim / 2 of a value head; zeros where the thread has nothing to read (a value head of
// a row without a slot, a thread past head_dim / 2 with QK_NORM, a query head in a calibration
// pass). Split from rope_one_head so that a CTA taking several heads issues every head's loads
// before its first store: q_in and q_out may alias, so the compiler cannot move a later
// head's loads above an earlier head's stores, and each head cost a full memory round trip.
template <bool QK_NORM, bool AMAX>
__device__ __forceinline__ void rope_load_head(int head, int row, int i, long long slot, const bf16_t* q_in,
                                               long long q_stride, const bf16_t* k_in, long long k_stride,
                                               const bf16_t* __restrict__ v_in, long long v_stride, int n_heads,
                                               int n_kv_heads, int head_dim, int rot_half, float* a, float* b) {
    *a = 0.f;
    *b = 0.f;
    if (AMAX && head < n_heads) return;
    const int half = head_dim >> 1;
    const bool active = !QK_NORM || i < half;
    if (!active) return;
    const bool rotating = i < rot_half;
    const int e0 = rotating ? i : 2 * i, e1 = rotating ? i + rot_half : 2 * i + 1;
    if (head >= n_heads + n_kv_heads) {
        if (slot < 0) return;
        const bf16_t* vr = v_in + row * v_stride + (head - n_heads - n_kv_heads) * head_dim;
        *a = bf2f(vr[i]);
        *b = bf2f(vr[i + half]);
    } else if (head < n_heads) {
        const bf16_t* qr = q_in + row * q_stride + head * head_dim;
        *a = bf2f(qr[e0]);
        *b = bf2f(qr[e1]);
    } else {
        const bf16_t* kr = k_in + row * k_stride + (head - n_heads) * head_dim;
        *a = bf2f(kr[e0]);
        *b = bf2f(kr[e1]);
    }
}

// One head of one row (see rope_write_kv_body), from the thread's two input values a, b
// (rope_load_head), the row's (c, s) for its pair and the head's norm weights w0, w1. Every
// thread of the CTA calls it for the same head (the norm's block reduction needs them all).
template <bool QK_NORM, typename C, bool AMAX>
__device__ __forceinline__ void rope_one_head(int head, int row, int i, long long slot, float c, float s, float w0,
                                              float w1, float a, float b, bf16_t* q_out, bf16_t* k_out,
                                              C* __restrict__ k_cache, C* __restrict__ v_cache, int n_heads,
                                              int n_kv_heads, int head_dim, int rot_half, QkNormArgs norm,
                                              float k_scale, float v_scale, float* amax,
                                              const float* __restrict__ k_shift) {
    // A calibration pass reads keys and values only.
    if (AMAX && head < n_heads) return;
    const int half = head_dim >> 1;
    const long long kv_w = (long long)n_kv_heads * head_dim;
    const bool active = !QK_NORM || i < half;
    const bool rotating = i < rot_half;
    const int e0 = rotating ? i : 2 * i, e1 = rotating ? i + rot_half : 2 * i + 1;
    if (head >= n_heads + n_kv_heads) {
        if (slot < 0 || !active) return;
        const int h = head - n_heads - n_kv_heads;
        if (AMAX) {
            amax_put(amax + 1, __uint_as_float(max(__float_as_uint(fabsf(a)), __float_as_uint(fabsf(b)))));
            return;
        }
        C* vc = v_cache + slot * kv_w + h * head_dim;
        // a and b are bf16 values widened (bf2f): their top half is the stored bits, NaNs included.
        kv_put(vc + i, (bf16_t)(__float_as_uint(a) >> 16), v_scale);
        kv_put(vc + i + half, (bf16_t)(__float_as_uint(b) >> 16), v_scale);
        return;
    }
    if (head < n_heads) {
        bf16_t* qo = q_out + ((long long)row * n_heads + head) * head_dim;
        if (QK_NORM) {
            // Every thread reaches the reduction (the branch is uniform over the CTA).
            const float inv = rsqrtf(block_sum(a * a + b * b) / (float)head_dim + norm.eps);
            if (!active) return;
            a *= inv * w0;
            b *= inv * w1;
        }
        // (c, s) = (1, 0) on pass-through elements: a and b unchanged.
        const bf16_t ra = f2bf(a * c - b * s), rb = f2bf(b * c + a * s);
        // The thread reads its elements before writing them, so in place (q_in == q_out) is safe.
        qo[e0] = ra;
        qo[e1] = rb;
        return;
    }
    const int h = head - n_heads;
    if (QK_NORM) {
        const float inv = rsqrtf(block_sum(a * a + b * b) / (float)head_dim + norm.eps);
        if (!active) return;
        a *= inv * w0;
        b *= inv * w1;
    }
    const bf16_t ra = f2bf(a * c - b * s), rb = f2bf(b * c + a * s);
    if (AMAX) {
        // fmaxf would drop a NaN: take the larger bits instead (both magnitudes, so NaN wins).
        if (slot >= 0) amax_put(amax, __uint_as_float(max(__float_as_uint(fabsf(bf2f(ra))), __float_as_uint(fabsf(bf2f(rb))))));
        return;
    }
    if (k_out) {
        bf16_t* ko = k_out + row * kv_w + h * head_dim;
        ko[e0] = ra;
        ko[e1] = rb;
    }
    if (slot >= 0) {
        C* kc = k_cache + slot * kv_w + h * head_dim;
        const long long at = (long long)h * head_dim;
        kv_put_key(kc + e0, ra, k_scale, k_shift_at(k_shift, at + e0));
        kv_put_key(kc + e1, rb, k_scale, k_shift_at(k_shift, at + e1));
    }
}

// CTA (row, y) takes heads y, y + gridDim.y, ... of that row: one head at decode (gridDim.y =
// every head), several for a prefill chunk, whose rows then compute their angles (an f64
// sincos a pair) once for several heads instead of once a head (see rope.rs).
template <bool QK_NORM, typename C, bool AMAX = false>
__device__ __forceinline__ void rope_write_kv_body(const bf16_t* q_in, long long q_stride, bf16_t* q_out,
                                                   const bf16_t* k_in, long long k_stride, bf16_t* k_out,
                                                   const bf16_t* __restrict__ v_in, long long v_stride,
                                                   C* __restrict__ k_cache, C* __restrict__ v_cache,
                                                   const int* __restrict__ positions,
                                                   const long long* __restrict__ slots,
                                                   const double* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                                   int head_dim, int rot_half, float cs_scale, QkNormArgs norm,
                                                   float k_scale, float v_scale, float* amax = nullptr,
                                                   const float* __restrict__ k_shift = nullptr) {
    const int row = blockIdx.x;
    const int first = blockIdx.y, total = n_heads + 2 * n_kv_heads;
    const int i = threadIdx.x;
    // A calibration pass's CTA of query heads only leaves at once (nothing to read or wait for).
    if (AMAX && first + (int)gridDim.y * ((total - 1 - first) / (int)gridDim.y) < n_heads) return;
    // Every thread is active without QK_NORM (the block is exactly head_dim / 2 threads).
    const bool active = !QK_NORM || i < (head_dim >> 1);
    const bool rotating = i < rot_half;
    const int e0 = rotating ? i : 2 * i, e1 = rotating ? i + rot_half : 2 * i + 1;
    // The first head's norm weights, loaded before the PDL wait: weights are never written during
    // a step, and from DRAM this load would be a second round trip after the reduction. Only
    // these: moving the position, slot and angle before the wait too made the step 7 % slower
    // at 8 rows of 1k on an H100 (the attention kernel after this one; BENCHMARKS.md, session
    // 15), as other changes to this kernel's shape did before.
    float w0 = 0.f, w1 = 0.f;
    rope_norm_weights<QK_NORM>(norm, first, n_heads, n_kv_heads, active, e0, e1, &w0, &w1);
    PDL_ENTER();
    const long long slot = slots[row];
    float s = 0.f, c = 1.f;
    // Value heads come last, so a CTA whose first head is a value head rotates nothing.
    if (first < n_heads + n_kv_heads && active && rotating) {
        double sd, cd;
        sincos((double)positions[row] * inv_freq[i], &sd, &cd);
        // cs_scale: YaRN's / LongRoPE's attention factor on cos and sin (1 otherwise); it
        // scales only the rotated dims, as transformers' does.
        s = (float)sd * cs_scale;
        c = (float)cd * cs_scale;
    }
    // Every head's inputs first (up to ROPE_MAX_HEADS a CTA, what rope.rs launches), then the
    // rotations and stores; a CTA given more heads loads each just before it.
    const int count = (total - first + (int)gridDim.y - 1) / (int)gridDim.y;
    if (count <= ROPE_MAX_HEADS) {
        float a[ROPE_MAX_HEADS], b[ROPE_MAX_HEADS];
#pragma unroll
        for (int j = 0; j < ROPE_MAX_HEADS; j++)
            if (j < count)
                rope_load_head<QK_NORM, AMAX>(first + j * (int)gridDim.y, row, i, slot, q_in, q_stride, k_in, k_stride,
                                              v_in, v_stride, n_heads, n_kv_heads, head_dim, rot_half, &a[j], &b[j]);
#pragma unroll
        for (int j = 0; j < ROPE_MAX_HEADS; j++) {
            if (j < count) {
                const int head = first + j * (int)gridDim.y;
                if (j > 0) rope_norm_weights<QK_NORM>(norm, head, n_heads, n_kv_heads, active, e0, e1, &w0, &w1);
                rope_one_head<QK_NORM, C, AMAX>(head, row, i, slot, c, s, w0, w1, a[j], b[j], q_out, k_out, k_cache,
                                                 v_cache, n_heads, n_kv_heads, head_dim, rot_half, norm, k_scale,
                                                 v_scale, amax, k_shift);
            }
        }
        return;
    }
    for (int head = first; head < total; head += gridDim.y) {
        if (head != first) rope_norm_weights<QK_NORM>(norm, head, n_heads, n_kv_heads, active, e0, e1, &w0, &w1);
        float a, b;
        rope_load_head<QK_NORM, AMAX>(head, row, i, slot, q_in, q_stride, k_in, k_stride, v_in, v_stride, n_heads,
                                      n_kv_heads, head_dim, rot_half, &a, &b);
        rope_one_head<QK_NORM, C, AMAX>(head, row, i, slot, c, s, w0, w1, a, b, q_out, k_out, k_cache, v_cache,
                                         n_heads, n_kv_heads, head_dim, rot_half, norm, k_scale, v_scale, amax,
                                         k_shift);
    }
}

// The entries: rope_kv_bf16.cu (a bf16 cache), rope_kv_fp8.cu (an FP8 cache), rope_kv_amax.cu (FP8
// KV scale calibration), each compiled after this file in a module of its own (compile.rs).
