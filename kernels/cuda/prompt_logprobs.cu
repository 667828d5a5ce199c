// Prompt logprobs on the device: for each row of the f32 logits the LM head left, the raw
// log-softmax value of one target token, its rank (1 + the number of entries above it) and
// the row's top entries (most likely first, ties by lower id), as
// baton_core::sampling::prompt_logprob computes them on the CPU. One CTA of PL_THREADS
// threads per row; only PL_OUT_WORDS words per row go back to the host, never the logits.
//
// Values are sanitised as they are read (NaN -> -inf, +inf -> FLT_MAX), as the CPU does.
// The normaliser is summed in f64 like the CPU's (the order differs, so it agrees to f64
// rounding, then is rounded to f32 the same way). The top entries are found by PL_MAX_TOP
// block-wide argmax passes, each over the entries ranked after the previous pick: k is at
// most 20 and the row stays in L2, and prompt logprobs are off the decode path.
//
// Layouts (mirrored by kernels/src/cuda/prompt_logprobs.rs):
//   targets[r] = the token whose logprob row r gives (checked below the vocabulary).
//   out[PL_OUT_WORDS * r + ...] = logprob bits, rank, top count, 0, ids[20], logprob bits[20].

#define PL_THREADS 512
#define PL_MAX_TOP 20
#define PL_OUT_WORDS (4 + 2 * PL_MAX_TOP)

__device__ __forceinline__ float pl_sanitize(float x) {
    // NaN compares false: it becomes -inf; +inf becomes the largest finite value.
    return x == x ? fminf(x, 3.402823466e38f) : NEG_INF;
}

// Whether (v, id) ranks before (bv, bid): larger value first, then lower id.
__device__ __forceinline__ bool pl_before(float v, int id, float bv, int bid) {
    return v > bv || (v == bv && id < bid);
}

// Block-wide best (v, id) by pl_before; every thread gets it.
__device__ __forceinline__ void pl_block_best(float& v, int& id, float* sv, int* sid) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (pl_before(ov, oid, v, id)) {
            v = ov;
            id = oid;
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        sid[warp] = id;
    }
    __syncthreads();
    v = NEG_INF;
    id = 0x7fffffff;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        if (pl_before(sv[w], sid[w], v, id)) {
            v = sv[w];
            id = sid[w];
        }
    }
}

__device__ __forceinline__ double pl_block_sum_d(double v, double* sd) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sd[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += sd[w];
    return t;
}

extern "C" __global__ __launch_bounds__(PL_THREADS) void prompt_logprobs(
    const float* __restrict__ logits, int vocab, const unsigned* __restrict__ targets, int k,
    unsigned* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int sid[32];
    __shared__ double sd[32];
    PDL_ENTER();
    const int r = blockIdx.x;
    const float* row = logits + (size_t)r * vocab;
    unsigned* o = out + (size_t)PL_OUT_WORDS * r;

    // The maximum (the first pick of the top list, too).
    float best = NEG_INF;
    int best_id = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float x = pl_sanitize(row[i]);
        if (pl_before(x, i, best, best_id)) {
            best = x;
            best_id = i;
        }
    }
    pl_block_best(best, best_id, sv, sid);
    const float mx = best;

    // The normaliser, and how many entries rank above the target.
    const float raw = pl_sanitize(row[targets[r]]);
    double sum = 0.0;
    double above = 0.0;
    if (mx != NEG_INF) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float x = pl_sanitize(row[i]);
            sum += exp((double)__fsub_rn(x, mx));
            above += x > raw ? 1.0 : 0.0;
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) above += pl_sanitize(row[i]) > raw ? 1.0 : 0.0;
    }
    sum = pl_block_sum_d(sum, sd);
    above = pl_block_sum_d(above, sd);
    const float log_sum = mx == NEG_INF ? 0.f : (float)log(sum);
    // LogSoftmax::logprob: (raw - max) - log_sum, -inf everywhere for an all -inf row.
    auto logprob = [&](float x) { return mx == NEG_INF ? NEG_INF : __fsub_rn(__fsub_rn(x, mx), log_sum); };
    if (threadIdx.x == 0) {
        o[0] = __float_as_uint(logprob(raw));
        o[1] = (unsigned)above + 1u;
        o[3] = 0u;
    }

    // The top list: pick j is the best entry ranked after pick j - 1.
    const int n_top = k < vocab ? k : vocab;
    float prev = best;
    int prev_id = best_id;
    for (int j = 0; j < n_top; ++j) {
        if (j > 0) {
            float v = NEG_INF;
            int id = 0x7fffffff;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float x = pl_sanitize(row[i]);
                if (pl_before(prev, prev_id, x, i) && pl_before(x, i, v, id)) {
                    v = x;
                    id = i;
                }
            }
            pl_block_best(v, id, sv, sid);
            prev = v;
            prev_id = id;
        }
        if (threadIdx.x == 0) {
            o[4 + j] = (unsigned)prev_id;
            o[4 + PL_MAX_TOP + j] = __float_as_uint(logprob(prev));
        }
    }
    if (threadIdx.x == 0) o[2] = (unsigned)n_top;
}
