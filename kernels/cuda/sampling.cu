// Sampling on the device: the pipeline of baton_core::sampling (its module doc is the
// definition), one CTA of SAMPLE_THREADS threads per row, on the f32 logits the LM head
// left on the device. The row is sanitised and processed in place; weights are recomputed
// from the processed row in every pass instead of being stored, so the raw value of any
// token not named by an op is still in the row when its logprob is wanted.
//
// Exactness: every f32 operation that the CPU sampler performs on a value (sanitise, the
// per-token ops, (x - m) / T, the polynomial exponential, the truncation comparisons) is
// written with the _rn intrinsics, which the compiler never contracts into FMAs, so the
// weights are bit-equal to the CPU's. The draw reproduces the CPU's f64 summation order
// exactly (blocks of 64 ids over 8 interleaved lanes, block sums added in id order by one
// thread), so the token equals the CPU's for the same u. What is only equal up to f64
// rounding, as on the CPU itself: the log-softmax normaliser and the top_p masses.
//
// Layouts (mirrored by kernels/src/cuda/sampling.rs):
//   rows[SAMPLE_ROW_WORDS * r + ...] = logit row, op start, op end, flags, temperature bits,
//       top_k, top_p bits, min_p bits, mask word offset, mask length in ids; flags bit 0
//       greedy, bit 1 logprobs, bit 2 grammar mask, bits 8.. top count.
//   masks[offset + id / 32] bit id % 32: the row's grammar allows id (step 5b); ids at or past
//       the mask length are not allowed.
//   ops[3 * i + ...] = token id, kind (0 bias, 1 mask, 2 repetition, 3 subtract), value bits;
//       sorted by id, each id's ops in pipeline order; op_raw[i] receives the raw logit of the
//       first op of each id.
//   out[SAMPLE_OUT_WORDS * r + ...] = token, logprob bits, top count, 0, ids[20], logprob bits[20].

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_ROW_WORDS 10
#define SAMPLE_OUT_WORDS 44
#define SAMPLE_MAX_TOP 20
#define CDF_BLOCK 64
#define MAX_CDF_BLOCKS 4096
#define FLT_MAX_BITS 0x7f7fffff

// Visits f(i, row[i]) for i = threadIdx.x, + SAMPLE_THREADS, ... < n, in that (ascending)
// order, loading S_SCAN values before using any: a batch's loads are in flight together
// instead of one memory round trip per element (a 128k-entry row is 125 elements a thread; as
// a plain strided loop the greedy pick alone took ~40 us at one row on an H100 under ncu).
#define S_SCAN 8
template <typename F>
__device__ __forceinline__ void s_scan_row(const float* row, int n, F f) {
    for (int base = threadIdx.x; base < n; base += S_SCAN * SAMPLE_THREADS) {
        float x[S_SCAN];
#pragma unroll
        for (int u = 0; u < S_SCAN; u++) {
            const int i = base + u * SAMPLE_THREADS;
            x[u] = i < n ? row[i] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < S_SCAN; u++) {
            const int i = base + u * SAMPLE_THREADS;
            if (i < n) f(i, x[u]);
        }
    }
}

__device__ __forceinline__ float s_sanitize(float x) {
    if (x != x) return NEG_INF;
    return x > __int_as_float(FLT_MAX_BITS) ? __int_as_float(FLT_MAX_BITS) : x;
}

// row_ops::exp_nonpositive, operation for operation (constants are the f32 bit patterns of
// the Rust constants, 1/6 etc. rounded as Rust rounds them).
__device__ __forceinline__ float s_exp_np(float x) {
    const float LN2_HI = __int_as_float(0x3f318000), LN2_LO = __int_as_float(0xb95e8083);
    const float MIN_X = __int_as_float(0xc2aeac50), LOG2E = __int_as_float(0x3fb8aa3b);
    const float ROUND = __int_as_float(0x4b400000);
    float clamped = x < MIN_X ? MIN_X : x;
    float shifted = __fadd_rn(__fmul_rn(clamped, LOG2E), ROUND);
    float n = __fsub_rn(shifted, ROUND);
    float r = __fsub_rn(__fsub_rn(clamped, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __fadd_rn(__int_as_float(0x3ab60b61), __fmul_rn(r, __int_as_float(0x39500d01)));
    p = __fadd_rn(__int_as_float(0x3c088889), __fmul_rn(r, p));
    p = __fadd_rn(__int_as_float(0x3d2aaaab), __fmul_rn(r, p));
    p = __fadd_rn(__int_as_float(0x3e2aaaab), __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    int n_int = (int)__float_as_uint(shifted) - (int)__float_as_uint(ROUND);
    float scale = __uint_as_float((unsigned)((n_int + 127) << 23));
    return x < MIN_X ? 0.f : __fmul_rn(p, scale);
}

// Order-preserving key of a non-NaN float; -0 and +0 share a key, as they compare equal.
__device__ __forceinline__ unsigned s_ord_key(float x) {
    if (x == 0.f) x = 0.f;
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide state of one row, in shared memory.
struct SampleShared {
    double big[MAX_CDF_BLOCKS];        // CDF block sums, or radix histograms (int / double)
    unsigned char positive[MAX_CDF_BLOCKS];
    double red_d[SAMPLE_WARPS];
    float red_f[SAMPLE_WARPS];
    int red_i[SAMPLE_WARPS];
    int top_ids[SAMPLE_MAX_TOP];
    float top_vals[SAMPLE_MAX_TOP];
    int n_found, found, seen, pick_block, last_block, digit;
    unsigned kth;
    double above;
    float tok_raw;
};

__device__ __forceinline__ double s_block_sum_d(SampleShared& s, double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) s.red_d[warp] = v;
    __syncthreads();
    double t = lane < SAMPLE_WARPS ? s.red_d[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// Max over the block with the lowest id among ties; every thread gets both.
__device__ __forceinline__ void s_block_argmax(SampleShared& s, float& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oid < id)) { v = ov; id = oid; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { s.red_f[warp] = v; s.red_i[warp] = id; }
    __syncthreads();
    v = lane < SAMPLE_WARPS ? s.red_f[lane] : NEG_INF;
    id = lane < SAMPLE_WARPS ? s.red_i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oid < id)) { v = ov; id = oid; }
    }
}

// Sum of v over the threads after this one (threadIdx order); T is int or double.
template <typename T>
__device__ __forceinline__ T s_suffix_excl(T* scratch, T v) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += y;
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = incl;
    __syncthreads();
    T later = 0;
    for (int w = warp + 1; w < SAMPLE_WARPS; w++) later += scratch[w];
    return later + incl - v;
}

// The k-th largest (1-based, k <= n) of key(i) over i < n, by a three-level radix select
// (11, 11 and 10 bits) with block-wide histograms: three passes over the row.
template <typename Key>
__device__ unsigned s_radix_kth(SampleShared& s, int n, int k, Key key) {
    int* hist = reinterpret_cast<int*>(s.big);
    unsigned prefix = 0, mask = 0;
#pragma unroll 1
    for (int level = 0; level < 3; level++) {
        const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0), bins = level == 2 ? 1024 : 2048;
        for (int b = threadIdx.x; b < bins; b += SAMPLE_THREADS) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            unsigned kk = key(i);
            if ((kk & mask) == prefix) atomicAdd(&hist[(kk >> shift) & (bins - 1)], 1);
        }
        __syncthreads();
        // Thread t owns bins 2t and 2t+1; counts above a bin are those of higher bins.
        int b0 = 2 * threadIdx.x, h0 = b0 < bins ? hist[b0] : 0, h1 = b0 + 1 < bins ? hist[b0 + 1] : 0;
        int above1 = s_suffix_excl<int>(s.red_i, h0 + h1);
        int above0 = above1 + h1;
        if (above1 < k && k <= above1 + h1 && h1 > 0) { s.digit = b0 + 1; s.n_found = k - above1; }
        if (above0 < k && k <= above0 + h0 && h0 > 0) { s.digit = b0; s.n_found = k - above0; }
        __syncthreads();
        prefix |= (unsigned)s.digit << shift;
        mask |= (unsigned)(bins - 1) << shift;
        k = s.n_found;
        __syncthreads();
    }
    return prefix;
}

// Walks ids in ascending order and stores in out[r - lo] the ids whose rank among the
// matching ones is r in [lo, hi); returns how many it stored. Tiles of SAMPLE_THREADS ids,
// stopping once rank hi is reached.
template <typename Pred>
__device__ int s_ordered_matches(SampleShared& s, int n, int lo, int hi, int* out, Pred pred) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) s.seen = 0;
    __syncthreads();
    for (int base = 0; base < n; base += SAMPLE_THREADS) {
        int i = base + threadIdx.x;
        bool m = i < n && pred(i);
        unsigned bal = __ballot_sync(0xffffffffu, m);
        if (lane == 0) s.red_i[warp] = __popc(bal);
        __syncthreads();
        int before = s.seen;
        for (int w = 0; w < warp; w++) before += s.red_i[w];
        int rank = before + __popc(bal & ((1u << lane) - 1u));
        if (m && rank >= lo && rank < hi) out[rank - lo] = i;
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int w = 0; w < SAMPLE_WARPS; w++) total += s.red_i[w];
            s.seen += total;
        }
        __syncthreads();
        if (s.seen >= hi) break;
    }
    int stored = min(s.seen, hi) - lo;
    __syncthreads();
    return stored < 0 ? 0 : stored;
}

// The weight of id i after temperature, top_k (kw), top_p (vstar, cut_id) and min_p.
struct SampleWeights {
    const float* row;
    float m, t, kw, vstar, minp;
    int cut_id;
    bool top_k, top_p;
    __device__ __forceinline__ float base(int i) const { return s_exp_np(__fdiv_rn(__fsub_rn(row[i], m), t)); }
    __device__ __forceinline__ float after_k(int i) const {
        float w = base(i);
        return (top_k && w < kw) ? 0.f : w;
    }
    __device__ __forceinline__ float operator()(int i) const {
        float w = after_k(i);
        if (top_p && (w < vstar || (w == vstar && i >= cut_id))) w = 0.f;
        if (w < minp) w = 0.f;
        return w;
    }
};

// top_p: finds the weight v* of the tie group holding the nucleus boundary and the id from
// which that group is cut (see the Rust doc of the CPU rule). Three radix levels over the
// weight bits with f64 mass histograms: at each level the boundary's bin is the lowest
// non-empty bin whose heavier mass is below p * W.
__device__ void s_top_p(SampleShared& s, int n, float p, SampleWeights& wts) {
    double* hist = s.big;
    unsigned prefix = 0, mask = 0;
    double target = 0.0;
    if (threadIdx.x == 0) s.above = 0.0;
    bool found = true;
    for (int level = 0; level < 3; level++) {
        const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0), bins = level == 2 ? 1024 : 2048;
        for (int b = threadIdx.x; b < bins; b += SAMPLE_THREADS) hist[b] = 0.0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            float w = wts.after_k(i);
            unsigned kk = __float_as_uint(w);
            if (w > 0.f && (kk & mask) == prefix) atomicAdd(&hist[(kk >> shift) & (bins - 1)], (double)w);
        }
        __syncthreads();
        int b0 = 2 * threadIdx.x;
        double h0 = b0 < bins ? hist[b0] : 0.0, h1 = b0 + 1 < bins ? hist[b0 + 1] : 0.0;
        if (level == 0) target = __dmul_rn((double)p, s_block_sum_d(s, h0 + h1));
        double above = s.above;
        double above1 = above + s_suffix_excl<double>(s.red_d, h0 + h1);
        double above0 = above1 + h1;
        if (threadIdx.x == 0) s.digit = 0x7fffffff;
        __syncthreads();
        int cand = 0x7fffffff;
        if (h1 > 0.0 && above1 < target) cand = b0 + 1;
        if (h0 > 0.0 && above0 < target) cand = b0;
        if (cand != 0x7fffffff) atomicMin(&s.digit, cand);
        __syncthreads();
        int d = s.digit;
        if (d == 0x7fffffff) { found = false; break; }
        if (d == b0 + 1) s.above = above1;
        if (d == b0) s.above = above0;
        __syncthreads();
        prefix |= (unsigned)d << shift;
        mask |= (unsigned)(bins - 1) << shift;
    }
    // No bin qualifies only when p * W <= 0: then the first token in rank order (the
    // argmax, weight exactly 1) is all that stays.
    float vstar = found ? __uint_as_float(prefix) : 1.0f;
    double before = found ? s.above : 0.0;
    __syncthreads();
    // Members of the group kept: the first j in id order, j the number whose preceding
    // mass before + i * v* is below the target (always at least the first).
    double need = found ? ceil((target - before) / (double)vstar) : 1.0;
    const float v = vstar;
    const SampleWeights& cw = wts;
    int cut = 0x7fffffff;
    int count_all = 0;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) count_all += cw.after_k(i) == v ? 1 : 0;
    count_all = s_suffix_excl<int>(s.red_i, count_all) + count_all;  // this thread and later
    if (threadIdx.x == 0) s.n_found = count_all;
    __syncthreads();
    int members = s.n_found;
    if (need < (double)members) {
        int j = need < 1.0 ? 1 : (int)need;
        if (j < members) {
            if (threadIdx.x == 0) s.found = 0x7fffffff;
            __syncthreads();
            s_ordered_matches(s, n, j, j + 1, &s.found, [&](int i) { return cw.after_k(i) == v; });
            cut = s.found;
        }
    }
    wts.vstar = vstar;
    wts.cut_id = cut;
    __syncthreads();
}

// One sum of CDF_BLOCK weights in row_ops::sum_f64's order: 8 interleaved f64 lanes over
// whole chunks of 8, combined ((0+4)+(2+6))+((1+5)+(3+7)), then the tail in order.
__device__ __forceinline__ double s_block_sum64(const SampleWeights& w, int start, int len) {
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int full = len / 8;
    for (int c = 0; c < full; c++) {
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = __dadd_rn(a[j], (double)w(start + 8 * c + j));
    }
    double lanes = __dadd_rn(__dadd_rn(__dadd_rn(a[0], a[4]), __dadd_rn(a[2], a[6])),
                             __dadd_rn(__dadd_rn(a[1], a[5]), __dadd_rn(a[3], a[7])));
    for (int i = 8 * full; i < len; i++) lanes = __dadd_rn(lanes, (double)w(start + i));
    return lanes;
}

// Inverse CDF exactly as row_ops::inverse_cdf; -1 when no weight is positive or the total
// is not finite.
__device__ int s_draw(SampleShared& s, int n, double u, const SampleWeights& w) {
    const int nblk = (n + CDF_BLOCK - 1) / CDF_BLOCK;
    for (int b = threadIdx.x; b < nblk; b += SAMPLE_THREADS) {
        int start = b * CDF_BLOCK;
        double sum = s_block_sum64(w, start, min(CDF_BLOCK, n - start));
        s.big[b] = sum;
        s.positive[b] = sum > 0.0 ? 1 : 0;
    }
    __syncthreads();
    // The running sum in id order, by one thread: the CPU's exact f64 sequence.
    if (threadIdx.x == 0) {
        double acc = 0.0;
        for (int b = 0; b < nblk; b++) {
            acc = __dadd_rn(acc, s.big[b]);
            s.big[b] = acc;
        }
        s.pick_block = 0x7fffffff;
        s.last_block = -1;
    }
    __syncthreads();
    double total = s.big[nblk - 1];
    if (!(total > 0.0 && total <= 1.7976931348623157e308)) return -1;
    double target = __dmul_rn(u, total);
    for (int b = threadIdx.x; b < nblk; b += SAMPLE_THREADS) {
        if (s.positive[b]) {
            atomicMax(&s.last_block, b);
            if (s.big[b] > target) atomicMin(&s.pick_block, b);
        }
    }
    __syncthreads();
    int token = -1;
    if (threadIdx.x == 0) {
        int b = s.pick_block;
        double before = 0.0;
        if (b == 0x7fffffff) {
            // u * total rounded up to total: the first positive weight of the last positive block.
            b = s.last_block;
            before = __longlong_as_double(0x7ff0000000000000LL);
            target = 0.0;
        } else if (b > 0) {
            before = s.big[b - 1];
        }
        if (b >= 0) {
            int start = b * CDF_BLOCK, end = min(start + CDF_BLOCK, n);
            for (int i = start; i < end; i++) {
                float x = w(i);
                if (x > 0.f) {
                    before = __dadd_rn(before, (double)x);
                    token = i;
                    if (before > target) break;
                }
            }
        }
        s.found = token;
    }
    __syncthreads();
    token = s.found;
    __syncthreads();
    return token;
}

extern "C" __global__ __launch_bounds__(SAMPLE_THREADS, 1) void sample_rows(
    float* __restrict__ logits, int vocab, const unsigned* __restrict__ rows, const double* __restrict__ us,
    const unsigned* __restrict__ ops, float* __restrict__ op_raw, const unsigned* __restrict__ masks,
    unsigned* __restrict__ out) {
    PDL_ENTER();
    __shared__ SampleShared s;
    const unsigned* rp = rows + (long long)blockIdx.x * SAMPLE_ROW_WORDS;
    float* row = logits + (long long)rp[0] * vocab;
    const int op_start = (int)rp[1], op_end = (int)rp[2];
    const unsigned flags = rp[3];
    const float temperature = __uint_as_float(rp[4]);
    const int top_k = (int)rp[5];
    const float top_p = __uint_as_float(rp[6]), min_p = __uint_as_float(rp[7]);
    const bool greedy = flags & 1u, want_lp = flags & 2u, masked = flags & 4u;
    const int n_top = (int)(flags >> 8);
    const int n = vocab;
    const unsigned* mask = masks + rp[8];
    const int mask_len = (int)rp[9];
    auto allowed = [&](int i) { return !masked || (i < mask_len && ((mask[i >> 5] >> (i & 31)) & 1u)); };

    // Step 0: sanitise in place; raw maximum and argmax, and the argmax among the ids the
    // grammar allows (the fallback token when processing leaves nothing).
    float best = NEG_INF, best_ok = NEG_INF;
    int best_id = 0x7fffffff, ok_id = 0x7fffffff;
    s_scan_row(row, n, [&](int i, float x) {
        const float c = s_sanitize(x);
        if (__float_as_uint(c) != __float_as_uint(x)) row[i] = c;
        if (c > best || best_id == 0x7fffffff) { best = c; best_id = i; }
        if (allowed(i) && (c > best_ok || ok_id == 0x7fffffff)) { best_ok = c; ok_id = i; }
    });
    s_block_argmax(s, best, best_id);
    // The sanitized row's maximum and argmax: step 6's result too when no op and no mask
    // changes the row.
    const float raw_max = best;
    const int raw_best_id = best_id;
    int raw_arg = raw_max == NEG_INF ? 0 : best_id;
    if (masked) {
        s_block_argmax(s, best_ok, ok_id);
        if (ok_id != 0x7fffffff) raw_arg = ok_id;
    }

    // Step 1: the raw log-softmax normaliser and the top entries.
    float log_sum = 0.f;
    int found_top = 0;
    if (want_lp) {
        double acc = 0.0;
        if (raw_max != NEG_INF)
            s_scan_row(row, n, [&](int, float x) { acc += (double)s_exp_np(__fsub_rn(x, raw_max)); });
        double sum = s_block_sum_d(s, acc);
        log_sum = raw_max == NEG_INF ? 0.f : (float)log(sum);
        if (n_top > 0) {
            unsigned kth = s_radix_kth(s, n, n_top, [&](int i) { return s_ord_key(row[i]); });
            if (threadIdx.x == 0) s.n_found = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
                float x = row[i];
                if (s_ord_key(x) > kth) {
                    int at = atomicAdd(&s.n_found, 1);
                    if (at < SAMPLE_MAX_TOP) { s.top_ids[at] = i; s.top_vals[at] = x; }
                }
            }
            __syncthreads();
            int greater = min(s.n_found, n_top);
            __syncthreads();
            int ties = s_ordered_matches(s, n, 0, n_top - greater, s.top_ids + greater,
                                         [&](int i) { return s_ord_key(row[i]) == kth; });
            found_top = greater + ties;
            if (threadIdx.x == 0) {
                for (int j = greater; j < found_top; j++) s.top_vals[j] = row[s.top_ids[j]];
                // Value descending, id ascending (at most 20 entries).
                for (int a = 1; a < found_top; a++) {
                    int id = s.top_ids[a];
                    float v = s.top_vals[a];
                    int b = a - 1;
                    while (b >= 0 && (s.top_vals[b] < v || (s.top_vals[b] == v && s.top_ids[b] > id))) {
                        s.top_ids[b + 1] = s.top_ids[b];
                        s.top_vals[b + 1] = s.top_vals[b];
                        b--;
                    }
                    s.top_ids[b + 1] = id;
                    s.top_vals[b + 1] = v;
                }
            }
            __syncthreads();
        }
    }

    // Steps 2-5: each id's ops, in order, by the thread holding its first op.
    for (int i = op_start + threadIdx.x; i < op_end; i += SAMPLE_THREADS) {
        const int id = (int)ops[3 * i];
        if (i != op_start && (int)ops[3 * (i - 1)] == id) continue;
        float x = row[id];
        op_raw[i] = x;
        for (int j = i; j < op_end && (int)ops[3 * j] == id; j++) {
            const unsigned kind = ops[3 * j + 1];
            const float v = __uint_as_float(ops[3 * j + 2]);
            if (kind == 0) x = s_sanitize(__fadd_rn(x, v));
            else if (kind == 1) x = NEG_INF;
            else if (kind == 2) x = s_sanitize(x > 0.f ? __fdiv_rn(x, v) : __fmul_rn(x, v));
            else x = s_sanitize(__fsub_rn(x, v));
        }
        row[id] = x;
    }
    __syncthreads();
    // Step 5b: the grammar mask.
    if (masked) {
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS)
            if (!allowed(i)) row[i] = NEG_INF;
        __syncthreads();
    }

    // Step 6: the processed argmax (the token when greedy); step 0's when nothing changed the
    // row since (the same scan over the same values: the same result, one pass fewer).
    if (op_start == op_end && !masked) {
        best = raw_max;
        best_id = raw_best_id;
    } else {
        best = NEG_INF;
        best_id = 0x7fffffff;
        s_scan_row(row, n, [&](int i, float c) {
            if (c > best || best_id == 0x7fffffff) { best = c; best_id = i; }
        });
        s_block_argmax(s, best, best_id);
    }
    int token;
    if (best == NEG_INF) {
        token = raw_arg;
    } else if (greedy) {
        token = best_id;
    } else {
        // Steps 7-8.
        SampleWeights w;
        w.row = row;
        w.m = best;
        w.t = temperature;
        w.kw = 0.f;
        w.vstar = 0.f;
        w.minp = min_p;
        w.cut_id = 0x7fffffff;
        w.top_k = top_k > 0;
        w.top_p = top_p < 1.f;
        if (w.top_k) w.kw = __uint_as_float(s_radix_kth(s, n, top_k, [&](int i) { return __float_as_uint(w.base(i)); }));
        if (w.top_p) s_top_p(s, n, top_p, w);
        int drawn = s_draw(s, n, us[blockIdx.x], w);
        token = drawn >= 0 ? drawn : best_id;
    }

    // The sampled token's raw logprob: its raw value is in the row unless an op changed it.
    if (want_lp) {
        // A token the mask removed is only ever the plain raw argmax (a mask allowing nothing).
        if (threadIdx.x == 0) s.tok_raw = allowed(token) ? row[token] : raw_max;
        __syncthreads();
        for (int i = op_start + threadIdx.x; i < op_end; i += SAMPLE_THREADS) {
            if ((int)ops[3 * i] == token && (i == op_start || (int)ops[3 * (i - 1)] != token)) s.tok_raw = op_raw[i];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        unsigned* o = out + (long long)blockIdx.x * SAMPLE_OUT_WORDS;
        o[0] = (unsigned)token;
        float lp = 0.f;
        if (want_lp) lp = raw_max == NEG_INF ? NEG_INF : __fsub_rn(__fsub_rn(s.tok_raw, raw_max), log_sum);
        o[1] = __float_as_uint(lp);
        o[2] = (unsigned)found_top;
        o[3] = 0u;
        for (int j = 0; j < SAMPLE_MAX_TOP; j++) {
            bool have = j < found_top;
            float v = have ? s.top_vals[j] : 0.f;
            o[4 + j] = have ? (unsigned)s.top_ids[j] : 0u;
            o[4 + SAMPLE_MAX_TOP + j] =
                __float_as_uint(have ? (raw_max == NEG_INF ? NEG_INF : __fsub_rn(__fsub_rn(v, raw_max), log_sum)) : 0.f);
        }
    }
}

// ids[pending[2 i]] = the token sample_rows picked for its row pending[2 i + 1], for i < n:
// a step planned before the previous step's tokens reached the host feeds them from here.
extern "C" __global__ void take_sampled_ids(const unsigned* __restrict__ out, const int* __restrict__ pending, int n,
                                            unsigned* __restrict__ ids) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ids[pending[2 * i]] = out[(long long)pending[2 * i + 1] * SAMPLE_OUT_WORDS];
}
