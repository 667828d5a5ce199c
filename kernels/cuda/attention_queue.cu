// ---------------------------------------------------------------------------------------------
// Work-queue decode attention (`paged_attention_sq_*`): the streaming kernel's ring and products
// (attention_stream.cu: StBf16Warp, Fp8WarpTile, st_fp8_finish), with the work handed out as CTAs
// free up instead of one chunk a CTA. Included after attention_stream.cu.
//
// Why. The streaming kernel gives each CTA one (row, split) chunk, in one wave. ncu at 32 rows x
// 2k over an FP8 cache (session 30, H100): while active the SMs stream at about copy speed, but
// they finish at different times (active cycles per SM 71.9k to 99.0k against 104.3k elapsed),
// so 15-18 % of the SM time is idle in the wave's tail. Here the grid is the CTAs that fit the
// device at once, and each takes the next item of a queue (one global counter) when its current
// one has been issued, so an SM that streams faster takes more items.
//
// Items. The launch's (x, row, split) CTAs of the streaming kernel, numbered row-major
// (x fastest, then split, then row): item i has x = i % gx, split = (i / gx) % n_splits and
// row = i / (gx * n_splits), with the streaming kernel's x (KV heads of the CTA, query-head
// chunk) and the same chunk of the row's context (split_chunk). An item is computed by the same
// instructions as the streaming kernel's CTA and writes the same output or partial, so rows are
// bit-identical to the streaming kernel's at the same split count, whichever CTA took the item
// and in whatever order: the split boundaries depend on the lengths only, never on timing.
//
// Ring. One ring for the CTA's whole life: stage g (counted across items) lands in slot g % NS
// at mbarrier phase (g / NS) & 1. Warp 0 issues stages NS - 1 ahead; when it has issued an item's
// last stage it claims the next item (lane 0, atomicAdd on work[0]), so the claim's latency is
// hidden behind the stages in flight and the next item's first stages stream while the current
// one is consumed. Each slot carries its stage's item, its tile in the item, and the item's chunk
// [c0, c1) (written by warp 0 before its arrive, read after the wait: the mbarrier orders them).
// A tile of 0 starts an item: every warp writes the previous item's output and loads the new
// row's Q. Items without tokens (a split past a short row, a padding row) are skipped when
// claimed; a padding row's split 0 writes its zeros then. Past the last item warp 0 arrives on
// the next slot with no bytes and an item of -1, and every warp stops there: no copy is in
// flight when the CTA exits.
//
// The counter resets itself: each CTA, after its last claim, counts itself done on work[1]; the
// last one zeroes both, so the next launch (this layer's in the next step, or the next layer's)
// finds them at zero, as a captured graph replaying it needs. work starts zeroed
// (StepMeta::work).
//
// Shared memory: the streaming ring (NS stages), then NS 16-byte slot records, then NS
// mbarriers (`queue_smem_bytes`, kernels/src/cuda/paged_attention.rs).
// ---------------------------------------------------------------------------------------------

// The ring of one work-queue CTA and warp 0's copy state; see the header.
template <typename C, int HD, int NS, int MG>
struct SqRing {
    static constexpr int ST = ST_TOKENS;
    // The launch.
    int gx, gchunks, kvc, group, n_items, n_splits, n_heads, n_kv_heads, block_size, min_chunk, window;
    int row_b, rb, tile_b;
    unsigned ring, meta, bars;
    int* work;
    const C* k_cache;
    const C* v_cache;
    bf16_t* out;
    const int* row_ctx;
    const int* row_bt;
    const int* block_tables;
    long long kv_w;
    // Warp 0: the item being issued (p_item < 0: none left), its next tile, its tiles and chunk;
    // lane 0's claim of the item after it; whether the end record has been issued.
    int p_item, p_tile, p_tiles, p_c0, p_c1, pending;
    bool p_done;
    // Warp 0's lanes: lane l copies token l % 16 of each stage, its K row (l < 16) or V row.
    const C* src;
    const int* bt;
    int cp, clb, coff, cblk, ctok;
    bool cv;

    __device__ __forceinline__ SqRing(unsigned char* smem, int* work_, const C* __restrict__ k_cache_,
                                      const C* __restrict__ v_cache_, bf16_t* __restrict__ out_,
                                      const int* __restrict__ row_ctx_, const int* __restrict__ row_bt_,
                                      const int* __restrict__ block_tables_, int rows, int n_splits_, int n_heads_,
                                      int n_kv_heads_, int block_size_, int min_chunk_, int window_) {
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
        kvc = blockDim.x >> 5;
        n_heads = n_heads_;
        n_kv_heads = n_kv_heads_;
        group = n_heads / n_kv_heads;
        gchunks = (group + MG - 1) / MG;
        gx = (n_kv_heads / kvc) * gchunks;
        n_splits = n_splits_;
        n_items = gx * rows * n_splits;
        block_size = block_size_;
        min_chunk = min_chunk_;
        window = window_;
        work = work_;
        k_cache = k_cache_;
        v_cache = v_cache_;
        out = out_;
        row_ctx = row_ctx_;
        row_bt = row_bt_;
        block_tables = block_tables_;
        kv_w = (long long)n_kv_heads * HD;
        row_b = kvc * HD * (int)sizeof(C);
        rb = row_b + 16;
        tile_b = ST * rb;
        ring = smem_addr(smem);
        meta = ring + (unsigned)(NS * 2 * tile_b);  // 16-byte aligned: tile_b is
        bars = meta + (unsigned)(NS * 16);
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < NS; s++) mbar_init(bars + 8 * s, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        ctok = lane % ST;
        cv = lane >= ST;
        p_done = false;
        pending = 0;
        p_item = 0;
        p_tile = p_tiles = 0;  // "the current item is fully issued": the first issue claims
        if (warp == 0) {
            if (lane == 0) pending = atomicAdd(work, 1);
            for (int j = 0; j < NS - 1; j++) issue(j, lane);
        }
    }

    // Warp 0: takes the claimed item (lane 0's `pending`), skipping items without tokens (a
    // padding row's split 0 writes the row's zeros first), and sets the copy state to its first
    // token; p_item = -1 when the queue is empty.
    __device__ __forceinline__ void take(int lane) {
        for (;;) {
            const int item = __shfl_sync(0xffffffffu, pending, 0);
            if (item >= n_items) {
                p_item = -1;
                return;
            }
            const int x = item % gx, r = item / gx, split = r % n_splits, row = r / n_splits;
            const int ctx = row_ctx[row];
            if (ctx <= 0) {
                if (split == 0) {
                    const int kvh0 = (x / gchunks) * kvc, gc = x % gchunks, ng = min(MG, group - gc * MG);
                    for (int i = lane; i < kvc * ng * HD; i += 32) {
                        const int w = i / (ng * HD), hr = (i / HD) % ng;
                        out[((long long)row * n_heads + (kvh0 + w) * group + gc * MG + hr) * HD + i % HD] = f2bf(0.f);
                    }
                }
                if (lane == 0) pending = atomicAdd(work, 1);
                continue;
            }
            const int lo = window_start(ctx, window);
            const int chunk = split_chunk(ctx - lo, n_splits, min_chunk);
            const int c0 = lo + split * chunk, c1 = min(ctx, c0 + chunk);
            if (c0 >= c1) {
                if (lane == 0) pending = atomicAdd(work, 1);
                continue;
            }
            p_item = item;
            p_tile = 0;
            p_tiles = (c1 - c0 + ST - 1) / ST;
            p_c0 = c0;
            p_c1 = c1;
            const int kvh0 = (x / gchunks) * kvc;
            src = (cv ? v_cache : k_cache) + (long long)kvh0 * HD;
            bt = block_tables + row_bt[row];
            cp = c0 + ctok;
            clb = cp / block_size;
            coff = cp - clb * block_size;
            cblk = cp < c1 ? bt[clb] : 0;
            return;
        }
    }

    // Warp 0: issues global stage g (the next in order) into slot g % NS: the current item's next
    // tile (taking the next item first when the current one is fully issued), or the end record.
    __device__ __forceinline__ void issue(int g, int lane) {
        if (p_done) return;
        if (p_item >= 0 && p_tile == p_tiles) take(lane);
        const int s = g % NS;
        const unsigned bar = bars + 8 * s, rec = meta + 16 * s;
        if (p_item < 0) {
            if (lane == 0) {
                asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(rec), "r"(-1), "r"(0), "r"(0), "r"(0)
                             : "memory");
                mbar_arrive_expect_tx(bar, 0u);
            }
            p_done = true;
            return;
        }
        const unsigned dst = ring + (unsigned)(s * 2 * tile_b + (cv ? tile_b : 0) + ctok * rb);
        if (cp >= p_c1 && cv) {
            for (int b = 0; b < row_b; b += 16)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst + b), "r"(0u) : "memory");
        }
        __syncwarp();
        if (lane == 0) {
            asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(rec), "r"(p_item), "r"(p_tile), "r"(p_c0),
                         "r"(p_c1)
                         : "memory");
            // The item's last stage: claim the next one now, its latency behind the ring.
            if (p_tile + 1 == p_tiles) pending = atomicAdd(work, 1);
            mbar_arrive_expect_tx(bar, (unsigned)(2 * min(ST, p_c1 - (p_c0 + p_tile * ST)) * row_b));
        }
        __syncwarp();
        if (cp < p_c1) bulk_copy_g2s(dst, src + ((long long)cblk * block_size + coff) * kv_w, (unsigned)row_b, bar);
        p_tile++;
        cp += ST;
        coff += ST;
        while (coff >= block_size) {
            coff -= block_size;
            clb++;
        }
        cblk = cp < p_c1 ? bt[clb] : 0;
    }

    // The top of global stage g: once every warp is done with the slot the next copy overwrites,
    // warp 0 issues stage g + NS - 1; then waits for stage g. Returns the slot's K rows (its V
    // rows are tile_b further) and its record {item, tile, c0, c1}.
    __device__ __forceinline__ unsigned next(int g, int warp, int lane, int4& rec) {
        __syncthreads();
        if (warp == 0) issue(g + NS - 1, lane);
        const int s = g % NS;
        mbar_wait(bars + 8 * s, (unsigned)((g / NS) & 1));
        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(rec.x), "=r"(rec.y), "=r"(rec.z), "=r"(rec.w)
                     : "r"(meta + 16 * s)
                     : "memory");
        return ring + (unsigned)(s * 2 * tile_b);
    }

    // Item `item`'s row, split, and warp w's first query head and head count.
    __device__ __forceinline__ void place(int item, int w, int& row, int& split, int& h0, int& ng) const {
        const int x = item % gx, r = item / gx;
        split = r % n_splits;
        row = r / n_splits;
        const int kvh0 = (x / gchunks) * kvc, gc = x % gchunks;
        ng = min(MG, group - gc * MG);
        h0 = (kvh0 + w) * group + gc * MG;
    }

    // After the CTA's last stage: counts the CTA done; the last CTA resets the queue.
    __device__ __forceinline__ void done() {
        if (threadIdx.x == 0) {
            __threadfence();  // this CTA's claims before its count
            if (atomicAdd(work + 1, 1) == (int)gridDim.x - 1) {
                work[0] = 0;
                work[1] = 0;
            }
        }
    }
};

template <int HD, int NS, int MG>
__device__ __forceinline__ void paged_attention_sq_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, int window, float cap2, const float* __restrict__ sinks, int rows, int n_splits,
    int* __restrict__ work) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(NS >= 2, "at least double buffering");
    extern __shared__ __align__(16) unsigned char st_smem[];
    SqRing<bf16_t, HD, NS, MG> ring(st_smem, work, k_cache, v_cache, out, row_ctx, row_bt, block_tables, rows,
                                    n_splits, n_heads, n_kv_heads, block_size, min_chunk, window);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    StBf16Warp<HD, MG> w(warp, lane, ring.rb);
    int cur = -1, row = 0, split = 0, h0 = 0, ng = 0;
    for (int s = 0;; s++) {
        int4 rec;
        const unsigned ks = ring.next(s, warp, lane, rec);
        if (rec.x < 0) break;
        if (rec.y == 0) {
            if (cur >= 0) w.finish(out, part_o, part_ml, row, n_heads, h0, ng, n_splits, split, sinks, g, t);
            cur = rec.x;
            ring.place(cur, warp, row, split, h0, ng);
            w.start(q, row, n_heads, h0, ng, g, t);
        }
        w.stage(ks, ks + (unsigned)ring.tile_b, ring.rb, rec.z + rec.y * ST_TOKENS + 2 * t, rec.w, qscale, cap2);
    }
    if (cur >= 0) w.finish(out, part_o, part_ml, row, n_heads, h0, ng, n_splits, split, sinks, g, t);
    ring.done();
#else
    __trap();
#endif
}

template <int HD, int NS, int MG>
__device__ __forceinline__ void paged_attention_sq_fp8_body(
    const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ row_ctx,
    const int* __restrict__ row_bt, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,
    float qscale, int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks, int rows,
    int n_splits, int* __restrict__ work) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(NS >= 2, "at least double buffering");
    using Tile = Fp8WarpTile<HD, MG>;
    extern __shared__ __align__(16) unsigned char st_smem[];
    SqRing<unsigned char, HD, NS, MG> ring(st_smem, work, k_cache, v_cache, out, row_ctx, row_bt, block_tables, rows,
                                           n_splits, n_heads, n_kv_heads, block_size, min_chunk, window);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const unsigned lrow = (unsigned)(warp * HD) + Tile::lane_row(lane, ring.rb);
    Tile tile;
    int cur = -1, row = 0, split = 0, h0 = 0, ng = 0;
    for (int s = 0;; s++) {
        int4 rec;
        const unsigned ks = ring.next(s, warp, lane, rec);
        if (rec.x < 0) break;
        if (rec.y == 0) {
            if (cur >= 0)
                st_fp8_finish<HD, MG>(tile, out, part_o, part_ml, row, n_heads, h0, ng, n_splits, split, sinks,
                                      v_scale, g, t);
            cur = rec.x;
            ring.place(cur, warp, row, split, h0, ng);
            tile = Tile(q, row, n_heads, h0, ng, qscale, g, t);
        }
        tile.stage(ks + lrow, ks + (unsigned)ring.tile_b + lrow, rec.z + rec.y * ST_TOKENS + g, rec.w, cap2);
    }
    if (cur >= 0)
        st_fp8_finish<HD, MG>(tile, out, part_o, part_ml, row, n_heads, h0, ng, n_splits, split, sinks, v_scale, g,
                              t);
    ring.done();
#else
    __trap();
#endif
}

// The streaming kernel's arguments, then the launch's rows and splits (the grid is the CTAs that
// fit the device, not the items) and the queue's two counters.
#define ATT_SQ_INSTANCE(HD, NW, NS, MG)                                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, 1) paged_attention_sq_hd##HD##_w##NW##_s##NS##_g##MG(    \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,     \
        bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,                        \
        const int* __restrict__ row_ctx, const int* __restrict__ row_bt, const int* __restrict__ block_tables,    \
        int n_heads, int n_kv_heads, int block_size, float qscale, int min_chunk, int window, float cap2,          \
        const float* __restrict__ sinks, int rows, int n_splits, int* __restrict__ work) { PDL_ENTER();           \
        paged_attention_sq_body<HD, NS, MG>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,           \
                                            block_tables, n_heads, n_kv_heads, block_size, qscale, min_chunk,      \
                                            window, cap2, sinks, rows, n_splits, work);                          \
    }

#define ATT_SQ_FP8_INSTANCE(HD, NW, NS, MG)                                                                        \
    extern "C" __global__ void __launch_bounds__(NW * 32, 1) paged_attention_sq_fp8_hd##HD##_w##NW##_s##NS##_g##MG( \
        const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache,                                  \
        const unsigned char* __restrict__ v_cache, bf16_t* __restrict__ out, float* __restrict__ part_o,          \
        float* __restrict__ part_ml, const int* __restrict__ row_ctx, const int* __restrict__ row_bt,             \
        const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size, float qscale,          \
        int min_chunk, float v_scale, int window, float cap2, const float* __restrict__ sinks, int rows,          \
        int n_splits, int* __restrict__ work) { PDL_ENTER();                                                      \
        paged_attention_sq_fp8_body<HD, NS, MG>(q, k_cache, v_cache, out, part_o, part_ml, row_ctx, row_bt,       \
                                                block_tables, n_heads, n_kv_heads, block_size, qscale, min_chunk,  \
                                                v_scale, window, cap2, sinks, rows, n_splits, work);              \
    }

// The streaming variants (most KV heads a CTA = warps, ring stages, query heads a warp; one warp:
// the ring of 16-byte copies, see WC in attention_stream.cu's header) and the work-queue ones, in
// the order they follow the tensor-core variants in ATTN_VARIANTS, then the FP8 ones in the order
// they follow the tensor-core ones in ATTN_FP8_VARIANTS.
#define ATT_ST_VARIANTS(HD)           \
    ATT_ST_INSTANCE(HD, 8, 3, 8)      \
    ATT_ST_INSTANCE(HD, 8, 2, 8)      \
    ATT_ST_INSTANCE(HD, 4, 3, 8)      \
    ATT_ST_INSTANCE(HD, 8, 2, 16)     \
    ATT_ST_INSTANCE(HD, 1, 4, 8)      \
    ATT_SQ_INSTANCE(HD, 8, 2, 8)      \
    ATT_SQ_INSTANCE(HD, 4, 3, 8)      \
    ATT_ST_FP8_INSTANCE(HD, 8, 3, 8)  \
    ATT_ST_FP8_INSTANCE(HD, 8, 6, 8)  \
    ATT_ST_FP8_INSTANCE(HD, 4, 4, 8)  \
    ATT_ST_FP8_INSTANCE(HD, 8, 3, 16) \
    ATT_ST_FP8_INSTANCE(HD, 1, 4, 8)  \
    ATT_SQ_FP8_INSTANCE(HD, 8, 3, 8)  \
    ATT_SQ_FP8_INSTANCE(HD, 8, 6, 8)

ATT_ST_VARIANTS(16)
ATT_ST_VARIANTS(32)
ATT_ST_VARIANTS(64)
ATT_ST_VARIANTS(128)
ATT_ST_VARIANTS(256)
