// Skinny GEMM for decode: out[m][n] = sum_k x[m][k] * w[n][k] for a few rows m (1..16), x
// (m x k) and w (n x k) bf16 row-major (the Hugging Face layout), f32 accumulation, output
// bf16 or f32 (the LM head). At these sizes the product is bound by reading w once: the
// kernel's job is to keep enough 16-byte loads of w in flight to saturate HBM, and to spend
// as few instructions as possible per weight byte.
//
// The arithmetic runs on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate): the
// weight tile is the A operand (16 rows of w), x is the B operand (8 columns = 8 rows of x,
// NT tiles of them), so one warp-wide instruction does 16 x 8 x 16 multiply-adds and the
// FFMA/unpack cost of a CUDA-core GEMV (which would eat most of the issue slots at m = 8)
// disappears. Rows of x beyond m read row m-1 instead (valid memory); their output columns
// are computed and discarded, since a column of the product depends only on its own column
// of B.
//
// Fragment trick: a dot product does not care in which order k is summed, as long as A and
// B use the same order. mma's A fragment gives thread (g = lane/4, t = lane%4) the elements
// {2t, 2t+1, 2t+8, 2t+9} of rows g and g+8, and its B fragment the same k positions of
// column g. So each thread loads 8 consecutive k (one 16-byte load) of w row g, of w row
// g+8 and of x row g, and feeds elements 0..3 to one mma and 4..7 to the next: the map from
// the mma's k to memory depends only on t, identical for A and B. Per k-step of 32 the four
// threads of a group cover 64 contiguous bytes of each row; U steps per batch make 64*U
// contiguous bytes per row (full 32-byte sectors per instruction, whole lines per batch).
//
// Grid: one CTA per 16 rows of w (the last CTA's missing rows load row n-1 and store
// nothing). The NW warps of a CTA split k: warp i takes batches i, i + NW, ... of U k-steps
// (4*U 16-byte chunks per row); each thread issues its 2*U weight loads (L1 no-allocate:
// streamed once) and NT*U x loads (L1-cached: every CTA re-reads x) before the first mma.
// Partial sums meet in shared memory; each of the 16 x 8*NT outputs is summed by one
// thread. K must be a multiple of 8 (16-byte rows); a last partial batch zeroes the chunks
// past k on both operands.
//
// Gated (the MLP's gate_up projection with its activation fused, ACT = SiluAct or
// GeluTanhAct): w is [gate; up] (2n rows, n = the intermediate size) and out is m x n. A CTA
// takes 8 gate rows c..c+7 as A rows g and the matching up rows n+c..n+c+7 as rows g+8, so a
// thread's accumulators hold gate and up of the same output (D[g][j] and D[g+8][j]); the
// epilogue rounds both to bf16 first, as the unfused path stores them, and applies the same
// activation functor as gated_mul (elementwise.cu): bit-identical to linear + silu_mul.
// Grid: one CTA per 8 output columns (as many CTAs as the unfused product has).
//
// Norm fusion (decode at b <= 8: the two RMSNorms of a layer were single-CTA launches on the
// step's critical path). A *residual* product (o_proj, down: ResidAct) adds its bf16-rounded
// output to the f32 residual stream in its epilogue, as add_rms_norm_f32 did, and writes each
// row's sum of squares over its 16 columns to stats[row][cta] (parts = gridDim.x of them, in a
// fixed order, so the result does not depend on scheduling). A *norm-input* product (qkv,
// gate_up: GemvXNorm) reads the residual instead of a bf16 x: after the PDL wait the CTA sums
// the stats of its rows (one warp a row, a fixed tree), inv = rsqrt(mean + eps) as the norm
// kernel computes it, and every chunk of x is bf16(r * inv * w_norm) at load, the norm
// kernel's formula. The normalized activation is never stored. Both kinds trigger the next
// kernel's launch (PDL) after their k loop rather than at their start (measured, see gemv_body).
//
// RoPE fusion (RopeAct: the norm-input qkv product of a decode step, bf16 weights, full
// rotation). rope_kv.cu's kernel was one more launch a layer on the critical path between this
// product and attention, for a few KB of bytes. Here the CTAs of the q and k rows take, like the
// gated product's, 8 rows of a head's first half as tile rows g and the 8 matching rows of its
// second half (element d + head_dim / 2, the "rotate half" pair of d) as rows g + 8, so a
// thread's accumulators D[g][j] and D[g + 8][j] hold both elements of a rotation pair for one
// row of x. The epilogue rounds both to bf16 (as the stored qkv rows were), rotates them with
// rope_kv.cu's formula (the f64 angle position * inv_freq[d], cos and sin times cs_scale) and
// writes q to q_out ([m][n_heads][head_dim]) and k to the row's cache slot through kv_put; the
// CTAs of the v rows (plain 16-row tiles, after the q and k rows) write v to the slot. A row
// without a slot (a graph bucket's padding) writes q only. A qkv bias (Qwen2), where given, is
// added to each rounded value and the sum rounded again, as bias_add_bf16 does to the stored
// rows. The qkv rows are never stored: bit for bit the unfused qkv product (+ bias_add_bf16) +
// rope_qkv_write_kv. head_dim must be a multiple of 16.

__device__ __forceinline__ uint4 gemv_ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 gemv_ld_cached(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A full batch of weight loads: chunks c0 + 4u (+ the thread's t, folded into wa/wb) of rows
// g and g + 8, all issued before any use (streamed: read once).
template <int U>
__device__ __forceinline__ void gemv_ld_w_batch(const uint4* wa, const uint4* wb, int c0, uint4* va, uint4* vb) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        va[u] = gemv_ld_stream(wa + c0 + 4 * u);
        vb[u] = gemv_ld_stream(wb + c0 + 4 * u);
    }
}

// d += A (16x16, rows g/g+8 in a0..a3) * B (16x8, column g in b0, b1), f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void gemv_store(bf16_t* out, long long i, float v) { out[i] = f2bf(v); }
__device__ __forceinline__ void gemv_store(float* out, long long i, float v) { out[i] = v; }

// The epilogue of a plain product (no activation).
struct NoAct {};
template <typename ACT>
struct IsGated {
    static constexpr bool value = true;
};
template <>
struct IsGated<NoAct> {
    static constexpr bool value = false;
};
// The epilogue of a residual product (see the top of the file): plain rows, added to the f32
// residual stream, with the rows' sums of squares.
struct ResidAct {};
template <>
struct IsGated<ResidAct> {
    static constexpr bool value = false;
};
template <typename ACT>
struct IsResid {
    static constexpr bool value = false;
};
template <>
struct IsResid<ResidAct> {
    static constexpr bool value = true;
};
// The epilogue of the RoPE-fused qkv product (see the top of the file): where the rotated q,
// k and the v go, each row's position and slot, and the rotation's table. C: the cache's
// element (bf16, or an FP8 cache's E4M3 codes with the layer's K and V scales).
template <typename C>
struct RopeAct {
    C* k_cache;
    C* v_cache;
    const int* positions;
    const long long* slots;
    const double* inv_freq;
    const bf16_t* bias;  // the qkv bias, one per weight row, or null
    int n_heads, n_kv_heads, head_dim;
    float cs_scale, k_scale, v_scale;
    const float* k_shift;  // the layer's key shift (FP8 cache), or null
    // CTAs of the q and k rows (pairs); the v rows' CTAs follow.
    __device__ __forceinline__ int qk_ctas() const { return (n_heads + n_kv_heads) * head_dim / 16; }
};
template <typename C>
struct IsGated<RopeAct<C>> {
    static constexpr bool value = false;
};
template <typename ACT>
struct IsRope {
    static constexpr bool value = false;
};
template <typename C>
struct IsRope<RopeAct<C>> {
    static constexpr bool value = true;
};

// Row of w that tile row i (0..15) of CTA `cta` reads, clamped to valid memory. Plain: rows
// 16 cta + i of n. Gated: gate row 8 cta + i for i < 8, its up row n + 8 cta + (i - 8) after.
template <typename ACT>
__device__ __forceinline__ long long gemv_w_row(int cta, int i, int n) {
    return min(cta * 16 + i, n - 1);
}
template <>
__device__ __forceinline__ long long gemv_w_row<SiluAct>(int cta, int i, int n) {
    return min(cta * 8 + (i & 7), n - 1) + (i >= 8 ? n : 0);
}
template <>
__device__ __forceinline__ long long gemv_w_row<GeluTanhAct>(int cta, int i, int n) {
    return gemv_w_row<SiluAct>(cta, i, n);
}

// gemv_w_row for an epilogue object: the type's rule, except RoPE's, whose q and k CTAs take a
// head's rotation pairs (d, d + head_dim / 2), d = 8 j .. 8 j + 7, for CTA j of the head.
template <typename ACT>
__device__ __forceinline__ long long gemv_act_row(const ACT&, int cta, int i, int n) {
    return gemv_w_row<ACT>(cta, i, n);
}
template <typename C>
__device__ __forceinline__ long long gemv_act_row(const RopeAct<C>& r, int cta, int i, int n) {
    if (cta >= r.qk_ctas()) return min(cta * 16 + i, n - 1);
    const int per = r.head_dim >> 4, head = cta / per;
    return (long long)head * r.head_dim + (cta - head * per) * 8 + (i & 7) + (i >= 8 ? r.head_dim >> 1 : 0);
}

// A per-output-row factor applied in the plain epilogue: none for bf16 weights (x 1 is exact).
struct NoRowScale {
    __device__ __forceinline__ float operator()(int) const { return 1.f; }
};

// Sums the warps' partials (red[warp][nt * 4 + j][lane]: accumulator j of tile nt) and stores
// the CTA's 16 output rows (row0 ..) of its 8 * NT rows of x (m0 ..), each sum times scale(row)
// (gemv_fp8.cu passes the FP8 weights' per-row scale).
template <int NT, int NW, typename OUT, typename SCALE>
__device__ __forceinline__ void gemv_epilogue_plain(const float (*red)[NT * 4][32], OUT* __restrict__ out, int m,
                                                    int n, int row0, int m0, SCALE scale) {
    for (int i = threadIdx.x; i < NT * 4 * 32; i += NW * 32) {
        const int j = i >> 5, l = i & 31;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < NW; v++) s += red[v][j][l];
        const int row = row0 + (l >> 2) + ((j & 2) ? 8 : 0);
        const int mm = m0 + (j >> 2) * 8 + 2 * (l & 3) + (j & 1);
        if (row < n && mm < m) gemv_store(out, (long long)mm * n + row, s * scale(row));
    }
}

// Before waiting for the previous kernel (PDL, see the prelude): pulls the first `bytes` bytes
// of the CTA's 16 weight rows (row i at base + row(i) * row_bytes, rows of row_bytes bytes) into
// L2, so the first loads start from L2 while the previous kernel finishes. Weights are never
// written during a step.
template <typename ROW>
__device__ __forceinline__ void gemv_prefetch_l2(const unsigned char* base, long long row_bytes, int bytes, ROW row) {
    constexpr int LINE = 128;
    for (int l = threadIdx.x; l < 16 * (bytes / LINE); l += blockDim.x) {
        const long long c = (long long)(l >> 4) * LINE;
        if (c < row_bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + row(l & 15) * row_bytes + c));
    }
}

// Further, bytes [from, to) of each of the CTA's 16 rows into L2, one bulk prefetch a row
// (the copy engine walks it; no per-line instructions): the host asks for more than the first
// round where the weights fit in L2 beside what the previous kernel streams, so that a
// latency-bound predecessor (attention at a short context, a norm) leaves DRAM busy with the
// next product's weights. `from` and `to` are multiples of 16 bytes (k % 8 == 0 and the host
// rounds), `to` at most row_bytes.
template <typename ROW>
__device__ __forceinline__ void gemv_prefetch_l2_bulk(const unsigned char* base, long long row_bytes, int from, int to,
                                                      ROW row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x < 16 && to > from && to <= row_bytes)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + row(threadIdx.x) * row_bytes + from),
                     "r"(to - from)
                     : "memory");
#endif
}

// Entry i (< NT * 2 * 32) of a paired epilogue (gated, RoPE), whose tile rows g and g + 8 hold
// the two halves of one output: sums the warps' partials of accumulators j = h of tile nt
// (row g) into a and j = h + 2 (row g + 8) into b; g = l / 4 is the output's pair index in the
// CTA and mm its row of x.
template <int NT, int NW>
__device__ __forceinline__ void gemv_pair_sums(const float (*red)[NT * 4][32], int i, float& a, float& b, int& g,
                                               int& mm) {
    const int jj = i >> 5, l = i & 31;
    const int nt = jj >> 1, h = jj & 1;
    a = 0.f;
    b = 0.f;
#pragma unroll
    for (int v = 0; v < NW; v++) {
        a += red[v][nt * 4 + h][l];
        b += red[v][nt * 4 + h + 2][l];
    }
    g = l >> 2;
    mm = nt * 8 + 2 * (l & 3) + h;
}

// The gated epilogue: one thread per (output column, row of x) sums gate (accumulator j = h of
// its tile) and up (j = h + 2, tile row g + 8), scales each by its weight row's factor (1 for
// bf16 weights; gemv_fp8.cu's per-row scale) and stores act(bf16(gate)) * bf16(up) rounded. The
// CTA's weight tile is `cta` and its rows of x start at m0 (gemv_fp8.cu's groups; 0 here).
template <int NT, int NW, typename ACT, typename SCALE>
__device__ __forceinline__ void gemv_epilogue_gated(const float (*red)[NT * 4][32], ACT act,
                                                    bf16_t* __restrict__ out, int m, int n, int cta, int m0,
                                                    SCALE scale) {
    const int col0 = cta * 8;
    for (int i = threadIdx.x; i < NT * 2 * 32; i += NW * 32) {
        float gate, up;
        int g, mm;
        gemv_pair_sums<NT, NW>(red, i, gate, up, g, mm);
        const int col = col0 + g;
        mm += m0;
        if (col < n && mm < m)
            out[(long long)mm * n + col] = f2bf(act(bf2f(f2bf(gate * scale(col)))) * bf2f(f2bf(up * scale(n + col))));
    }
}

// The x operand as bf16 activations: thread (g, t)'s rows g, g + 8, ... (clamped to m - 1) of
// x, offset by its t-th 16-byte chunk.
template <int NT>
struct GemvXBf16 {
    static constexpr bool NORM = false;
    const uint4* row[NT];
    __device__ __forceinline__ GemvXBf16(const bf16_t* __restrict__ x, int m, int k, int g, int t) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            row[nt] = reinterpret_cast<const uint4*>(x + (long long)min(nt * 8 + g, m - 1) * k) + t;
    }
    // After the PDL wait, before the first load: nothing to prepare.
    __device__ __forceinline__ void ready(int, int, int) {}
    // Chunk c (of 8 values) of tile nt's row.
    __device__ __forceinline__ uint4 load(int nt, int c) const { return gemv_ld_cached(row[nt] + c); }
    template <int U>
    __device__ __forceinline__ void load_batch(int c0, uint4 (*vx)[U]) const {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int u = 0; u < U; u++) vx[nt][u] = load(nt, c0 + 4 * u);
    }
};

// What a norm-input product reads instead of x: the f32 residual stream (m x k), the stats a
// residual product left (m x parts sums of squares), the norm's weight (k bf16) and epsilon.
struct GemvNormIn {
    const float* __restrict__ res;
    const float* __restrict__ stats;
    const bf16_t* __restrict__ w;
    int parts;
    float eps;
};

__device__ __forceinline__ float4 gemv_ld_f4(const float4* p) {
    float4 v;
    asm("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// bf16 pair (lo, hi) of r * inv * w, as norm_store rounds it.
__device__ __forceinline__ unsigned gemv_norm_pair(float r0, float r1, float inv, unsigned w) {
    const float w0 = __uint_as_float(w << 16), w1 = __uint_as_float(w & 0xffff0000u);
    return (unsigned)f2bf(r0 * inv * w0) | ((unsigned)f2bf(r1 * inv * w1) << 16);
}

// The x operand as rms_norm(residual) * w, computed at load (see the top of the file).
template <int NT>
struct GemvXNorm {
    static constexpr bool NORM = true;
    const float4* row[NT];  // the t-th 32-byte chunk of row g, g + 8, ...
    const uint4* w;         // the t-th 16-byte chunk of the norm weight
    GemvNormIn in;
    float inv[NT];
    __device__ __forceinline__ GemvXNorm(const GemvNormIn& a, int m, int k, int g, int t) : in(a) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            row[nt] = reinterpret_cast<const float4*>(a.res + (long long)min(nt * 8 + g, m - 1) * k) + 2 * t;
        w = reinterpret_cast<const uint4*>(a.w) + t;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) inv[nt] = 0.f;
    }
    // 1 / rms of each row this thread reads: warp i sums rows i, i + NW, ... of the stats (lane
    // j its parts j, j + 32, ..., then a fixed shuffle tree), through shared memory. Every CTA
    // computes the same bits. All threads of the CTA call it.
    __device__ __forceinline__ void ready(int m, int k, int g) {
        __shared__ float s_inv[NT * 8];
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        for (int mm = warp; mm < min(m, NT * 8); mm += nw) {
            float s = 0.f;
            for (int p = lane; p < in.parts; p += 32) s += in.stats[(long long)mm * in.parts + p];
            s = warp_sum(s);
            if (lane == 0) s_inv[mm] = rsqrtf(s / (float)k + in.eps);
        }
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < NT; nt++) inv[nt] = s_inv[min(nt * 8 + g, m - 1)];
    }
    __device__ __forceinline__ uint4 norm(float4 a, float4 b, uint4 wv, float iv) const {
        return make_uint4(gemv_norm_pair(a.x, a.y, iv, wv.x), gemv_norm_pair(a.z, a.w, iv, wv.y),
                          gemv_norm_pair(b.x, b.y, iv, wv.z), gemv_norm_pair(b.z, b.w, iv, wv.w));
    }
    __device__ __forceinline__ uint4 load(int nt, int c) const {
        return norm(gemv_ld_f4(row[nt] + 2 * c), gemv_ld_f4(row[nt] + 2 * c + 1), gemv_ld_cached(w + c), inv[nt]);
    }
    template <int U>
    __device__ __forceinline__ void load_batch(int c0, uint4 (*vx)[U]) const {
        // Every load of the batch before the first use (the weight chunk once per k-step).
        uint4 wv[U];
        float4 a[NT][U], b[NT][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 4 * u;
            wv[u] = gemv_ld_cached(w + c);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                a[nt][u] = gemv_ld_f4(row[nt] + 2 * c);
                b[nt][u] = gemv_ld_f4(row[nt] + 2 * c + 1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int u = 0; u < U; u++) vx[nt][u] = norm(a[nt][u], b[nt][u], wv[u], inv[nt]);
    }
};

// GemvXNorm that also stores the normalized x it computes (x_out: m x k bf16, the norm
// kernel's output) when x_out is not null: the router of a MoE layer, whose experts read the
// normalized rows next. The launch passes x_out to CTA 0 only (every CTA loads all of x, and
// that CTA's threads together load every chunk of every row); rows >= m, which repeat row
// m - 1, store nothing.
template <int NT>
struct GemvXNormOut : GemvXNorm<NT> {
    uint4* x_out;  // the t-th 16-byte chunk of row g (of tile 0), or null
    int g, m, k;
    __device__ __forceinline__ GemvXNormOut(const GemvNormIn& a, int m_, int k_, int g_, int t, bf16_t* out)
        : GemvXNorm<NT>(a, m_, k_, g_, t), g(g_), m(m_), k(k_) {
        x_out = out ? reinterpret_cast<uint4*>(out) + t : nullptr;
    }
    __device__ __forceinline__ void store(int nt, int c, uint4 v) const {
        const int row = nt * 8 + g;
        if (x_out && row < m) x_out[(long long)row * (k >> 3) + c] = v;
    }
    __device__ __forceinline__ uint4 load(int nt, int c) const {
        // Chunk c + t of the row. A chunk past k in a partial batch arrives as c = -t: chunk 0
        // again, whose normalized value is then stored once more before the caller zeroes it.
        const uint4 v = GemvXNorm<NT>::load(nt, c);
        store(nt, c, v);
        return v;
    }
    template <int U>
    __device__ __forceinline__ void load_batch(int c0, uint4 (*vx)[U]) const {
        GemvXNorm<NT>::template load_batch<U>(c0, vx);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int u = 0; u < U; u++) store(nt, c0 + 4 * u, vx[nt][u]);
    }
};

// The epilogue of a residual product: residual += bf16(sum) (add_rms_norm_f32's add, on the
// product's rounded output), then stats[mm][cta] = the sum over the CTA's 16 columns of the new
// residual squared, for each row mm < m. rp holds the residual values this thread's entries
// (the plain epilogue's indexing) had, loaded before the k loop.
template <int NT, int NW, int E>
__device__ __forceinline__ void gemv_epilogue_resid(const float (*red)[NT * 4][32], const float* rp,
                                                    float* __restrict__ res, float* __restrict__ stats, int m,
                                                    int n) {
    __shared__ float sq[16][NT * 8];
    const int row0 = blockIdx.x * 16;
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int i = threadIdx.x + e * NW * 32;
        if (i < NT * 4 * 32) {
            const int j = i >> 5, l = i & 31;
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < NW; v++) s += red[v][j][l];
            const int r = (l >> 2) + ((j & 2) ? 8 : 0);
            const int mm = (j >> 2) * 8 + 2 * (l & 3) + (j & 1);
            float q = 0.f;
            if (row0 + r < n && mm < m) {
                const float v = rp[e] + bf2f(f2bf(s));
                res[(long long)mm * n + row0 + r] = v;
                q = v * v;
            }
            sq[r][mm] = q;
        }
    }
    __syncthreads();
    if (threadIdx.x < min(m, NT * 8)) {
        float s = 0.f;
#pragma unroll
        for (int r = 0; r < 16; r++) s += sq[r][threadIdx.x];
        stats[(long long)threadIdx.x * gridDim.x + blockIdx.x] = s;
    }
}

// The residual value of each of this thread's epilogue entries (0 past n or m).
template <int NT, int NW, int E>
__device__ __forceinline__ void gemv_resid_preload(const float* __restrict__ res, float* rp, int m, int n) {
    const int row0 = blockIdx.x * 16;
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int i = threadIdx.x + e * NW * 32;
        rp[e] = 0.f;
        if (i < NT * 4 * 32) {
            const int j = i >> 5, l = i & 31;
            const int r = (l >> 2) + ((j & 2) ? 8 : 0);
            const int mm = (j >> 2) * 8 + 2 * (l & 3) + (j & 1);
            if (row0 + r < n && mm < m) rp[e] = res[(long long)mm * n + row0 + r];
        }
    }
}

// The RoPE epilogue (RopeAct, see the top of the file): one thread per (rotation pair or pair
// of v rows, row of x) sums the pair's two accumulators (j = h and h + 2 of its tile, rows g
// and g + 8), scales each by its weight row's factor (as the gated epilogue), rounds each to
// bf16 and rotates q and k as rope_kv.cu does (rope_one_head), or stores the two v values.
// The CTA's weight tile is `cta` and its rows of x start at m0, as in the gated epilogue.
template <int NT, int NW, typename C, typename SCALE>
__device__ __forceinline__ void gemv_epilogue_rope(const float (*red)[NT * 4][32], const RopeAct<C>& r,
                                                   bf16_t* __restrict__ q_out, int m, int n, int cta, int m0,
                                                   SCALE scale) {
    const int hd = r.head_dim, half = hd >> 1;
    const long long kv_w = (long long)r.n_kv_heads * hd;
    const bool pairs = cta < r.qk_ctas();
    for (int i = threadIdx.x; i < NT * 2 * 32; i += NW * 32) {
        float a, b;
        int g, mm;
        gemv_pair_sums<NT, NW>(red, i, a, b, g, mm);
        mm += m0;
        if (mm >= m) continue;
        const long long slot = r.slots[mm];
        const int row_a = (int)gemv_act_row(r, cta, g, n), row_b = (int)gemv_act_row(r, cta, g + 8, n);
        bf16_t ab = f2bf(a * scale(row_a)), bb = f2bf(b * scale(row_b));
        if (r.bias) {
            ab = f2bf(bf2f(ab) + bf2f(r.bias[row_a]));
            bb = f2bf(bf2f(bb) + bf2f(r.bias[row_b]));
        }
        if (!pairs) {
            // v rows cta * 16 + g and + 8, as a v row index (v rows follow the q and k rows).
            if (slot < 0) continue;
            C* vc = r.v_cache + slot * kv_w + (cta - r.qk_ctas()) * 16 + g;
            kv_put(vc, ab, r.v_scale);
            kv_put(vc + 8, bb, r.v_scale);
            continue;
        }
        const int per = hd >> 4, head = cta / per, d = (cta - head * per) * 8 + g;
        double sd, cd;
        sincos((double)r.positions[mm] * r.inv_freq[d], &sd, &cd);
        const float sn = (float)sd * r.cs_scale, cs = (float)cd * r.cs_scale;
        const float af = bf2f(ab), bf = bf2f(bb);
        const bf16_t ra = f2bf(af * cs - bf * sn), rb = f2bf(bf * cs + af * sn);
        if (head < r.n_heads) {
            bf16_t* qo = q_out + ((long long)mm * r.n_heads + head) * hd;
            qo[d] = ra;
            qo[d + half] = rb;
        } else if (slot >= 0) {
            C* kc = r.k_cache + slot * kv_w + (long long)(head - r.n_heads) * hd;
            const long long at = (long long)(head - r.n_heads) * hd;
            kv_put_key(kc + d, ra, r.k_scale, k_shift_at(r.k_shift, at + d));
            kv_put_key(kc + d + half, rb, r.k_scale, k_shift_at(r.k_shift, at + d + half));
        }
    }
}

// NT: tiles of 8 x rows (m <= 8 * NT). NW: warps per CTA (k split). U: k-steps of 32 per
// batch (2*U weight loads of 16 bytes in flight per thread). ACT: NoAct, ResidAct (out is the
// f32 residual stream, stats its sums of squares), or the activation of a gated product (then
// n is the number of output columns, half of w's rows). X: where x comes from (GemvXBf16, or
// GemvXNorm for a norm-input product). pf: bytes of each weight row pulled into L2 before the
// PDL wait (at least the first round; see gemv_prefetch_l2_bulk).
template <int NT, int NW, int U, typename OUT, typename ACT, typename X>
__device__ __forceinline__ void gemv_body(X xin, const bf16_t* __restrict__ w, OUT* __restrict__ out,
                                          float* __restrict__ stats, int m, int n, int k, int pf,
                                          const ACT& act = ACT{}) {
    constexpr int BATCH = 4 * U;  // 16-byte chunks per row per batch
    // Epilogue entries per thread (the residual epilogue preloads their residual values).
    constexpr int E = (NT * 4 + NW - 1) / NW;
    __shared__ float red[NW][NT * 4][32];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kc = k >> 3;
    const long long ra = gemv_act_row(act, blockIdx.x, g, n), rb = gemv_act_row(act, blockIdx.x, g + 8, n);
    const uint4* wa = reinterpret_cast<const uint4*>(w + ra * k) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(w + rb * k) + t;

    // The first round: batches 0..NW-1 of the CTA's 16 rows (NW * BATCH 16-byte chunks a row).
    const auto wrow = [&](int i) { return gemv_act_row(act, blockIdx.x, i, n); };
    gemv_prefetch_l2(reinterpret_cast<const unsigned char*>(w), 2ll * k, NW * BATCH * 16, wrow);
    gemv_prefetch_l2_bulk(reinterpret_cast<const unsigned char*>(w), 2ll * k, NW * BATCH * 16, pf, wrow);
    // The fused-norm kernels let the next kernel launch only after their k loop: triggered at
    // the start, as the other kernels do, they made Llama-3.1-8B's b = 1 ctx 1k step 6.49 ms
    // against 5.83 (and 5.98 unfused; H100, bench/results/bench-cuda-fusednorm-*).
    constexpr bool late = IsResid<ACT>::value || X::NORM;
    if constexpr (late)
        pdl_wait();
    else
        PDL_ENTER();
    xin.ready(m, k, g);
    float rp[E];
    if constexpr (IsResid<ACT>::value) gemv_resid_preload<NT, NW, E>(out, rp, m, n);

    // Two accumulator sets (even and odd mma of a step) halve the dependent mma chain.
    float acc[2][NT][4];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[h][nt][j] = 0.f;

    const int nb = (kc + BATCH - 1) / BATCH;
    for (int b = warp; b < nb; b += NW) {
        const int c0 = b * BATCH;
        uint4 va[U], vb[U], vx[NT][U];
        if (c0 + BATCH <= kc) {
            gemv_ld_w_batch<U>(wa, wb, c0, va, vb);
            xin.template load_batch<U>(c0, vx);
        } else {
            // The last, partial batch: chunks past k load chunk 0 (valid memory) and are
            // zeroed on both operands, so they add exact zeros.
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = c0 + 4 * u;
                const bool in = c + t < kc;
                const int cc = in ? c : -t;
                va[u] = gemv_ld_stream(wa + cc);
                vb[u] = gemv_ld_stream(wb + cc);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) vx[nt][u] = xin.load(nt, cc);
                if (!in) {
                    va[u] = make_uint4(0, 0, 0, 0);
                    vb[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) vx[nt][u] = make_uint4(0, 0, 0, 0);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                mma_bf16_16816(acc[0][nt], va[u].x, vb[u].x, va[u].y, vb[u].y, vx[nt][u].x, vx[nt][u].y);
                mma_bf16_16816(acc[1][nt], va[u].z, vb[u].z, va[u].w, vb[u].w, vx[nt][u].z, vx[nt][u].w);
            }
    }

    if constexpr (late) pdl_trigger();
    // Accumulator j of tile nt in lane (g, t) is D[g + 8*(j/2)][nt*8 + 2t + j%2]. Laid out
    // [warp][j][lane] so that a warp's stores and the summing loads are conflict-free.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) red[warp][nt * 4 + j][lane] = acc[0][nt][j] + acc[1][nt][j];
    __syncthreads();
    if constexpr (IsGated<ACT>::value)
        gemv_epilogue_gated<NT, NW>(red, act, out, m, n, blockIdx.x, 0, NoRowScale{});
    else if constexpr (IsRope<ACT>::value)
        gemv_epilogue_rope<NT, NW>(red, act, out, m, n, blockIdx.x, 0, NoRowScale{});
    else if constexpr (IsResid<ACT>::value)
        gemv_epilogue_resid<NT, NW, E>(red, rp, out, stats, m, n);
    else
        gemv_epilogue_plain<NT, NW>(red, out, m, n, blockIdx.x * 16, 0, NoRowScale{});
}

// The fused-norm kernels hold more registers than the plain ones (the f32 residual chunks):
// 8-warp CTAs are held to 3 per SM, as the plain kernels fit, so that qkv's 384 CTAs
// (Llama-3.1-8B) stay one wave on 132 SMs.
#define GEMV_MIN_CTAS(NW) ((NW) == 8 ? 3 : 1)
#define GEMV_NAME(MAXM, NW, U, SUFFIX) gemv_m##MAXM##_w##NW##_u##U##_##SUFFIX
// Thread (g, t) of the mma fragments.
#define GEMV_G ((threadIdx.x & 31) >> 2)
#define GEMV_T (threadIdx.x & 3)

// A bf16-input instantiation of gemv_body; the kernel is named gemv_m<MAXM>_w<NW>_u<U>_<SUFFIX>.
#define GEMV_KERNEL_BF16(MAXM, NW, U, SUFFIX, OUT, ACT)                                               \
    extern "C" __global__ void __launch_bounds__(NW * 32) GEMV_NAME(MAXM, NW, U, SUFFIX)(             \
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, OUT* __restrict__ out, int m,      \
        int n, int k, int pf) {                                                                        \
        const GemvXBf16<MAXM / 8> xin(x, m, k, GEMV_G, GEMV_T);                                        \
        gemv_body<MAXM / 8, NW, U, OUT, ACT>(xin, w, out, nullptr, m, n, k, pf);                       \
    }

// The residual product: out is the f32 residual stream, and its stats follow.
#define GEMV_KERNEL_RESID(MAXM, NW, U)                                                                 \
    extern "C" __global__ void __launch_bounds__(NW * 32, GEMV_MIN_CTAS(NW))                           \
        GEMV_NAME(MAXM, NW, U, resid)(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,       \
                                      float* __restrict__ res, float* __restrict__ stats, int m, int n, \
                                      int k, int pf) {                                                 \
        const GemvXBf16<MAXM / 8> xin(x, m, k, GEMV_G, GEMV_T);                                        \
        gemv_body<MAXM / 8, NW, U, float, ResidAct>(xin, w, res, stats, m, n, k, pf);                  \
    }

// A norm-input instantiation: x is rms_norm(res) * nw (see the top of the file).
#define GEMV_KERNEL_NORM(MAXM, NW, U, SUFFIX, ACT)                                                     \
    extern "C" __global__ void __launch_bounds__(NW * 32, GEMV_MIN_CTAS(NW))                           \
        GEMV_NAME(MAXM, NW, U, SUFFIX)(const float* __restrict__ res, const float* __restrict__ stats,  \
                                       int parts, const bf16_t* __restrict__ nw, float eps,             \
                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int m,   \
                                       int n, int k, int pf) {                                          \
        const GemvXNorm<MAXM / 8> xin(GemvNormIn{res, stats, nw, parts, eps}, m, k, GEMV_G, GEMV_T);   \
        gemv_body<MAXM / 8, NW, U, bf16_t, ACT>(xin, w, out, nullptr, m, n, k, pf);                    \
    }

// A norm-input product with an f32 output that also stores the normalized x (GemvXNormOut,
// from CTA 0): a MoE layer's router, whose logits the routing reads in f32 and whose input the
// experts read next.
#define GEMV_KERNEL_NORM_F32_X(MAXM, NW, U)                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, GEMV_MIN_CTAS(NW))                           \
        GEMV_NAME(MAXM, NW, U, norm_f32_x)(const float* __restrict__ res, const float* __restrict__ stats, \
                                           int parts, const bf16_t* __restrict__ nw, float eps,         \
                                           const bf16_t* __restrict__ w, float* __restrict__ out,       \
                                           bf16_t* __restrict__ x_out, int m, int n, int k, int pf) {   \
        const GemvXNormOut<MAXM / 8> xin(GemvNormIn{res, stats, nw, parts, eps}, m, k, GEMV_G, GEMV_T,   \
                                         blockIdx.x == 0 ? x_out : nullptr);                            \
        gemv_body<MAXM / 8, NW, U, float, NoAct>(xin, w, out, nullptr, m, n, k, pf);                    \
    }

// The RoPE-fused qkv product (norm input, see the top of the file) into a cache of C: q to
// q_out, k and v to the cache.
#define GEMV_KERNEL_NORM_ROPE(MAXM, NW, U, SUFFIX, C)                                                   \
    extern "C" __global__ void __launch_bounds__(NW * 32, GEMV_MIN_CTAS(NW)) GEMV_NAME(MAXM, NW, U, SUFFIX)( \
        const float* __restrict__ res, const float* __restrict__ stats, int parts, const bf16_t* __restrict__ nw, \
        float eps, const bf16_t* __restrict__ w, bf16_t* __restrict__ q_out, C* __restrict__ k_cache,          \
        C* __restrict__ v_cache, const int* __restrict__ positions, const long long* __restrict__ slots,       \
        const double* __restrict__ inv_freq, const bf16_t* __restrict__ bias, int n_heads, int n_kv_heads,   \
        int head_dim, float cs_scale, float k_scale, float v_scale, const float* __restrict__ k_shift, int m,  \
        int n, int k, int pf) {                                                                                 \
        const GemvXNorm<MAXM / 8> xin(GemvNormIn{res, stats, nw, parts, eps}, m, k, GEMV_G, GEMV_T);           \
        const RopeAct<C> act{k_cache, v_cache, positions, slots,  inv_freq, bias, n_heads,                     \
                             n_kv_heads, head_dim, cs_scale, k_scale, v_scale, k_shift};                       \
        gemv_body<MAXM / 8, NW, U, bf16_t, RopeAct<C>>(xin, w, q_out, nullptr, m, n, k, pf, act);             \
    }

// Every epilogue of one variant, in the order of GemvEpilogue::ALL (kernels/src/cuda/gemv.rs).
#define GEMV_INSTANCE(MAXM, NW, U)                                 \
    GEMV_KERNEL_BF16(MAXM, NW, U, bf16, bf16_t, NoAct)             \
    GEMV_KERNEL_BF16(MAXM, NW, U, f32, float, NoAct)               \
    GEMV_KERNEL_BF16(MAXM, NW, U, silu, bf16_t, SiluAct)           \
    GEMV_KERNEL_BF16(MAXM, NW, U, gelu_tanh, bf16_t, GeluTanhAct)  \
    GEMV_KERNEL_RESID(MAXM, NW, U)                                 \
    GEMV_KERNEL_NORM(MAXM, NW, U, norm_bf16, NoAct)                \
    GEMV_KERNEL_NORM(MAXM, NW, U, norm_silu, SiluAct)              \
    GEMV_KERNEL_NORM_ROPE(MAXM, NW, U, norm_rope, bf16_t)          \
    GEMV_KERNEL_NORM_ROPE(MAXM, NW, U, norm_rope_fp8, unsigned char) \
    GEMV_KERNEL_NORM_F32_X(MAXM, NW, U)

// The variants (warps, k-steps per batch), in the order of GEMV_VARIANTS in
// kernels/src/cuda/gemv.rs, for up to 8 and up to 16 rows of x: one top-level line each, so that
// each compiles as a module of its own (compile.rs; a cold start waits for the longest module).
GEMV_INSTANCE(8, 4, 4)
GEMV_INSTANCE(8, 8, 4)
GEMV_INSTANCE(8, 4, 8)
GEMV_INSTANCE(8, 8, 2)
GEMV_INSTANCE(16, 4, 4)
GEMV_INSTANCE(16, 8, 4)
GEMV_INSTANCE(16, 4, 8)
GEMV_INSTANCE(16, 8, 2)
