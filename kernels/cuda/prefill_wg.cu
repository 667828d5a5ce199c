// Prefill flash attention on Hopper's warpgroup MMA (`prefill_attention_wg[_fp8]_hd128`): the
// contract of prefill.cu's kernel (arguments, grid (n_kv_heads, work items), work items
// enumerated in-kernel from the heaviest-first sequence list, packed GQA rows, causal mask,
// output in q's layout), bf16 or FP8 (E4M3) cache, head_dim 128, no window, soft-cap or sinks;
// a different inside.
//
// Why. prefill.cu's kernel issues mma.sync (m16n8k16) from every warp, each warp loading its
// K and V fragments from shared memory by ldmatrix: at a 2,048-token Llama-3.1-8B prefill it
// ran at ~177 TFLOP/s, 6.1-6.6 ms of a 38-53 ms TTFT (BENCHMARKS.md). wgmma (sm_90a) reads B
// straight from shared memory through a descriptor, runs at twice mma.sync's rate, and is
// asynchronous: no ldmatrix, and the issue slots go to the softmax.
//
// Shape. One CTA is one warpgroup (4 warps, 128 threads) holding BM = 64 packed query rows
// (tokens x heads of one GQA group, as prefill.cu's 4-warp variant: warp w owns rows 16w..16w+15).
// Q stays in registers for the whole loop as wgmma's A operand (the register fragment of a
// warp is mma.sync's m16n8k16 A fragment). Per 64-key tile:
//   S (64 x 64)  = Q K^T: 8 x wgmma m64n64k16, B = K tile (K-major: a key's 128 values are
//                  its row), accumulators in mma.sync's C layout per 8-column tile;
//   online softmax in f32, log2 domain, exactly prefill.cu's (same masks, same guards);
//   O (64 x 128) += P V: 4 x wgmma m64n128k16, A = P rounded to bf16 in registers (the S
//                  accumulators of key tiles 2kk, 2kk+1 are the A fragment of k-step kk),
//                  B = V tile read transposed (N-major: a key's row is contiguous in N).
//
// Shared memory. NS stages, each a K tile then a V tile, each tile two halves (head dims
// 0-63, 64-127) of 64 rows x 128 bytes in the 128-byte swizzle wgmma's descriptors name:
// the 16-byte chunk c of row r sits at chunk position c ^ (r % 8), every 8-row group a
// 1,024-byte atom (so the ring is aligned to 1,024 bytes). One layout serves both operands:
//   K (K-major B, SW128): start = half base + 32 bytes per 16-dim k-step, SBO = 1,024
//     (8-row groups along N = keys), LBO unused;
//   V (N-major B, SW128): start = tile base + 2,048 bytes per 16-key k-step, LBO = 8,192
//     (the second half along N = head dims), SBO = 1,024 (8-key groups along K).
// Tiles are gathered through the block table with 16-byte cp.async into their swizzled
// places (zero-filled past the needed keys, so no uninitialized value meets P V); after a
// stage lands each thread fences the generic-proxy writes for the async proxy that wgmma
// reads through, then the CTA synchronizes. The copy of tile j+1 is issued right after that
// barrier; its cache slots were read from the block table during tile j-1 and parked
// in shared memory, so no dependent global read stands between the barrier and the copies
// (that read cost 14-19 % of the kernel's time; BENCHMARKS.md, session 17).
// Over an FP8 cache the stages hold plain rows of 128 codes instead; once a stage lands the
// CTA converts it, exactly, into one swizzled bf16 K + V tile (`conv`, first in shared memory)
// that the wgmma descriptors point at, fences and synchronizes again: a second barrier a tile.
//
// The body compiles only for sm_90a (`__CUDA_ARCH_FEAT_SM90_ALL`); other targets get an
// entry that traps, which the launcher never selects (CudaDevice::prefill_wgmma).

#define WG_BN 64

// wgmma with A from registers, f32 accumulators (operand lists generated: 32 and 64 of them).
__device__ __forceinline__ void wg_mma_n64(float* d, const unsigned* a, unsigned long long desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}

__device__ __forceinline__ void wg_mma_n128(float* d, const unsigned* a, unsigned long long desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}

// Makes the compiler treat the registers as live across the asynchronous MMAs (their values
// must not be moved or reused between a wgmma and its wait).
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets, each stored >> 4.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

template <typename C>
__device__ __forceinline__ void prefill_wg_body(const bf16_t* __restrict__ q, const C* __restrict__ k_cache,
                                                const C* __restrict__ v_cache, bf16_t* __restrict__ out,
                                                const int* __restrict__ seqs, int n_seqs,
                                                const int* __restrict__ block_tables, int n_heads, int n_kv_heads,
                                                int block_size, unsigned bs_magic, float qscale, float v_scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool FP8 = sizeof(C) == 1;
    constexpr int HD = 128;
    constexpr int NS = 2;                  // ring stages (3 cost a CTA an SM and measured slower)
    constexpr int HALF_B = WG_BN * 128;    // one half of a bf16 tile: 64 rows x 128 bytes
    constexpr int TILE_B = 2 * HALF_B;     // a bf16 K (or V) tile
    constexpr int ROW_B = HD * (int)sizeof(C);  // bytes of a cached row (FP8: 128 codes)
    constexpr int STAGE_B = 2 * WG_BN * ROW_B;  // a ring stage: K then V
    constexpr int CPR = ROW_B / 16;        // 16-byte chunks per cached row
    constexpr int RPP = 128 / CPR;         // rows one pass of the CTA's copies covers
    constexpr int KS = HD / 16;            // k-steps of Q K^T
    constexpr int NT = WG_BN / 8;          // 8-key column tiles of S
    constexpr int OT = HD / 8;             // 8-wide column tiles of O
    extern __shared__ __align__(16) unsigned char wg_smem_raw[];
    // The swizzle atoms must sit on 1,024-byte boundaries (the launcher adds the slack). With
    // an FP8 cache the swizzled bf16 K and V tile the wgmma reads comes first (conv), then the
    // ring of plain code rows; with bf16 the ring itself is swizzled and wgmma reads it.
    const unsigned base = (pf_smem_addr(wg_smem_raw) + 1023u) & ~1023u;
    const unsigned conv = base, ring = FP8 ? base + 2 * TILE_B : base;

    const int group = n_heads / n_kv_heads;
    const int tq = 64 / group;  // tokens per tile (the launcher guarantees group <= 64)
    const int kvh = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    PfTile tl;
    if (!pf_find_tile<HD>(seqs, n_seqs, block_tables, tq, group, n_heads, kvh, warp, g, tl)) return;
    const int* __restrict__ bt = tl.bt;
    const int n_kv = tl.n_kv;
    const int n_tiles = (n_kv + WG_BN - 1) / WG_BN;
    unsigned qf[KS][4];
    pf_load_q<KS>(q, tl, t, qf);

    // The copy: thread (lr, lc) copies 16-byte chunk lc of rows lr, lr + RPP, ... of K and V.
    // bf16: every row it copies has r % 8 = lr, so its swizzled column is the same for all of
    // them. FP8: plain rows of 128 codes (converted into the swizzled tile after they land).
    const long long kv_w = (long long)n_kv_heads * HD;
    const int lc = threadIdx.x % CPR, lr = threadIdx.x / CPR;
    const long long head_off = (long long)kvh * HD + lc * (16 / (int)sizeof(C));
    const unsigned dcol = FP8 ? (unsigned)(lc * 16) : (unsigned)((lc >> 3) * HALF_B + (((lc & 7) ^ (lr & 7)) << 4));
    // The cache slot of key p (p < n_kv): a dependent read of the block table.
    auto slot_of = [&](int p) {
        const int lb = block_size == 1 ? p : (int)__umulhi((unsigned)p, bs_magic);
        return bt[lb] * block_size + (p - lb * block_size);
    };
    // The slots of tile t's 64 keys are read one iteration before its copy is issued
    // (threads 0..63, one key each) and parked in slots_s[t & 1], so the copy's addresses need
    // no global read: the block-table latency leaves the path from the barrier to the copies.
    __shared__ int slots_s[2][WG_BN];
    auto load_tile = [&](int j, int st, bool from_smem) {
        const unsigned ks = ring + st * STAGE_B;
#pragma unroll
        for (int ps = 0; ps < WG_BN / RPP; ps++) {
            const int r = lr + ps * RPP;
            const int p = j * WG_BN + r;
            const bool ok = p < n_kv;
            long long off = head_off;
            if (ok) off += (long long)(from_smem ? slots_s[j & 1][r] : slot_of(p)) * kv_w;
            const unsigned d = ks + r * (FP8 ? ROW_B : 128) + dcol;
            pf_cp16(d, k_cache + off, ok);
            pf_cp16(d + STAGE_B / 2, v_cache + off, ok);
        }
    };
    const int tid = threadIdx.x;

    float o[OT][4];
#pragma unroll
    for (int n = 0; n < OT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF};
    float l[2] = {0.f, 0.f};

    // Tiles 0 .. NS-2 in flight first; iteration j waits for tile j (one commit group per
    // tile, empty past the last), then refills the stage iteration j-1 read with tile j+NS-1:
    // every thread passed this iteration's barrier, so every warp is done with it (one barrier
    // per tile).
#pragma unroll
    for (int st = 0; st < NS - 1; st++) {
        if (st < n_tiles) load_tile(st, st, false);
        pf_commit();
    }
    if (tid < WG_BN && (NS - 1) * WG_BN + tid < n_kv) slots_s[(NS - 1) & 1][tid] = slot_of((NS - 1) * WG_BN + tid);
    for (int j = 0; j < n_tiles; j++) {
        const int st = j % NS;
        pf_wait<NS - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        // The slots of tile j+NS, stored at the end of this iteration.
        const int pre = (j + NS) * WG_BN + tid;
        const int pre_slot = tid < WG_BN && pre < n_kv ? slot_of(pre) : 0;
        if (j + NS - 1 < n_tiles) load_tile(j + NS - 1, (j + NS - 1) % NS, true);
        pf_commit();
        if constexpr (FP8) {
            // Stage st's codes into the swizzled bf16 tile (exact: every E4M3 value is a bf16
            // value), 16 codes a step: row r's chunk cc is bf16 chunks 2cc and 2cc + 1.
            const unsigned char* codes = wg_smem_raw + (ring - pf_smem_addr(wg_smem_raw)) + st * STAGE_B;
            for (int c = threadIdx.x; c < 2 * WG_BN * 8; c += 128) {
                const int r = c >> 3, cc = c & 7;  // r: K rows 0..63, then V rows
                const int rr = r & (WG_BN - 1);
                uint4 b[2];
                e4m3x16_to_bf16x16(*reinterpret_cast<const uint4*>(codes + r * ROW_B + cc * 16), b);
                const unsigned tile = conv + (r >= WG_BN ? TILE_B : 0) + (cc >> 2) * HALF_B + rr * 128;
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(tile + ((((2 * cc) & 7) ^ (rr & 7)) << 4)),
                             "r"(b[0].x), "r"(b[0].y), "r"(b[0].z), "r"(b[0].w) : "memory");
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(tile + ((((2 * cc + 1) & 7) ^ (rr & 7)) << 4)),
                             "r"(b[1].x), "r"(b[1].y), "r"(b[1].z), "r"(b[1].w) : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
        }
        const unsigned kt = FP8 ? conv : ring + st * STAGE_B, vt = kt + TILE_B;
        const int kv0 = j * WG_BN;

        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[n][e] = 0.f;
        wg_fence_regs<NT * 4>(&sc[0][0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KS; kk++)
            wg_mma_n64(&sc[0][0], qf[kk], wg_desc(kt + (kk >> 2) * HALF_B + (kk & 3) * 32, 16, 1024), 1);
        wg_commit();
        wg_wait0();
        wg_fence_regs<NT * 4>(&sc[0][0]);

        pf_causal_mask<NT>(sc, kv0, tl, t);
        // Every real row sees key 0 in tile 0, so its max is finite from the first tile on;
        // padding rows copy a real row.
        pf_softmax_tile<NT, OT>(sc, o, m, l, qscale);
        unsigned pa[WG_BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; kk++) {
            pa[kk][0] = pf_pack(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = pf_pack(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = pf_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = pf_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
        wg_fence_regs<OT * 4>(&o[0][0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; kk++)
            wg_mma_n128(&o[0][0], pa[kk], wg_desc(vt + kk * 2048, HALF_B, 1024), 1);
        wg_commit();
        wg_wait0();
        wg_fence_regs<OT * 4>(&o[0][0]);
        if (tid < WG_BN && pre < n_kv) slots_s[(j + NS) & 1][tid] = pre_slot;
    }
    pf_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const float inv[2] = {v_scale / l[0], v_scale / l[1]};
    pf_store_out<OT>(out, tl, t, o, inv);
#else
    __trap();
#endif
}

// Dynamic shared memory: 2 stages x (K + V) x 64 keys x 256 bytes (FP8: x 128 bytes of codes,
// plus the converted bf16 K + V tile, 32 KiB), plus 1,024 bytes of slack for the alignment
// (`prefill_wg_smem_bytes` in prefill.rs). Three CTAs an SM: the register cap (168) is what the
// kernel needs without spilling, and 3 x 65 KiB of shared memory fit.
//
// Measured and set aside (H100, BENCHMARKS.md, session 17): three stages (two CTAs an SM: 10-20 %
// slower), two warpgroups a CTA sharing the K/V tiles (one CTA an SM: 5-10 % slower, although
// it halves the tiles' L2 reads per FLOP), P V's wait deferred to the next tile's (a second
// barrier a tile: 8-14 % slower), and the block-table slots read as each copy is issued
// (14-19 % slower).
#define PF_WG_INSTANCE(HD)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, 3) prefill_attention_wg_hd##HD(                            \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,   \
        bf16_t* __restrict__ out, const int* __restrict__ seqs, int n_seqs, const int* __restrict__ block_tables, \
        int n_heads, int n_kv_heads, int block_size, unsigned bs_magic, float qscale) {                          \
        PDL_ENTER();                                                                                             \
        prefill_wg_body<bf16_t>(q, k_cache, v_cache, out, seqs, n_seqs, block_tables, n_heads, n_kv_heads,       \
                                block_size, bs_magic, qscale, 1.f);                                              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, 3) prefill_attention_wg_fp8_hd##HD(                        \
        const bf16_t* __restrict__ q, const unsigned char* __restrict__ k_cache,                                 \
        const unsigned char* __restrict__ v_cache, bf16_t* __restrict__ out, const int* __restrict__ seqs,       \
        int n_seqs, const int* __restrict__ block_tables, int n_heads, int n_kv_heads, int block_size,           \
        unsigned bs_magic, float qscale, float v_scale) {                                                        \
        PDL_ENTER();                                                                                             \
        prefill_wg_body<unsigned char>(q, k_cache, v_cache, out, seqs, n_seqs, block_tables, n_heads,            \
                                       n_kv_heads, block_size, bs_magic, qscale, v_scale);                       \
    }

// head_dim 128 only (the 16-byte chunk mapping and the two 64-dim halves assume it), for a bf16
// cache and an FP8 one (the K scale folded into qscale by the launcher, the V scale into the
// output's 1 / l).
PF_WG_INSTANCE(128)
