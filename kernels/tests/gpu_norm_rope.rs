//! The RoPE-fused qkv product ([`NormRopeCall`]) against the two launches it replaces
//! ([`NormLinearCall`] into the qkv rows, then [`RopeKvCall`] / [`RopeKvFp8Call`] with the fused
//! input), with the same skinny-GEMM variant, on fresh random inputs (the seed is printed):
//! - the rotated q bit for bit, every row (padding rows included);
//! - the K and V caches bit for bit, everywhere: both start NaN-poisoned, so a slot one path
//!   writes and the other does not, or a stray write, differs;
//! - that the comparison is not vacuous: every real row's slot was written (no NaN left in it)
//!   and q holds no NaN;
//! - with and without a qkv bias (Qwen2's: added to the rounded product before the rotation);
//! - bf16 and FP8 (E4M3, scales not 1) caches; head_dim 64, 128 and 256; GQA; decode rows at
//!   positions up to 10⁵ in shuffled blocks, followed by padding rows (slot −1: q only); an
//!   attention factor ≠ 1 (YaRN's); every variant, for 1 to 16 rows;
//! - the refusals: a head_dim off a multiple of 16, metadata for other rows, a bad FP8 scale.
//!
//! The same epilogue over FP8 weights ([`Fp8RopeGemvCall`], bf16 x) against [`Fp8GemvCall`]
//! then the RoPE kernel, bit for bit, the same checks: per-channel and 64 × 64 block scales,
//! every FP8 variant, 1 to 48 rows (several CTAs a weight tile past 16).
//!
//! Needs a GPU: named `gpu_*`, excluded from CI by name, and FAILS (does not skip) when no
//! device can be opened.

mod common;

use baton_kernels::cpu::{Fp8Matrix, RopeScalingKind, RopeTable};
use baton_kernels::cuda::{
    BiasAddCall, CudaDevice, CudaSlice, Fp8GemvCall, Fp8RopeGemvCall, Fp8Weights, GEMV_FP8_VARIANTS, GEMV_VARIANTS,
    HostSeq, KvGeometry, NormInput, NormLinearCall, NormLinearOut, NormRopeCall, RopeCache, RopeExtras, RopeInput,
    RopeKvCall, RopeKvFp8Call, RopeOut, StepMeta, bf16, norm_stat_parts,
};
use common::{device, rand_vec, rng, up};
use rand::{Rng, rngs::StdRng};

const EPS: f32 = 1e-5;
const BS: usize = 16;
const K_SCALE: f32 = 0.37;
const V_SCALE: f32 = 0.11;

/// One case: `real` decode rows (then `pad` padding rows) of a layer with `nh` / `nkv` heads of
/// `hd`, over a `k`-wide residual.
#[derive(Clone, Copy)]
struct Case {
    hd: usize,
    nh: usize,
    nkv: usize,
    k: usize,
    real: usize,
    pad: usize,
    /// Whether the projection has a bias (Qwen2's qkv bias).
    bias: bool,
}

/// Which cache the case writes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cache {
    Bf16,
    Fp8,
    /// FP8 with a key shift (`Inputs::k_shift`) subtracted before each key is quantized.
    Fp8Shifted,
}

/// The step's inputs on the device.
struct Inputs {
    geo: KvGeometry,
    meta: StepMeta,
    residual: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    norm: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    inv: CudaSlice<f64>,
    /// Slot of each real row (padding rows have none).
    slots: Vec<usize>,
    /// The FP8 products' input (`m × k` bf16) and weights: `w` quantized per channel, and the
    /// same codes with 64 × 64 block scales (where k is a multiple of 16).
    x: CudaSlice<bf16>,
    w8: Vec<Fp8Weights>,
    /// A bias for the projection's rows (used where the case has one).
    bias: CudaSlice<bf16>,
    /// A key shift (`nkv × hd` f32) for [`Cache::Fp8Shifted`].
    k_shift: CudaSlice<f32>,
}

fn inputs(dev: &CudaDevice, r: &mut StdRng, c: &Case) -> Inputs {
    let m = c.real + c.pad;
    let n = (c.nh + 2 * c.nkv) * c.hd;
    // One block of its own per row, dealt from a shuffled pool with spares.
    let num_blocks = c.real + 7;
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, r.random_range(0..=i));
    }
    let positions: Vec<usize> = (0..c.real).map(|_| r.random_range(0..100_000)).collect();
    // Every logical block before the row's own points anywhere (never read here).
    let tables: Vec<Vec<u32>> = positions
        .iter()
        .zip(&pool)
        .map(|(&p, &own)| (0..=p / BS).map(|lb| if lb == p / BS { own } else { pool[0] }).collect())
        .collect();
    let host: Vec<HostSeq<'_>> = positions
        .iter()
        .zip(&tables)
        .enumerate()
        .map(|(row, (&p, t))| HostSeq { row_start: row, n_tokens: 1, start_pos: p, block_table: t })
        .collect();
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, c.real, m, BS, num_blocks).expect("meta set");
    let slots = positions.iter().zip(&pool).map(|(&p, &own)| own as usize * BS + p % BS).collect();
    // The residual and its stats as a residual product leaves them (sums of squares per 16
    // columns), the norm's weight and the qkv weights.
    let residual: Vec<f32> = (0..m * c.k).map(|_| r.random_range(-2.0f32..2.0)).collect();
    let parts = norm_stat_parts(c.k);
    let stats: Vec<f32> = (0..m * parts)
        .map(|i| {
            let (row, p) = (i / parts, i % parts);
            residual[row * c.k + p * 16..(row * c.k + (p + 1) * 16).min((row + 1) * c.k)].iter().map(|v| v * v).sum()
        })
        .collect();
    let scaling = RopeScalingKind::Linear { factor: 2.0 };
    let table = RopeTable::new(c.hd, 500_000.0, scaling).expect("table");
    let wv = rand_vec(r, n * c.k, 0.08);
    let mut w8 = Vec::new();
    if c.k.is_multiple_of(16) {
        let chan = Fp8Matrix::quantize_per_channel(&wv, n, c.k).expect("quantize");
        let scales = (0..n.div_ceil(64) * c.k.div_ceil(64)).map(|_| r.random_range(0.5f32..2.0) * 1e-3).collect();
        let blocked = Fp8Matrix::new(n, c.k, chan.codes().to_vec(), scales, 64, 64).expect("blocked");
        w8 = [chan, blocked].iter().map(|w| Fp8Weights::upload(dev, w).expect("upload")).collect();
    }
    Inputs {
        geo: KvGeometry { num_blocks, block_size: BS, n_kv_heads: c.nkv, head_dim: c.hd },
        meta,
        residual: dev.upload(&residual).expect("residual"),
        stats: dev.upload(&stats).expect("stats"),
        norm: up(dev, &rand_vec(r, c.k, 1.5)),
        w: up(dev, &wv),
        inv: dev.upload(table.inv_freq()).expect("inv_freq"),
        slots,
        x: up(dev, &rand_vec(r, m * c.k, 1.0)),
        w8,
        bias: up(dev, &rand_vec(r, n, 0.5)),
        k_shift: dev.upload(&rand_vec(r, c.nkv * c.hd, 0.3)).expect("k_shift"),
    }
}

/// q and both caches after one route, as raw bits (bf16 caches as u16, FP8 as u8 widened).
struct Written {
    q: Vec<u16>,
    k: Vec<u16>,
    v: Vec<u16>,
}

fn bits(dev: &CudaDevice, s: &CudaSlice<bf16>, n: usize) -> Vec<u16> {
    dev.download(s, n).expect("download").iter().map(|x| x.to_bits()).collect()
}

fn bytes(dev: &CudaDevice, s: &CudaSlice<u8>, n: usize) -> Vec<u16> {
    dev.download(s, n).expect("download").iter().map(|&x| u16::from(x)).collect()
}

/// The E4M3 NaN code (0x7F): what the FP8 caches are poisoned with.
const FP8_NAN: u8 = 0x7f;

impl Inputs {
    /// The normalized activation's source.
    fn norm_input(&self) -> NormInput<'_> {
        NormInput { residual: &self.residual, stats: &self.stats, norm: &self.norm, eps: EPS }
    }

    /// The fused call over these inputs for `m` rows (the case's, or not: the refusals) of `geo`.
    fn norm_rope<'a>(
        &'a self,
        c: &Case,
        m: usize,
        geo: KvGeometry,
        q_out: &'a mut CudaSlice<bf16>,
        cache: RopeCache<'a>,
        attention_factor: Option<f32>,
        variant: Option<usize>,
    ) -> NormRopeCall<'a> {
        NormRopeCall {
            input: self.norm_input(),
            m,
            k: c.k,
            w: &self.w,
            rope: self.rope(c, q_out, cache, attention_factor, geo),
            variant,
        }
    }

    /// Where an epilogue over these inputs writes.
    fn rope<'a>(
        &'a self,
        c: &Case,
        q_out: &'a mut CudaSlice<bf16>,
        cache: RopeCache<'a>,
        attention_factor: Option<f32>,
        geo: KvGeometry,
    ) -> RopeOut<'a> {
        let bias = c.bias.then_some(&self.bias);
        RopeOut { n_heads: c.nh, q_out, cache, meta: &self.meta, inv_freq: &self.inv, bias, attention_factor, geo }
    }
}

/// The qkv product a route runs: the norm-input bf16 one, or the FP8 one over `x.w8[i]`.
#[derive(Clone, Copy, Debug)]
enum Product {
    Norm,
    Fp8(usize),
}

/// Runs one route of `product` (`fused`: the RoPE epilogue; else the product then the RoPE
/// kernel).
fn route(dev: &CudaDevice, c: &Case, x: &Inputs, p: Product, cache: Cache, variant: usize, fused: bool) -> Written {
    let m = c.real + c.pad;
    let (qd, kvw) = (c.nh * c.hd, c.nkv * c.hd);
    let n = qd + 2 * kvw;
    let len = x.geo.layer_len();
    let mut q = dev.upload(&vec![bf16::NAN; m * qd]).expect("q");
    let (mut kb, mut vb) =
        (dev.upload(&vec![bf16::NAN; len]).expect("k"), dev.upload(&vec![bf16::NAN; len]).expect("v"));
    let (mut k8, mut v8) = (dev.upload(&vec![FP8_NAN; len]).expect("k8"), dev.upload(&vec![FP8_NAN; len]).expect("v8"));
    let factor = Some(0.8f32);
    if fused {
        let rope_cache = match cache {
            Cache::Bf16 => RopeCache::Bf16 { k: &mut kb, v: &mut vb },
            Cache::Fp8 => RopeCache::Fp8 { k: &mut k8, v: &mut v8, k_scale: K_SCALE, v_scale: V_SCALE, k_shift: None },
            Cache::Fp8Shifted => {
                let k_shift = Some(&x.k_shift);
                RopeCache::Fp8 { k: &mut k8, v: &mut v8, k_scale: K_SCALE, v_scale: V_SCALE, k_shift }
            }
        };
        match p {
            Product::Norm => x.norm_rope(c, m, x.geo, &mut q, rope_cache, factor, Some(variant)).launch(dev),
            Product::Fp8(i) => {
                let rope = x.rope(c, &mut q, rope_cache, factor, x.geo);
                Fp8RopeGemvCall { x: &x.x, m, w: &x.w8[i], rope, variant: Some(variant) }.launch(dev)
            }
        }
        .expect("the RoPE epilogue");
    } else {
        let mut qkv = dev.upload(&vec![bf16::NAN; m * n]).expect("qkv");
        match p {
            Product::Norm => NormLinearCall {
                input: x.norm_input(),
                m,
                k: c.k,
                w: &x.w,
                kind: NormLinearOut::Plain { n },
                out: &mut qkv,
                variant: Some(variant),
            }
            .launch(dev),
            Product::Fp8(i) => {
                Fp8GemvCall { x: &x.x, m, w: &x.w8[i], out: &mut qkv, variant: Some(variant) }.launch(dev)
            }
        }
        .expect("the product");
        if c.bias {
            BiasAddCall { x: &mut qkv, bias: &x.bias, rows: m, n }.launch(dev).expect("bias_add");
        }
        let input = RopeInput::Fused { qkv: &qkv, q_out: &mut q };
        let extras = RopeExtras { attention_factor: factor, ..Default::default() };
        let (meta, inv, geo, nh) = (&x.meta, &x.inv, x.geo, c.nh);
        match cache {
            Cache::Bf16 => {
                RopeKvCall { input, k_cache: &mut kb, v_cache: &mut vb, meta, inv_freq: inv, n_heads: nh, geo }
                    .launch_with(dev, extras)
            }
            Cache::Fp8 | Cache::Fp8Shifted => RopeKvFp8Call {
                input,
                k_cache: &mut k8,
                v_cache: &mut v8,
                k_scale: K_SCALE,
                v_scale: V_SCALE,
                k_shift: (cache == Cache::Fp8Shifted).then_some(&x.k_shift),
                meta,
                inv_freq: inv,
                n_heads: nh,
                geo,
            }
            .launch_with(dev, extras),
        }
        .expect("rope_qkv_write_kv");
    }
    let q = bits(dev, &q, m * qd);
    match cache {
        Cache::Bf16 => Written { q, k: bits(dev, &kb, len), v: bits(dev, &vb, len) },
        Cache::Fp8 | Cache::Fp8Shifted => Written { q, k: bytes(dev, &k8, len), v: bytes(dev, &v8, len) },
    }
}

fn is_nan(cache: Cache, b: u16) -> bool {
    match cache {
        Cache::Bf16 => bf16::from_bits(b).is_nan(),
        Cache::Fp8 | Cache::Fp8Shifted => b & 0x7f == 0x7f,
    }
}

/// Both routes of `p` over `c` for every cache and variant (`variants` of them), bit for bit.
fn assert_routes_agree(dev: &CudaDevice, c: &Case, x: &Inputs, p: Product, variants: usize) {
    let m = c.real + c.pad;
    let kvw = c.nkv * c.hd;
    for cache in [Cache::Bf16, Cache::Fp8, Cache::Fp8Shifted] {
        for variant in 0..variants {
            let what = format!(
                "{p:?} hd={} heads={}/{} m={m} ({} padding) bias {} {cache:?} variant {variant}",
                c.hd, c.nh, c.nkv, c.pad, c.bias
            );
            let want = route(dev, c, x, p, cache, variant, false);
            let got = route(dev, c, x, p, cache, variant, true);
            // Not vacuous: the reference wrote every q and every real row's slot.
            assert!(want.q.iter().all(|&b| !bf16::from_bits(b).is_nan()), "{what}: the reference left q unwritten");
            for &slot in &x.slots {
                let span = slot * kvw..(slot + 1) * kvw;
                assert!(want.k[span.clone()].iter().all(|&b| !is_nan(cache, b)), "{what}: K slot {slot} unwritten");
                assert!(want.v[span].iter().all(|&b| !is_nan(cache, b)), "{what}: V slot {slot} unwritten");
            }
            if cache == Cache::Fp8Shifted {
                // Not vacuous either: the shift changed the stored keys (and only them).
                let plain = route(dev, c, x, p, Cache::Fp8, variant, false);
                assert_ne!(plain.k, want.k, "{what}: the shift left every key code as it was");
                assert_eq!(plain.v, want.v, "{what}: the shift moved a value");
            }
            for (name, a, b) in [("q", &got.q, &want.q), ("K cache", &got.k, &want.k), ("V cache", &got.v, &want.v)] {
                let diff = a.iter().zip(b.iter()).filter(|(x, y)| x != y).count();
                assert_eq!(
                    diff,
                    0,
                    "{what}: {name} differs from the two-launch route in {diff} of {} elements",
                    a.len()
                );
            }
        }
        println!("{p:?} hd={} m={m} {cache:?}: bit-identical, every variant", c.hd);
    }
}

#[test]
fn gpu_norm_rope_equals_norm_linear_then_rope() {
    let dev = device();
    let mut r = rng("norm_rope");
    let cases = [
        Case { hd: 128, nh: 8, nkv: 2, k: 512, real: 1, pad: 0, bias: false },
        Case { hd: 128, nh: 8, nkv: 2, k: 520, real: 6, pad: 2, bias: false },
        Case { hd: 64, nh: 6, nkv: 3, k: 256, real: 9, pad: 3, bias: false },
        Case { hd: 256, nh: 4, nkv: 1, k: 384, real: 16, pad: 0, bias: false },
        Case { hd: 128, nh: 16, nkv: 4, k: 1024, real: 13, pad: 3, bias: false },
        Case { hd: 128, nh: 16, nkv: 4, k: 1024, real: 13, pad: 3, bias: true },
        Case { hd: 64, nh: 6, nkv: 3, k: 256, real: 1, pad: 0, bias: true },
    ];
    for c in &cases {
        let x = inputs(&dev, &mut r, c);
        assert_routes_agree(&dev, c, &x, Product::Norm, GEMV_VARIANTS.len());
    }
}

#[test]
fn gpu_fp8_rope_gemv_equals_fp8_gemv_then_rope() {
    let dev = device();
    let mut r = rng("fp8_rope_gemv");
    let cases = [
        Case { hd: 128, nh: 8, nkv: 2, k: 512, real: 1, pad: 0, bias: false },
        Case { hd: 64, nh: 6, nkv: 3, k: 256, real: 9, pad: 3, bias: false },
        Case { hd: 256, nh: 4, nkv: 1, k: 384, real: 16, pad: 0, bias: false },
        Case { hd: 128, nh: 16, nkv: 4, k: 1024, real: 13, pad: 3, bias: false },
        Case { hd: 128, nh: 8, nkv: 2, k: 512, real: 40, pad: 8, bias: false },
        Case { hd: 128, nh: 8, nkv: 2, k: 512, real: 40, pad: 8, bias: true },
        Case { hd: 64, nh: 6, nkv: 3, k: 256, real: 9, pad: 3, bias: true },
    ];
    for c in &cases {
        let x = inputs(&dev, &mut r, c);
        assert_eq!(x.w8.len(), 2, "k = {} takes the FP8 kernel", c.k);
        for i in 0..x.w8.len() {
            assert_routes_agree(&dev, c, &x, Product::Fp8(i), GEMV_FP8_VARIANTS.len());
        }
    }
    // A projection that is not [q; k; v] of the cache's heads is refused, writing nothing.
    let c = &cases[0];
    let x = inputs(&dev, &mut r, c);
    let m = c.real + c.pad;
    let mut q = dev.upload(&vec![bf16::NAN; m * c.nh * c.hd]).expect("q");
    let len = x.geo.layer_len();
    let (mut kb, mut vb) =
        (dev.upload(&vec![bf16::NAN; len]).expect("k"), dev.upload(&vec![bf16::NAN; len]).expect("v"));
    let short = Case { nh: c.nh - 1, ..*c };
    let rope = x.rope(&short, &mut q, RopeCache::Bf16 { k: &mut kb, v: &mut vb }, None, x.geo);
    let e = Fp8RopeGemvCall { x: &x.x, m, w: &x.w8[0], rope, variant: None }.launch(&dev).expect_err("rows");
    assert!(format!("{e}").contains("weight rows"), "{e}");
    assert!(bits(&dev, &q, m * c.nh * c.hd).iter().all(|&b| bf16::from_bits(b).is_nan()), "a refused call wrote q");
}

#[test]
fn gpu_norm_rope_refuses_bad_calls() {
    let dev = device();
    let mut r = rng("norm_rope refusals");
    let c = Case { hd: 128, nh: 8, nkv: 2, k: 512, real: 3, pad: 1, bias: false };
    let x = inputs(&dev, &mut r, &c);
    let m = c.real + c.pad;
    let len = x.geo.layer_len();
    let mut q = dev.upload(&vec![bf16::NAN; m * c.nh * c.hd]).expect("q");
    let (mut k8, mut v8) = (dev.upload(&vec![FP8_NAN; len]).expect("k8"), dev.upload(&vec![FP8_NAN; len]).expect("v8"));
    let (mut kb, mut vb) =
        (dev.upload(&vec![bf16::NAN; len]).expect("k"), dev.upload(&vec![bf16::NAN; len]).expect("v"));
    let base = |q: &mut CudaSlice<bf16>, cache: RopeCache<'_>, m: usize, geo: KvGeometry| {
        x.norm_rope(&c, m, geo, q, cache, None, None).launch(&dev)
    };
    let zero_scale = RopeCache::Fp8 { k: &mut k8, v: &mut v8, k_scale: 0.0, v_scale: 1.0, k_shift: None };
    let e = base(&mut q, zero_scale, m, x.geo).expect_err("a zero FP8 scale");
    assert!(format!("{e}").contains("scale"), "{e}");
    let short = dev.upload(&vec![0.5f32; c.nkv * c.hd - 1]).expect("short shift");
    let short_shift = RopeCache::Fp8 { k: &mut k8, v: &mut v8, k_scale: 1.0, v_scale: 1.0, k_shift: Some(&short) };
    let e = base(&mut q, short_shift, m, x.geo).expect_err("a key shift one value short");
    assert!(format!("{e}").contains("k_shift"), "{e}");
    let e = base(&mut q, RopeCache::Bf16 { k: &mut kb, v: &mut vb }, m - 1, x.geo).expect_err("rows off the metadata");
    assert!(format!("{e}").contains("metadata"), "{e}");
    let odd = KvGeometry { head_dim: 120, ..x.geo };
    let e = base(&mut q, RopeCache::Bf16 { k: &mut kb, v: &mut vb }, m, odd).expect_err("head_dim 120");
    assert!(format!("{e}").contains("head_dim"), "{e}");
    // Nothing was written by the refused calls.
    assert!(bits(&dev, &q, m * c.nh * c.hd).iter().all(|&b| bf16::from_bits(b).is_nan()), "a refused call wrote q");
}
