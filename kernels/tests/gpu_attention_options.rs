//! The tuned attention kernels (decode: `paged_attention_*`, `paged_attention_tc_*`, their FP8
//! entries and the split combine; prefill: `prefill_attention_*`, both CTA sizes, and the
//! router) with a sliding window, logit soft-capping and attention sinks
//! ([`AttentionOptions`]), at head dims 64, 128 and 256 (no prefill kernel at 256: the router
//! sends it to the decode kernel), GQA groups 1 to 12, every split mode, bf16 and FP8 caches,
//! against `cpu::paged_attention_ext` / `cpu::paged_attention_fp8`.
//! Windows smaller than, equal to and larger than a row's context, windows that start inside
//! a block, sinks far below and far above the scores, padding rows (context 0: zeros). Fresh
//! random inputs every run (the seed is printed), outputs poisoned (NaN) before each launch,
//! ‖out − ref‖ / ‖ref‖ < 1e-2. The streaming variants of one query-head count (wide rings of
//! bulk copies, and the one-warp ring of 16-byte copies) must also give bit-identical outputs at
//! the same split count: the launcher picks among them by batch size, and a row's output must
//! not depend on the rows beside it.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::{self, AttnExtras, Fp8KvLayerRef, KvLayerRef, SeqSpan};
use baton_kernels::cuda::{
    ATTN_FP8_VARIANTS, ATTN_VARIANTS, AttentionCall, AttentionOptions, AttnKernel, AttnKind, AttnSplit, AttnVariant,
    CudaDevice, CudaSlice, HostSeq, KvCacheRef, KvGeometry, PREFILL_WARPS, StepMeta, bf16, prefill_supported,
};
use common::{check, device, down, poisoned, rand_vec, rng, shuffled_tables, up};
use rand::{Rng, rngs::StdRng};
use std::collections::HashMap;

/// The step: a prefill chunk of 30 rows over 45 cached tokens, decode rows at contexts 1, 37,
/// 1000 and 4100; then padding rows.
const SPECS: [(usize, usize); 5] = [(45, 30), (0, 1), (36, 1), (999, 1), (4099, 1)];
const PAD: usize = 2;

/// One set of options: a label, the window, the soft-cap, the sinks.
type OptionSet = (String, Option<usize>, Option<f32>, Option<Vec<f32>>);

/// Windows below, at and past the contexts (1000 equals a row's context; 100 and 333 start
/// inside a block of 16 or 5 at context 1000), soft-caps tight and loose, sinks far below and
/// far above the scores (which lie within a few units), and everything at once.
fn option_sets(r: &mut StdRng, nh: usize) -> Vec<OptionSet> {
    let mut sinks = |lo: f32, hi: f32| Some((0..nh).map(|_| r.random_range(lo..hi)).collect::<Vec<f32>>());
    let (small, large, mixed) = (sinks(-8.0, -1.0), sinks(6.0, 14.0), sinks(-2.0, 4.0));
    vec![
        ("plain".into(), None, None, None),
        ("window 1".into(), Some(1), None, None),
        ("window 100".into(), Some(100), None, None),
        ("window 333".into(), Some(333), None, None),
        ("window 1000".into(), Some(1000), None, None),
        ("window 5000".into(), Some(5000), None, None),
        ("softcap 1.5".into(), None, Some(1.5), None),
        ("softcap 30 window 200".into(), Some(200), Some(30.0), None),
        ("small sinks".into(), None, None, small),
        ("large sinks".into(), None, None, large),
        ("window 64 softcap 5 sinks".into(), Some(64), Some(5.0), mixed),
    ]
}

/// The cache a case runs over: bf16 values, or E4M3 codes with their scales (and the values
/// the reference reads them as).
enum Cache {
    Bf16 { k: Vec<f32>, v: Vec<f32> },
    Fp8 { k: Vec<u8>, v: Vec<u8>, k_scale: f32, v_scale: f32 },
}

/// What every launch of one (head_dim, heads, block size, cache) case shares.
struct Step {
    geo: KvGeometry,
    nh: usize,
    tables: Vec<Vec<u32>>,
    q: Vec<f32>,
    scale: f32,
    meta: StepMeta,
}

impl Step {
    fn new(dev: &CudaDevice, r: &mut StdRng, hd: usize, nh: usize, nkv: usize, bs: usize) -> Self {
        let (num_blocks, tables, rows) = shuffled_tables(r, &SPECS, bs, 4);
        let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let q = rand_vec(r, (rows + PAD) * nh * hd, 1.0);
        let mut meta = StepMeta::new(dev).expect("meta");
        let mut host = Vec::new();
        let mut row = 0;
        for (&(start, n), t) in SPECS.iter().zip(&tables) {
            host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
            row += n;
        }
        meta.set_padded(dev, &host, rows, rows + PAD, bs, num_blocks).expect("meta set");
        // Scores of a few units (the soft-caps bite).
        let scale = 2.5 / (hd as f32).sqrt();
        Self { geo, nh, tables, q, scale, meta }
    }

    /// The reference: each sequence through the CPU kernel, padding rows zero.
    fn reference(&self, cache: &Cache, extras: AttnExtras<'_>) -> Vec<f32> {
        let (geo, w) = (self.geo, self.nh * self.geo.head_dim);
        let mut want = vec![0.0; self.q.len()];
        let mut row = 0;
        for (&(start, n), t) in SPECS.iter().zip(&self.tables) {
            let span = SeqSpan { start_pos: start, n_tokens: n, block_table: t };
            let (q, out) = (&self.q[row * w..(row + n) * w], &mut want[row * w..(row + n) * w]);
            match cache {
                Cache::Bf16 { k, v } => {
                    let layer = KvLayerRef {
                        k,
                        v,
                        block_size: geo.block_size,
                        n_kv_heads: geo.n_kv_heads,
                        head_dim: geo.head_dim,
                    };
                    cpu::paged_attention_ext(q, self.nh, self.scale, span, layer, extras, out)
                }
                Cache::Fp8 { k, v, k_scale, v_scale } => {
                    let layer = Fp8KvLayerRef {
                        k,
                        v,
                        k_scale: *k_scale,
                        v_scale: *v_scale,
                        block_size: geo.block_size,
                        n_kv_heads: geo.n_kv_heads,
                        head_dim: geo.head_dim,
                    };
                    cpu::paged_attention_fp8(q, self.nh, self.scale, span, layer, extras, out)
                }
            }
            .expect("cpu attention");
            row += n;
        }
        want
    }
}

/// The launches a case makes for a cache, each a sequence of kernels into one output: every
/// listed decode variant at every split mode (unsplit, `Auto`, a forced 3, and `Exact` as a
/// graph replays, with more splits than a windowed row has chunks); the router; the decode
/// kernel then each prefill variant over the prefill chunk's rows.
fn launches(fp8: bool) -> Vec<(String, Vec<AttnKernel>, AttnSplit)> {
    let splits = [AttnSplit::Fixed(1), AttnSplit::Auto, AttnSplit::Fixed(3), AttnSplit::Exact(7), AttnSplit::Exact(32)];
    let variants: Vec<usize> = if fp8 {
        (0..ATTN_FP8_VARIANTS.len()).collect()
    } else {
        // A register variant with prefetch, and every tensor-core and streaming shape.
        let reg = ATTN_VARIANTS.iter().position(|v| v.kind == AttnKind::Registers && v.prefetch).expect("register");
        let tc = ATTN_VARIANTS.iter().enumerate().filter(|(_, v)| v.kind != AttnKind::Registers).map(|(i, _)| i);
        std::iter::once(reg).chain(tc).collect()
    };
    let mut runs = Vec::new();
    for v in variants {
        for split in splits {
            runs.push((format!("variant {v} {split:?}"), vec![AttnKernel::Decode { variant: Some(v) }], split));
        }
    }
    runs.push(("mixed".into(), vec![AttnKernel::Mixed], AttnSplit::Auto));
    for variant in 0..PREFILL_WARPS.len() {
        let label = format!("decode then prefill {variant}");
        runs.push((label, vec![AttnKernel::DECODE, AttnKernel::Prefill { variant }], AttnSplit::Auto));
    }
    runs
}

/// Every option set × launch of [`launches`] over one step and cache.
fn options_case(dev: &CudaDevice, r: &mut StdRng, hd: usize, nh: usize, nkv: usize, bs: usize, fp8: bool) {
    let mut step = Step::new(dev, r, hd, nh, nkv, bs);
    let len = step.geo.layer_len();
    let cache = if fp8 {
        let (k_scale, v_scale) = (0.02f32, 0.5f32);
        let (mut k, mut v) = (vec![0u8; len], vec![0u8; len]);
        cpu::fp8::quantize_e4m3(&rand_vec(r, len, 8.0), k_scale, &mut k);
        cpu::fp8::quantize_e4m3(&rand_vec(r, len, 200.0), v_scale, &mut v);
        Cache::Fp8 { k, v, k_scale, v_scale }
    } else {
        Cache::Bf16 { k: rand_vec(r, len, 1.0), v: rand_vec(r, len, 1.0) }
    };
    let (kb, vb): (CudaSlice<bf16>, CudaSlice<bf16>);
    let (k8, v8): (CudaSlice<u8>, CudaSlice<u8>);
    let cache_ref = match &cache {
        Cache::Bf16 { k, v } => {
            (kb, vb) = (up(dev, k), up(dev, v));
            KvCacheRef::Bf16 { k: &kb, v: &vb }
        }
        Cache::Fp8 { k, v, k_scale, v_scale } => {
            (k8, v8) = (dev.upload(k).expect("k codes"), dev.upload(v).expect("v codes"));
            KvCacheRef::Fp8 { k: &k8, v: &v8, k_scale: *k_scale, v_scale: *v_scale }
        }
    };
    let qd = up(dev, &step.q);
    let tag = format!("{} hd={hd} heads={nh}/{nkv} bs={bs}", if fp8 { "fp8" } else { "bf16" });
    let table: &[AttnVariant] = if fp8 { &ATTN_FP8_VARIANTS } else { &ATTN_VARIANTS };
    for (label, window, softcap, sinks) in option_sets(r, nh) {
        // The first streaming output per (query heads a warp, exact split mode): (run, bits).
        let mut stream_bits: HashMap<(u32, String), (String, Vec<u32>)> = HashMap::new();
        let extras = AttnExtras { window, softcap, sinks: sinks.as_deref() };
        let want = step.reference(&cache, extras);
        let sinks_d = sinks.as_ref().map(|s| dev.upload(s).expect("sinks"));
        let options = AttentionOptions { window, softcap, sinks: sinks_d.as_ref() };
        for (run, kernels, split) in launches(fp8) {
            if kernels.iter().any(|k| matches!(k, AttnKernel::Prefill { .. })) && !prefill_supported(nh, nkv, hd) {
                continue;
            }
            let stream = match kernels.as_slice() {
                [AttnKernel::Decode { variant: Some(v) }] if table[*v].kind == AttnKind::Stream => Some(table[*v]),
                _ => None,
            };
            let mut out = poisoned(dev, want.len());
            for kernel in kernels {
                AttentionCall {
                    q: &qd,
                    cache: cache_ref,
                    meta: &mut step.meta,
                    n_heads: nh,
                    geo: step.geo,
                    scale: step.scale,
                    out: &mut out,
                    kernel,
                    split,
                    options,
                }
                .launch(dev)
                .unwrap_or_else(|e| panic!("{tag} {label} {run}: {e}"));
            }
            let got = down(dev, &out, want.len());
            // Padding rows: exact zeros.
            let real = (step.q.len() / (nh * hd) - PAD) * nh * hd;
            assert!(got[real..].iter().all(|&x| x == 0.0), "{tag} {label} {run}: padding rows not zero");
            check(&format!("{tag} {label} {run}"), &got, &want);
            // Split modes that fix the count whatever the variant (`Auto` and `Fixed(3)` plan
            // from the variant's CTAs a row).
            let exact = match split {
                AttnSplit::Fixed(1) | AttnSplit::Exact(_) => Some(format!("{split:?}")),
                _ => None,
            };
            if let (Some(v), Some(split)) = (stream, exact) {
                let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                match stream_bits.get(&(v.max_group, split.clone())) {
                    Some((first, want_bits)) => {
                        let diff = bits.iter().zip(want_bits).filter(|(a, b)| a != b).count();
                        assert_eq!(diff, 0, "{tag} {label}: {run} differs from {first} in {diff} outputs");
                    }
                    None => {
                        stream_bits.insert((v.max_group, split), (run.clone(), bits));
                    }
                }
            }
        }
    }
}

/// Head dims 64 (gpt-oss), 128 (Llama, Qwen3) and 256 (Gemma 2/3) × GQA groups 1, 2, 4, 8 and
/// 12 (the 16-head shape) over a bf16 cache; block size 5 at head_dim 64 (windows start
/// anywhere in a block).
#[test]
fn gpu_tuned_attention_options_match_cpu_bf16() {
    let dev = device();
    let mut r = rng("attention_options_bf16");
    for (hd, bs) in [(64usize, 5usize), (128, 16), (256, 16)] {
        for group in [1usize, 2, 4, 8, 12] {
            options_case(&dev, &mut r, hd, 2 * group, 2, bs, false);
        }
    }
}

/// As [`gpu_tuned_attention_options_match_cpu_bf16`] over an FP8 (E4M3) cache with its scales.
#[test]
fn gpu_tuned_attention_options_match_cpu_fp8() {
    let dev = device();
    let mut r = rng("attention_options_fp8");
    for (hd, bs) in [(64usize, 5usize), (128, 16), (256, 16)] {
        for group in [1usize, 2, 4, 8, 12] {
            options_case(&dev, &mut r, hd, 2 * group, 2, bs, true);
        }
    }
}

/// Bad options are refused before anything is enqueued, by both kernels: a window of 0, a
/// soft-cap that is not finite and positive, fewer sinks than heads.
#[test]
fn gpu_tuned_attention_refuses_bad_options() {
    let dev = device();
    let mut r = rng("attention_options_refusals");
    let (hd, nh, nkv) = (128usize, 8usize, 2usize);
    let mut step = Step::new(&dev, &mut r, hd, nh, nkv, 16);
    let len = step.geo.layer_len();
    let (k, v) = (up(&dev, &rand_vec(&mut r, len, 1.0)), up(&dev, &rand_vec(&mut r, len, 1.0)));
    let qd = up(&dev, &step.q);
    let short = dev.upload(&vec![0.0f32; nh - 1]).expect("short sinks");
    let bad: [(&str, AttentionOptions<'_>); 4] = [
        ("window 0", AttentionOptions { window: Some(0), ..Default::default() }),
        ("softcap 0", AttentionOptions { softcap: Some(0.0), ..Default::default() }),
        ("softcap NaN", AttentionOptions { softcap: Some(f32::NAN), ..Default::default() }),
        ("short sinks", AttentionOptions { sinks: Some(&short), ..Default::default() }),
    ];
    let kernels = [AttnKernel::DECODE, AttnKernel::Prefill { variant: 0 }, AttnKernel::Mixed];
    for ((label, options), kernel) in bad.into_iter().flat_map(|b| kernels.map(|k| (b, k))) {
        let mut out = poisoned(&dev, step.q.len());
        let call = AttentionCall {
            q: &qd,
            cache: KvCacheRef::Bf16 { k: &k, v: &v },
            meta: &mut step.meta,
            n_heads: nh,
            geo: step.geo,
            scale: step.scale,
            out: &mut out,
            kernel,
            split: AttnSplit::Auto,
            options,
        };
        assert!(call.launch(&dev).is_err(), "{label} accepted by {kernel:?}");
    }
}
