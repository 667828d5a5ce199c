// Mixture-of-experts kernels around the expert GEMMs (references in kernels/src/cpu/moe.rs):
// routing (each token's top-k experts and weights), the permutation that groups the
// token-expert assignments by expert, one grouped GEMV over the experts in use, and the
// un-permute that sums each token's expert outputs with its weights plus a shared expert.
// Routing and permutation also come as one launch for decode-sized steps (moe_route_permute);
// the decode-sized grouped product over the experts in use, with the activation fused, is in
// moe_skinny.cu (compiled after this file, in the same module).
//
// An assignment is (token row, choice j), index a = row * k + j. ids/weights are rows x k.
// The permutation is stable (by expert, then by assignment index), like the CPU's, so its
// order is a pure function of the ids.

#define MOE_MAX_EXPERTS 256
#define MOE_PER_LANE (MOE_MAX_EXPERTS / 32)
#define MOE_MAX_K 32

// One warp per token row (blockDim.x / 32 rows per CTA). Lane l holds experts l, l + 32, ...
// (coalesced loads). Top-k on the logits (softmax and sigmoid are monotone): k rounds of a
// warp argmax, ties to the lower expert index; the score of the chosen expert is its softmax
// over all experts or its sigmoid, renormalized over the k when asked, times scale. Lane j
// keeps choice j and writes it at the end (k <= 32).
__device__ __forceinline__ void moe_route_row(const float* __restrict__ logits, int row, int n_experts, int k,
                                              int sigmoid, int renormalize, float scale, int* ids, float* weights) {
    const int lane = threadIdx.x & 31;
    const float* lr = logits + (long long)row * n_experts;
    float v[MOE_PER_LANE];
    float m = NEG_INF;
#pragma unroll
    for (int t = 0; t < MOE_PER_LANE; t++) {
        const int e = lane + 32 * t;
        v[t] = e < n_experts ? lr[e] : NEG_INF;
        m = fmaxf(m, v[t]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float z = 0.f;
    if (!sigmoid) {
#pragma unroll
        for (int t = 0; t < MOE_PER_LANE; t++)
            if (lane + 32 * t < n_experts) z += expf(v[t] - m);
        z = warp_sum(z);
    }
    unsigned taken = 0;
    float mine = 0.f, sum = 0.f;
    int mine_id = 0;
    for (int j = 0; j < k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int t = 0; t < MOE_PER_LANE; t++) {
            const int e = lane + 32 * t;
            if (e < n_experts && !((taken >> t) & 1u) && (v[t] > bv || (v[t] == bv && e < bi))) {
                bv = v[t];
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        // k <= n_experts, so some expert is left; only NaN logits (never greater than
        // anything) leave bi unset. Such a row takes expert j with a NaN weight, so its output
        // is NaN as its input was, and every id stays in range: the permutation places it and
        // the un-permute never reads a position the permutation did not write.
        if (bi >= n_experts) bi = j;
        // Its lane marks it taken.
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        const float score = sigmoid ? 1.f / (1.f + expf(-bv)) : expf(bv - m) / z;
        sum += score;
        if (lane == j) {
            mine = score;
            mine_id = bi;
        }
    }
    if (lane < k) {
        ids[(long long)row * k + lane] = mine_id;
        weights[(long long)row * k + lane] = (renormalize ? mine / sum : mine) * scale;
    }
}

extern "C" __global__ void moe_route_f32(const float* __restrict__ logits, int rows, int n_experts, int k,
                                         int sigmoid, int renormalize, float scale, int* __restrict__ ids,
                                         float* __restrict__ weights) {
    PDL_ENTER();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    moe_route_row(logits, row, n_experts, k, sigmoid, renormalize, scale, ids, weights);
}

// The inclusive prefix sum of v over the lanes of the calling warp (every lane calls it).
__device__ __forceinline__ int moe_warp_incl_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// The exclusive prefix of the per-expert counts in cursor (shared) into cursor and offsets
// (n_experts + 1 values, the last the total), by one warp (every lane calls it): lane l sums
// experts 8l .. 8l + 7, a shuffle scan over the lanes, then each lane writes its 8 (a serial loop
// over 128 experts by one thread cost microseconds of dependent shared-memory round trips).
__device__ __forceinline__ void moe_scan_offsets(int* cursor, int n_experts, int* __restrict__ offsets) {
    constexpr int PER = MOE_MAX_EXPERTS / 32;
    const int lane = threadIdx.x & 31;
    int c[PER];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane * PER + i;
        c[i] = e < n_experts ? cursor[e] : 0;
        sum += c[i];
    }
    const int incl = moe_warp_incl_scan(sum);
    int acc = incl - sum;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane * PER + i;
        if (e < n_experts) {
            cursor[e] = acc;
            offsets[e] = acc;
        }
        acc += c[i];
    }
    if (lane == 31) offsets[n_experts] = incl;
}

// One CTA (any multiple of 32 threads up to 1,024, 1,024 best). Warp w owns a contiguous slice
// of the n ids (whole groups of 32) and counts, per expert, the ids of its slice in its own row of
// a [warp][expert] table (__match_any_sync groups a group's equal ids; the lowest lane of each
// group adds the group's size, so no atomics). Each expert's total gives the exclusive prefix in
// offsets (n_experts + 1, a warp scan); the table's rows become each warp's first position per
// expert (the expert's offset plus the counts of the warps before). Then each warp walks its
// slice again and places id i at its expert's running position plus its rank among the group's
// lower lanes, so the placement is stable (by expert, then by assignment index): order[p] = i and
// position[i] = p. An id outside [0, n_experts) is never placed (the segments then cover fewer
// than n entries; moe_route never writes one).
// Each id is read twice and placed once. The form before (sessions 11-17) scanned every 32 ids
// once per expert, n_experts / 32 ballots per id: route + permute took 174 us a layer at a
// 2,048-token Qwen3-30B-A3B prefill (16,384 ids, 128 experts), 25 us now (H100, 7111dd2;
// BENCHMARKS.md).
// The body is shared with moe_route_permute, which writes ids in the same launch: so ids is
// not __restrict__ here (no read-only-cache loads of data this grid wrote).
__device__ __forceinline__ void moe_permute_body(const int* ids, int n, int n_experts, int* __restrict__ offsets,
                                                 int* __restrict__ order, int* __restrict__ position) {
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];
    __shared__ int table[32][MOE_MAX_EXPERTS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    // Warp w's slice [lo, hi): whole groups of 32, in index order across the warps.
    const int per_warp = ((n + warps - 1) / warps + 31) & ~31;
    const int lo = min(n, warp * per_warp), hi = min(n, lo + per_warp);
    for (int e = lane; e < n_experts; e += 32) table[warp][e] = 0;
    __syncwarp();
    for (int i0 = lo; i0 < hi; i0 += 32) {
        const int i = i0 + lane;
        const int e = i < hi ? ids[i] : -1;
        const bool valid = (unsigned)e < (unsigned)n_experts;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (valid && (peers & below) == 0) table[warp][e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    for (int e = tid; e < n_experts; e += blockDim.x) {
        int total = 0;
        for (int w = 0; w < warps; w++) total += table[w][e];
        cursor[e] = total;
    }
    __syncthreads();
    if (warp == 0) moe_scan_offsets(cursor, n_experts, offsets);
    __syncthreads();
    for (int e = tid; e < n_experts; e += blockDim.x) {
        int run = cursor[e];
        for (int w = 0; w < warps; w++) {
            const int c = table[w][e];
            table[w][e] = run;
            run += c;
        }
    }
    __syncthreads();
    for (int i0 = lo; i0 < hi; i0 += 32) {
        const int i = i0 + lane;
        const int e = i < hi ? ids[i] : -1;
        const bool valid = (unsigned)e < (unsigned)n_experts;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int first = valid ? table[warp][e] : 0;
        __syncwarp();
        if (valid) {
            const int p = first + __popc(peers & below);
            order[p] = i;
            position[i] = p;
            if ((peers & below) == 0) table[warp][e] = first + __popc(peers);
        }
        __syncwarp();
    }
}

extern "C" __global__ __launch_bounds__(1024) void moe_permute(const int* __restrict__ ids, int n, int n_experts,
                                                               int* __restrict__ offsets, int* __restrict__ order,
                                                               int* __restrict__ position) {
    PDL_ENTER();
    moe_permute_body(ids, n, n_experts, offsets, order, position);
}

// Routing and permutation in one launch, for steps of few rows (decode), where each is a
// launch of a few microseconds of mostly fixed cost: one CTA of 1,024 threads, warp w routes
// rows w, w + 32, ... as moe_route_f32 does, then (after a barrier, which makes the CTA's
// global writes visible to all its threads) the CTA permutes as moe_permute does. Outputs are
// identical to the two launches'.
extern "C" __global__ __launch_bounds__(1024) void moe_route_permute(const float* __restrict__ logits, int rows,
                                                                     int n_experts, int k, int sigmoid,
                                                                     int renormalize, float scale, int* ids,
                                                                     float* __restrict__ weights,
                                                                     int* __restrict__ offsets,
                                                                     int* __restrict__ order,
                                                                     int* __restrict__ position) {
    PDL_ENTER();
    const int warps = blockDim.x >> 5;
    for (int row = threadIdx.x >> 5; row < rows; row += warps)
        moe_route_row(logits, row, n_experts, k, sigmoid, renormalize, scale, ids, weights);
    __syncthreads();
    moe_permute_body(ids, rows * k, n_experts, offsets, order, position);
}

#define MOE_GEMV_ROWS 8

// out[p, c] = x[src(p)] . w[e, c] for every permuted entry p of expert e (blockIdx.y) and
// column c (one warp per column, blockDim.x / 32 columns per CTA), src(p) = order[p] / k when
// per_token (x has one row per token: the first projection reads the hidden states directly),
// else p (x is already in permuted order). w is n_experts x n x d (HF [out, in] rows), d % 8 == 0.
// An expert with no entries returns at once, so only the experts in use are read; a column's
// weights are read once per MOE_GEMV_ROWS rows of its expert (once per step at decode sizes),
// 16 bytes per lane. f32 accumulation, plus bias[e, c] when bias is given (gpt-oss), bf16 out.
extern "C" __global__ void moe_grouped_gemv_bf16(const bf16_t* __restrict__ x, int per_token, int k,
                                                 const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
                                                 const int* __restrict__ offsets, const int* __restrict__ order,
                                                 bf16_t* __restrict__ out, int n, int d) {
    PDL_ENTER();
    const int e = blockIdx.y;
    const int begin = offsets[e], end = offsets[e + 1];
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (begin >= end || col >= n) return;
    const bf16_t* wr = w + ((long long)e * n + col) * d;
    const float b = bias ? bf2f(bias[(long long)e * n + col]) : 0.f;
    for (int r0 = begin; r0 < end; r0 += MOE_GEMV_ROWS) {
        const int nr = min(MOE_GEMV_ROWS, end - r0);
        const bf16_t* xr[MOE_GEMV_ROWS];
        float acc[MOE_GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < MOE_GEMV_ROWS; j++) {
            const int p = r0 + (j < nr ? j : 0);
            xr[j] = x + (long long)(per_token ? order[p] / k : p) * d;
            acc[j] = 0.f;
        }
        for (int i = lane * 8; i < d; i += 256) {
            const uint4 wv = *reinterpret_cast<const uint4*>(wr + i);
            const unsigned ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int j = 0; j < MOE_GEMV_ROWS; j++) {
                if (j < nr) {
                    const uint4 xv = *reinterpret_cast<const uint4*>(xr[j] + i);
                    const unsigned xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        acc[j] += __uint_as_float(xw[q] << 16) * __uint_as_float(ww[q] << 16) +
                                  __uint_as_float(xw[q] & 0xffff0000u) * __uint_as_float(ww[q] & 0xffff0000u);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < MOE_GEMV_ROWS; j++) {
            const float s = warp_sum(acc[j]) + b;
            if (j < nr && lane == j) out[(long long)(r0 + j) * n + col] = f2bf(s);
        }
    }
}

// The same product as moe_grouped_gemv_bf16 on the tensor cores, for steps where each expert
// has many entries (prefill): a CTA computes a 64 x 64 tile of out (64 entries of one expert
// by 64 columns) with 4 warps of 16 entries each, mma.sync m16n8k16 bf16 -> f32. Tiles of x
// (gathered through order when per_token) and of w go to shared memory by 16-byte cp.async,
// two stages of 32 inputs (d % 32 == 0), rows padded to 40 elements so the 8 rows of every
// ldmatrix phase fall in distinct 16-byte bank groups. Grid (ceil(n / 64), tiles): tile t is
// found by walking the experts' entry counts (ceil(count / 64) tiles each), and a CTA past the
// last tile returns; entries past the expert's segment and columns past n are zero-filled and
// never stored.
#define MOE_GM_BM 64
#define MOE_GM_BN 64
#define MOE_GM_BK 32
#define MOE_GM_RS (MOE_GM_BK + 8)

__device__ __forceinline__ unsigned moe_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void moe_cp16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void moe_ldsm4(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void moe_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ __launch_bounds__(128) void moe_grouped_gemm_bf16(
    const bf16_t* __restrict__ x, int per_token, int k, const bf16_t* __restrict__ w, const bf16_t* __restrict__ bias,
    const int* __restrict__ offsets, const int* __restrict__ order, bf16_t* __restrict__ out, int n, int d,
    int n_experts) {
    PDL_ENTER();
    __shared__ __align__(16) bf16_t xs[2][MOE_GM_BM * MOE_GM_RS];
    __shared__ __align__(16) bf16_t ws[2][MOE_GM_BN * MOE_GM_RS];
    int t = blockIdx.y, e = 0, begin = 0, end = 0;
    for (; e < n_experts; e++) {
        const int b0 = offsets[e], b1 = offsets[e + 1];
        const int tiles = (b1 - b0 + MOE_GM_BM - 1) / MOE_GM_BM;
        if (t < tiles) {
            begin = b0 + t * MOE_GM_BM;
            end = b1;
            break;
        }
        t -= tiles;
    }
    if (e == n_experts) return;
    const int col0 = blockIdx.x * MOE_GM_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Copies: each thread moves chunks tid and tid + 128 (row c / 4, 8 inputs c % 4) of the x
    // tile and of the w tile per stage.
    const bf16_t* xsrc[2];
    const bf16_t* wsrc[2];
    bool xok[2], wok[2];
    unsigned xdst[2], wdst[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = tid + 128 * i, r = c >> 2, part = c & 3;
        const int p = begin + r;
        xok[i] = p < end;
        xsrc[i] = x + (xok[i] ? (long long)(per_token ? order[p] / k : p) * d : 0) + part * 8;
        const int col = col0 + r;
        wok[i] = col < n;
        wsrc[i] = w + (wok[i] ? ((long long)e * n + col) * d : 0) + part * 8;
        xdst[i] = (unsigned)((r * MOE_GM_RS + part * 8) * 2);
        wdst[i] = xdst[i];
    }
    auto load = [&](int k0, int s) {
        const unsigned xb = moe_smem(xs[s]), wb = moe_smem(ws[s]);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            moe_cp16(xb + xdst[i], xsrc[i] + k0, xok[i]);
            moe_cp16(wb + wdst[i], wsrc[i] + k0, wok[i]);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    float acc[MOE_GM_BN / 8][4];
#pragma unroll
    for (int j = 0; j < MOE_GM_BN / 8; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[j][q] = 0.f;
    const int nk = d / MOE_GM_BK;
    load(0, 0);
    for (int kt = 0; kt < nk; kt++) {
        if (kt + 1 < nk) {
            load((kt + 1) * MOE_GM_BK, (kt + 1) & 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const unsigned xa = moe_smem(xs[kt & 1]), wb = moe_smem(ws[kt & 1]);
#pragma unroll
        for (int kk = 0; kk < MOE_GM_BK; kk += 16) {
            // A: rows 16 warp + (lane & 15), inputs kk + 8 (lane >> 4): a0..a3 in mma order.
            unsigned a[4];
            moe_ldsm4(xa + (unsigned)(((warp * 16 + (lane & 15)) * MOE_GM_RS + kk + (lane >> 4) * 8) * 2), a);
#pragma unroll
            for (int np = 0; np < MOE_GM_BN / 16; np++) {
                // B: w rows (columns of out) np * 16 + ..., as K in prefill.cu's Q K^T.
                unsigned b[4];
                moe_ldsm4(wb + (unsigned)(((np * 16 + (lane >> 4) * 8 + (lane & 7)) * MOE_GM_RS + kk +
                                           ((lane >> 3) & 1) * 8) * 2),
                          b);
                moe_mma(acc[2 * np], a, b[0], b[1]);
                moe_mma(acc[2 * np + 1], a, b[2], b[3]);
            }
        }
        // Every warp is done with this stage before the next iteration's copy refills it.
        __syncthreads();
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int j = 0; j < MOE_GM_BN / 8; j++) {
        const int col = col0 + j * 8 + 2 * tq;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int p = begin + warp * 16 + g + 8 * h;
            if (p >= end) continue;
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int c = col + q;
                if (c < n) {
                    const float b = bias ? bf2f(bias[(long long)e * n + c]) : 0.f;
                    out[(long long)p * n + c] = f2bf(acc[j][2 * h + q] + b);
                }
            }
        }
    }
}

// out[r, i] = shared[r, i] (when given) + sum_j weights[r k + j] * y[position[r k + j], i]: one
// CTA per token row, f32 sum in a fixed order (deterministic, no atomics), bf16 out.
// One output of the un-permute, before its bf16 rounding: shared[row, i] (when given) plus
// the k weighted expert outputs in choice order. Shared by moe_unpermute_bf16 and the down
// product's fused un-permute (moe_skinny.cu), so both round the same sums the same way. y is
// read through L2 (ld.global.cg): in the fused kernel other CTAs of the same grid wrote it.
__device__ __forceinline__ float moe_unpermute_at(const bf16_t* y, const int* __restrict__ position,
                                                  const float* __restrict__ weights, int k,
                                                  const bf16_t* __restrict__ shared, long long row, int d, int i) {
    float acc = shared ? bf2f(shared[row * d + i]) : 0.f;
    for (int j = 0; j < k; j++)
        acc += weights[row * k + j] * bf2f(__ldcg(y + (long long)position[row * k + j] * d + i));
    return acc;
}

extern "C" __global__ void moe_unpermute_bf16(const bf16_t* __restrict__ y, const int* __restrict__ position,
                                              const float* __restrict__ weights, int k,
                                              const bf16_t* __restrict__ shared, bf16_t* __restrict__ out, int d) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[row * d + i] = f2bf(moe_unpermute_at(y, position, weights, k, shared, row, d, i));
}

// gpt-oss's clamped SwiGLU of one (gate, up) pair, shared by the kernel below and the fused
// grouped GEMV (so the two round identically).
__device__ __forceinline__ float moe_clamped_swiglu(float gate, float up, float alpha, float limit) {
    const float g = fminf(gate, limit);
    const float u = fminf(fmaxf(up, -limit), limit);
    return (u + 1.f) * g / (1.f + expf(-alpha * g));
}

// gpt-oss's expert activation over rows of 2d interleaved [gate, up] pairs (gate_up[r, 2i] is
// gate i, gate_up[r, 2i + 1] up i): gate clamped above at limit, up to [-limit, limit],
// out[r, i] = (up + 1) * gate * sigmoid(alpha * gate).
extern "C" __global__ void clamped_swiglu_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, int d,
                                               long long total, float alpha, float limit) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / d, c = i - r * d;
        const unsigned pair = *reinterpret_cast<const unsigned*>(gate_up + r * 2 * d + 2 * c);
        out[i] = f2bf(moe_clamped_swiglu(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u), alpha, limit));
    }
}
