//! The tensor-core prefill attention (`AttnKernel::Prefill`) and the mixed-batch router
//! (`AttnKernel::Mixed`) against the CPU reference attention, on fresh
//! random q and K/V caches (the seed is printed), outputs poisoned (NaN) before each launch.
//! Inputs are rounded to bf16 first so both sides see the same values; the check is
//! ‖out − ref‖ / ‖ref‖ < 1e-2 over every row.
//!
//! Like gpu_kernels.rs these need a GPU: they are named `gpu_*`, excluded from CI by name,
//! and FAIL (do not skip) when no device can be opened. Run them with `scripts/gpu-tests.sh`.
//! The shape refusals that need no device are unit tests of `cuda::attention`.

mod common;

use baton_kernels::cpu::{self, KvLayerRef, SeqSpan};
use baton_kernels::cuda::{
    AttentionCall, AttentionOptions, AttnKernel, AttnSplit, CudaDevice, CudaSlice, HostSeq, KvCacheRef, KvGeometry,
    PREFILL_DEFAULT_VARIANT, PREFILL_MIN_TOKENS, PREFILL_VARIANTS, PREFILL_WGMMA, StepMeta, bf16, prefill_supported,
    prefill_variant_warps, prefill_wg_supported,
};
use common::{check, device, down, poisoned, rand_vec, rng, shuffled_tables, up};
use rand::rngs::StdRng;

/// One step: each `(start_pos, n_tokens)` is a sequence's chunk, rows in the given order, over
/// a cache of random K/V whose blocks are dealt out from a shuffled pool (so a wrong slot reads
/// a wrong random value, never a zero). Checks the router on every row, and each variant of
/// the prefill launcher alone on the prefill rows (decode rows must stay untouched: still NaN).
fn prefill_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    hd: usize,
    nh: usize,
    nkv: usize,
    bs: usize,
    specs: &[(usize, usize)],
) {
    let (num_blocks, tables, rows) = shuffled_tables(r, specs, bs, 7);
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let kc = rand_vec(r, geo.layer_len(), 1.0);
    let vc = rand_vec(r, geo.layer_len(), 1.0);
    // Scores of a few units (q and k in [-1.5, 1.5]) so the softmax is far from uniform.
    let q = rand_vec(r, rows * nh * hd, 1.5);
    let scale = 1.0 / (hd as f32).sqrt();
    let w = nh * hd;
    let mut want = vec![0.0; q.len()];
    let mut host = Vec::new();
    let mut is_prefill = vec![false; rows];
    let mut row = 0;
    for (&(start, n), t) in specs.iter().zip(&tables) {
        cpu::paged_attention(
            &q[row * w..(row + n) * w],
            nh,
            scale,
            SeqSpan { start_pos: start, n_tokens: n, block_table: t },
            KvLayerRef { k: &kc, v: &vc, block_size: bs, n_kv_heads: nkv, head_dim: hd },
            &mut want[row * w..(row + n) * w],
        )
        .expect("cpu attention");
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        is_prefill[row..row + n].fill(n >= PREFILL_MIN_TOKENS);
        row += n;
    }
    let what = format!("hd={hd} heads={nh}/{nkv} bs={bs} chunks={specs:?}");
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set(dev, &host, rows, bs, num_blocks).expect("meta set");
    let (qd, kd, vd) = (up(dev, &q), up(dev, &kc), up(dev, &vc));

    let mut out = poisoned(dev, q.len());
    AttentionCall {
        q: &qd,
        cache: KvCacheRef::Bf16 { k: &kd, v: &vd },
        meta: &mut meta,
        n_heads: nh,
        geo,
        scale,
        out: &mut out,
        kernel: AttnKernel::Mixed,
        split: AttnSplit::Auto,
        options: AttentionOptions::default(),
    }
    .launch(dev)
    .expect("attention_mixed");
    check(&format!("mixed {what}"), &down(dev, &out, q.len()), &want);

    if !prefill_supported(nh, nkv, hd) || !is_prefill.iter().any(|&p| p) {
        return;
    }
    for vi in 0..PREFILL_VARIANTS {
        let warps = prefill_variant_warps(vi).expect("a variant");
        if nh / nkv > 16 * warps {
            continue;
        }
        let wg = vi == PREFILL_WGMMA;
        if wg && !prefill_wg_supported(nh, nkv, hd, false) {
            continue;
        }
        let mut out = poisoned(dev, q.len());
        let launched = AttentionCall {
            q: &qd,
            cache: KvCacheRef::Bf16 { k: &kd, v: &vd },
            meta: &mut meta,
            n_heads: nh,
            geo,
            scale,
            out: &mut out,
            kernel: AttnKernel::Prefill { variant: vi },
            split: AttnSplit::Auto,
            options: AttentionOptions::default(),
        }
        .launch(dev);
        if wg && !dev.prefill_wgmma_capable() {
            // Off Hopper the warpgroup kernel is refused, naming why.
            let msg = launched.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains("sm_90a"), "{what}: the warpgroup kernel off sm_90a: {msg:?}");
            continue;
        }
        launched.expect("prefill_attention");
        let got = down(dev, &out, q.len());
        let (mut g, mut wnt) = (Vec::new(), Vec::new());
        for (r, &p) in is_prefill.iter().enumerate() {
            let span = r * w..(r + 1) * w;
            if p {
                g.extend_from_slice(&got[span.clone()]);
                wnt.extend_from_slice(&want[span]);
            } else {
                assert!(got[span].iter().all(|v| v.is_nan()), "{what}: prefill kernel wrote decode row {r}");
            }
        }
        let kernel = if wg { "warpgroup MMA".to_string() } else { format!("{warps} warps") };
        check(&format!("prefill only, {kernel}, {what}"), &g, &wnt);
    }
}

#[test]
fn gpu_prefill_attention_matches_cpu() {
    let dev = device();
    let mut r = rng("prefill_attention");
    // Decode rows between chunks; chunks with and without a cached prefix (prefix lengths off
    // the block size and off the 64-key tile), prompt lengths around the tile sizes.
    let mixed = [(0usize, 1usize), (37, 20), (0, 17), (16, 1), (5, 63), (0, 64), (1000, 1), (3, 65), (0, 300), (70, 1)];
    // Prefill only (no decode row at all), prefill rows before decode rows.
    let prefill_only = [(0usize, 2usize), (129, 64), (0, 1)];
    for hd in [64usize, 128] {
        for &(nh, nkv) in &[(8usize, 8usize), (32, 8), (64, 8), (28, 4)] {
            for bs in [16usize, 7] {
                prefill_case(&dev, &mut r, hd, nh, nkv, bs, &mixed);
            }
        }
        prefill_case(&dev, &mut r, hd, 32, 8, 5, &prefill_only);
        prefill_case(&dev, &mut r, hd, 16, 16, 16, &[(0, 2), (61, 3)]);
    }
    // Long prompts: from scratch, and over a long cached prefix, odd block size.
    prefill_case(&dev, &mut r, 128, 32, 8, 16, &[(0, 1100), (2000, 1)]);
    prefill_case(&dev, &mut r, 64, 8, 8, 5, &[(517, 1030)]);
    prefill_case(&dev, &mut r, 128, 64, 8, 1, &[(3, 1001)]);
    // The tiny test models' head dims; a group of 64 heads (1 token per tile).
    prefill_case(&dev, &mut r, 16, 4, 2, 16, &mixed);
    prefill_case(&dev, &mut r, 32, 8, 2, 7, &mixed);
    prefill_case(&dev, &mut r, 64, 64, 1, 16, &[(0, 40), (9, 1)]);
    // A group past the default tile: the router falls back to the decode kernel (the 8-warp
    // variant, 128 rows, still runs it).
    prefill_case(&dev, &mut r, 64, 128, 1, 16, &[(0, 20), (9, 1)]);
}

/// The prefill launcher refuses inconsistent shapes on a device too (the device-free
/// refusals are unit tests of `cuda::attention`).
#[test]
fn gpu_prefill_attention_refuses_bad_shapes() {
    let dev = device();
    let table = [0u32, 1, 2, 3];
    let seqs = [HostSeq { row_start: 0, n_tokens: 40, start_pos: 0, block_table: &table }];
    let mut meta = StepMeta::new(&dev).expect("meta");
    meta.set(&dev, &seqs, 40, 16, 4).expect("meta set");
    let geo = KvGeometry { num_blocks: 4, block_size: 16, n_kv_heads: 2, head_dim: 64 };
    let kv = dev.alloc::<bf16>(geo.layer_len()).expect("alloc");
    let q = dev.alloc::<bf16>(40 * 8 * 64).expect("alloc");
    let mut out = dev.alloc::<bf16>(40 * 8 * 64).expect("alloc");
    let short = dev.alloc::<bf16>(40 * 8 * 64 - 1).expect("alloc");
    let mut prefill = |q: &CudaSlice<bf16>, n_heads: usize, geo: KvGeometry| {
        AttentionCall {
            q,
            cache: KvCacheRef::Bf16 { k: &kv, v: &kv },
            meta: &mut meta,
            n_heads,
            geo,
            scale: 0.1,
            out: &mut out,
            kernel: AttnKernel::Prefill { variant: PREFILL_DEFAULT_VARIANT },
            split: AttnSplit::Auto,
            options: AttentionOptions::default(),
        }
        .launch(&dev)
    };
    assert!(prefill(&short, 8, geo).is_err(), "short q");
    assert!(prefill(&q, 7, geo).is_err(), "heads vs KV heads");
    assert!(prefill(&q, 8, KvGeometry { head_dim: 96, ..geo }).is_err(), "head_dim 96");
    assert!(prefill(&q, 8, KvGeometry { block_size: 8, ..geo }).is_err(), "geometry");
    dev.synchronize().expect("nothing was launched");
}
