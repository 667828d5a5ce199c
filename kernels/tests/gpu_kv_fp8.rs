//! The FP8 (E4M3) KV-cache kernels against their CPU references: RoPE + the quantizing KV
//! write (`RopeKvFp8Call`, reference `cpu::write_kv_fp8` on the rotated, bf16-rounded k and
//! v) and attention over an FP8 cache (`AttentionExtFp8Call`, and the tuned decode and
//! prefill kernels through `AttentionCall` with `KvCacheRef::Fp8`; reference
//! `cpu::paged_attention_fp8`), and FP8 KV scale calibration's read-only pass
//! (`RopeKvAmaxCall`, reference `cpu::abs_max` of the same rotated k and of v). Fresh random inputs every run (the seed is printed); caches
//! poisoned with the E4M3 NaN code (0x7F) and outputs with bf16 NaN before each launch.
//!
//! V codes must match the reference exactly (the kernel quantizes the same bf16 value with
//! the same division and rounding). K codes may differ by one step where the GPU's rotation
//! rounds to a neighbouring bf16 value; the test counts those and bounds them. Attention
//! output: ‖out − ref‖ / ‖ref‖ < 1e-2.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::fp8::{E4M3_NAN, e4m3_to_f32};
use baton_kernels::cpu::{
    self, AttnExtras, Fp8KvLayerMut, Fp8KvLayerRef, NormWeight, RopeScalingKind, RopeTable, SeqSpan,
};
use baton_kernels::cuda::{
    ATTN_FP8_VARIANTS, ATTN_VARIANTS, AttentionCall, AttentionExtFp8Call, AttentionOptions, AttnKernel, AttnSplit,
    CudaDevice, CudaSlice, HostSeq, KvCacheRef, KvGeometry, PREFILL_VARIANTS, PREFILL_WGMMA, QkNorm, RopeExtras,
    RopeInput, RopeKvAmaxCall, RopeKvFp8Call, StepMeta, attention_supports, bf16, prefill_variant_warps,
    prefill_wg_supported,
};
use common::{check, device, down, poisoned, rand_vec, rng, shuffled_tables, up};
use rand::Rng;
use rand::rngs::StdRng;

fn codes(dev: &CudaDevice, s: &CudaSlice<u8>, n: usize) -> Vec<u8> {
    dev.download(s, n).expect("download codes")
}

fn poisoned_codes(dev: &CudaDevice, n: usize) -> CudaSlice<u8> {
    dev.upload(&vec![E4M3_NAN; n]).expect("upload poison")
}

/// The bf16 value nearest `x` (what the kernel stores before quantizing).
fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// RoPE + FP8 KV write at `hd` with scales `(ks, vs)`, optionally the q/k norm, both input
/// forms, with padding rows that must write nothing.
fn rope_fp8_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    hd: usize,
    norm: Option<NormWeight>,
    (ks, vs): (f32, f32),
    specs: &[(usize, usize)],
) {
    let (nh, nkv, bs, pad) = (4usize, 2usize, 16usize, 2usize);
    let (num_blocks, tables, rows) = shuffled_tables(r, specs, bs, 3);
    let positions: Vec<usize> = specs.iter().flat_map(|&(s, n)| s..s + n).collect();
    let table = RopeTable::new(hd, 10_000.0, RopeScalingKind::None).expect("table");
    let (qw_len, kw_len) = (nh * hd, nkv * hd);
    // Values past 448 × scale saturate; some are there on purpose. The padding rows are ten
    // times larger: a calibration pass that counted them would show it.
    let q = rand_vec(r, (rows + pad) * qw_len, 2.0);
    let mut k = rand_vec(r, (rows + pad) * kw_len, 600.0 * ks);
    let mut v = rand_vec(r, (rows + pad) * kw_len, 600.0 * vs);
    for x in k[rows * kw_len..].iter_mut().chain(&mut v[rows * kw_len..]) {
        *x = bf(*x * 10.0);
    }
    // bf16-exact, as the kernel reads them (rand_vec is; 1 + x need not be).
    let w: Vec<f32> = rand_vec(r, hd, 0.5).iter().map(|x| bf(x + 1.0)).collect();
    let eps = 1e-6;
    let (mut qn, mut kn) = (q[..rows * qw_len].to_vec(), k[..rows * kw_len].to_vec());
    if let Some(style) = norm {
        cpu::head_rms_norm(&mut qn, &w, eps, style).expect("norm q");
        cpu::head_rms_norm(&mut kn, &w, eps, style).expect("norm k");
    }
    table.apply(&mut qn, nh, &positions).expect("rope q");
    table.apply(&mut kn, nkv, &positions).expect("rope k");
    let kn: Vec<f32> = kn.iter().map(|&x| bf(x)).collect();
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let (mut kc, mut vc) = (vec![E4M3_NAN; geo.layer_len()], vec![E4M3_NAN; geo.layer_len()]);
    let mut row = 0;
    let mut host = Vec::new();
    for (&(start, n), t) in specs.iter().zip(&tables) {
        let mut layer = Fp8KvLayerMut {
            k: &mut kc,
            v: &mut vc,
            k_scale: ks,
            v_scale: vs,
            k_shift: &[],
            block_size: bs,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let span = SeqSpan { start_pos: start, n_tokens: n, block_table: t };
        let rows_kv = row * kw_len..(row + n) * kw_len;
        cpu::write_kv_fp8(&kn[rows_kv.clone()], &v[rows_kv], span, &mut layer).expect("cpu write_kv_fp8");
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        row += n;
    }
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let inv = dev.upload(table.inv_freq()).expect("inv_freq");
    let wd = up(dev, &w);
    let extras = || RopeExtras {
        qk_norm: norm.map(|weight| QkNorm { q_weight: &wd, k_weight: &wd, eps, weight }),
        ..RopeExtras::default()
    };
    let what = format!("rope fp8 hd={hd} qk_norm={norm:?} scales=({ks}, {vs})");
    let compare_cache = |tag: &str, kcd: &CudaSlice<u8>, vcd: &CudaSlice<u8>| {
        let (gk, gv) = (codes(dev, kcd, kc.len()), codes(dev, vcd, vc.len()));
        assert_eq!(gv, vc, "{what} {tag}: V codes (and untouched padding slots) as the reference");
        let mut off_by_one = 0;
        for (i, (&g, &c)) in gk.iter().zip(&kc).enumerate() {
            if c == E4M3_NAN {
                assert_eq!(g, E4M3_NAN, "{what} {tag}: K slot {i} written by a padding row");
            } else if g != c {
                // One step apart, same sign: a neighbouring bf16 rounding of the rotated k.
                assert!((g ^ c) & 0x80 == 0 && g.abs_diff(c) == 1, "{what} {tag}: K code {i}: {g:#x} vs {c:#x}");
                off_by_one += 1;
            }
        }
        let written = kc.iter().filter(|&&c| c != E4M3_NAN).count();
        assert_eq!(written, rows * kw_len, "{tag}: every row's K slot written once");
        println!("{what} {tag}: {off_by_one} of {written} K codes one step from the reference");
        assert!(off_by_one * 100 <= written, "{what} {tag}: {off_by_one} of {written} K codes differ");
        let deq =
            |c: &[u8], s: f32| c.iter().filter(|&&x| x != E4M3_NAN).map(|&x| e4m3_to_f32(x) * s).collect::<Vec<_>>();
        check(&format!("{what} {tag} dequantized k"), &deq(&gk, ks), &deq(&kc, ks));
    };

    let (mut qd, mut kd, vd) = (up(dev, &q), up(dev, &k), up(dev, &v));
    let (mut kcd, mut vcd) = (poisoned_codes(dev, geo.layer_len()), poisoned_codes(dev, geo.layer_len()));
    RopeKvFp8Call {
        input: RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        k_scale: ks,
        v_scale: vs,
        k_shift: None,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(dev, extras())
    .expect("split");
    check(&format!("{what} split q"), &down(dev, &qd, rows * qw_len), &qn);
    compare_cache("split", &kcd, &vcd);

    let qkv: Vec<f32> = (0..rows + pad)
        .flat_map(|i| {
            q[i * qw_len..(i + 1) * qw_len]
                .iter()
                .chain(&k[i * kw_len..(i + 1) * kw_len])
                .chain(&v[i * kw_len..(i + 1) * kw_len])
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    let mut q_out = poisoned(dev, (rows + pad) * qw_len);
    let (mut kcd, mut vcd) = (poisoned_codes(dev, geo.layer_len()), poisoned_codes(dev, geo.layer_len()));
    let qkvd = up(dev, &qkv);
    RopeKvFp8Call {
        input: RopeInput::Fused { qkv: &qkvd, q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        k_scale: ks,
        v_scale: vs,
        k_shift: None,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(dev, extras())
    .expect("fused");
    check(&format!("{what} fused q"), &down(dev, &q_out, rows * qw_len), &qn);
    compare_cache("fused", &kcd, &vcd);

    // FP8 KV scale calibration's pass over the same rows (`RopeKvAmaxCall`): the largest
    // stored |k| (rotated, normed, bf16) and |v| of the rows with a slot, nothing written. V
    // is read as stored: exact. K may sit one bf16 step from the reference's (as its codes).
    let (k_ref, v_ref) = (cpu::abs_max(&kn), cpu::abs_max(&v[..rows * kw_len]));
    let amax_of = |input: RopeInput<'_>| {
        // Zeroed, as the caller must (maxima are raised into it).
        let mut a = dev.upload(&[0.0f32, 0.0]).expect("zeroed amax");
        let call = RopeKvAmaxCall { input, amax: &mut a, meta: &meta, inv_freq: &inv, n_heads: nh, geo };
        call.launch_with(dev, extras()).expect("amax");
        let got = dev.download(&a, 2).expect("download amax");
        [got[0], got[1]]
    };
    let (mut qd, mut kd) = (up(dev, &q), up(dev, &k));
    let split = amax_of(RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd });
    assert_eq!(down(dev, &qd, q.len()), q, "{what}: the amax pass left q as it was");
    assert_eq!(down(dev, &kd, k.len()), k, "{what}: the amax pass left k as it was");
    let mut q_out = poisoned(dev, (rows + pad) * qw_len);
    let fused = amax_of(RopeInput::Fused { qkv: &qkvd, q_out: &mut q_out });
    assert!(down(dev, &q_out, q_out.len()).iter().all(|x| x.is_nan()), "{what}: the amax pass wrote q");
    for (tag, [gk, gv]) in [("split", split), ("fused", fused)] {
        println!("{what} {tag} amax: k {gk} (cpu {k_ref}), v {gv} (cpu {v_ref})");
        assert_eq!(gv, v_ref, "{what} {tag}: max |v|");
        assert!((gk - k_ref).abs() <= k_ref / 128.0, "{what} {tag}: max |k| {gk} vs {k_ref}");
    }
    // A NaN in a real row's v comes out NaN (the CPU reference propagates it too).
    let mut v_nan = v.clone();
    v_nan[kw_len + 3] = f32::NAN;
    let vnd = up(dev, &v_nan);
    let (mut qd, mut kd) = (up(dev, &q), up(dev, &k));
    let [gk, gv] = amax_of(RopeInput::Split { q: &mut qd, k: &mut kd, v: &vnd });
    assert!(gv.is_nan() && cpu::abs_max(&v_nan[..rows * kw_len]).is_nan(), "{what}: NaN v gave {gv}");
    assert!((gk - k_ref).abs() <= k_ref / 128.0, "{what}: max |k| with a NaN v");

    // A scale that is zero or NaN is refused before anything is enqueued.
    for bad in [0.0, f32::NAN, -1.0] {
        let call = RopeKvFp8Call {
            input: RopeInput::Fused { qkv: &qkvd, q_out: &mut q_out },
            k_cache: &mut kcd,
            v_cache: &mut vcd,
            k_scale: bad,
            v_scale: vs,
            k_shift: None,
            meta: &meta,
            inv_freq: &inv,
            n_heads: nh,
            geo,
        };
        assert!(call.launch_with(dev, RopeExtras::default()).is_err(), "k_scale {bad} accepted");
    }
}

/// RoPE + FP8 KV write with a key shift (`crate::cpu::Fp8KvLayerMut::k_shift`), both input
/// forms: every stored key is the code of `(k - shift) / k_scale` for the k this kernel
/// rotated (read back from the split form, which rotates k in place), bit for bit; values as
/// without a shift; padding rows write nothing; a shift one value short is refused.
fn rope_fp8_shifted_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    hd: usize,
    norm: Option<NormWeight>,
    specs: &[(usize, usize)],
) {
    let (nh, nkv, bs, pad) = (4usize, 2usize, 16usize, 2usize);
    let (ks, vs) = (0.05f32, 0.5f32);
    let (num_blocks, tables, rows) = shuffled_tables(r, specs, bs, 3);
    let table = RopeTable::new(hd, 10_000.0, RopeScalingKind::None).expect("table");
    let (qw_len, kw_len) = (nh * hd, nkv * hd);
    let q = rand_vec(r, (rows + pad) * qw_len, 2.0);
    let k = rand_vec(r, (rows + pad) * kw_len, 8.0);
    let v = rand_vec(r, (rows + pad) * kw_len, 30.0);
    let shift = rand_vec(r, kw_len, 6.0);
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let mut host = Vec::new();
    let mut row = 0;
    for (&(start, n), t) in specs.iter().zip(&tables) {
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        row += n;
    }
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let (inv, wd) = (dev.upload(table.inv_freq()).expect("inv_freq"), up(dev, &rand_vec(r, hd, 0.5)));
    let extras = || RopeExtras {
        qk_norm: norm.map(|weight| QkNorm { q_weight: &wd, k_weight: &wd, eps: 1e-6, weight }),
        ..RopeExtras::default()
    };
    let shift_d = dev.upload(&shift).expect("shift");
    let what = format!("rope fp8 shifted hd={hd} qk_norm={norm:?}");
    let run = |input: RopeInput<'_>, k_shift: Option<&CudaSlice<f32>>| {
        let (mut kcd, mut vcd) = (poisoned_codes(dev, geo.layer_len()), poisoned_codes(dev, geo.layer_len()));
        let call = RopeKvFp8Call {
            input,
            k_cache: &mut kcd,
            v_cache: &mut vcd,
            k_scale: ks,
            v_scale: vs,
            k_shift,
            meta: &meta,
            inv_freq: &inv,
            n_heads: nh,
            geo,
        };
        call.launch_with(dev, extras()).expect("rope fp8 with a shift");
        (codes(dev, &kcd, geo.layer_len()), codes(dev, &vcd, geo.layer_len()))
    };
    let (mut qd, mut kd, vd) = (up(dev, &q), up(dev, &k), up(dev, &v));
    let split = run(RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd }, Some(&shift_d));
    // The reference quantizes the keys this kernel rotated (and normed), with the shift.
    let rotated = down(dev, &kd, rows * kw_len);
    let (mut kc, mut vc) = (vec![E4M3_NAN; geo.layer_len()], vec![E4M3_NAN; geo.layer_len()]);
    let mut row = 0;
    for (&(start, n), t) in specs.iter().zip(&tables) {
        let mut layer = Fp8KvLayerMut {
            k: &mut kc,
            v: &mut vc,
            k_scale: ks,
            v_scale: vs,
            k_shift: &shift,
            block_size: bs,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let span = SeqSpan { start_pos: start, n_tokens: n, block_table: t };
        let rows_kv = row * kw_len..(row + n) * kw_len;
        cpu::write_kv_fp8(&rotated[rows_kv.clone()], &v[rows_kv], span, &mut layer).expect("cpu write_kv_fp8");
        row += n;
    }
    assert_eq!(split.0, kc, "{what}: split K codes (and untouched padding slots) as the reference");
    assert_eq!(split.1, vc, "{what}: split V codes as the reference");
    let written = kc.iter().filter(|&&c| c != E4M3_NAN).count();
    assert_eq!(written, rows * kw_len, "{what}: every real row's K slot written once");
    // Not vacuous: without the shift the keys differ.
    let (mut qd, mut kd) = (up(dev, &q), up(dev, &k));
    let plain = run(RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd }, None);
    assert_ne!(plain.0, split.0, "{what}: the shift changed no key");
    assert_eq!(plain.1, split.1, "{what}: the shift changed a value");

    let qkv: Vec<f32> = (0..rows + pad)
        .flat_map(|i| {
            let (qr, kr) = (i * qw_len..(i + 1) * qw_len, i * kw_len..(i + 1) * kw_len);
            q[qr].iter().chain(&k[kr.clone()]).chain(&v[kr]).copied().collect::<Vec<_>>()
        })
        .collect();
    let (qkvd, mut q_out) = (up(dev, &qkv), poisoned(dev, (rows + pad) * qw_len));
    let fused = run(RopeInput::Fused { qkv: &qkvd, q_out: &mut q_out }, Some(&shift_d));
    assert_eq!(fused, split, "{what}: the fused form stores what the split form does");

    let short = dev.upload(&shift[..kw_len - 1]).expect("short shift");
    let (mut kcd, mut vcd) = (poisoned_codes(dev, geo.layer_len()), poisoned_codes(dev, geo.layer_len()));
    let call = RopeKvFp8Call {
        input: RopeInput::Fused { qkv: &qkvd, q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        k_scale: ks,
        v_scale: vs,
        k_shift: Some(&short),
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    };
    let e = call.launch_with(dev, extras()).expect_err("a shift one value short");
    assert!(e.to_string().contains("k_shift"), "{e}");
    assert!(codes(dev, &kcd, geo.layer_len()).iter().all(|&c| c == E4M3_NAN), "{what}: a refused call wrote");
    println!("{what}: {written} K codes bit for bit, fused = split");
}

#[test]
fn gpu_rope_write_kv_fp8_subtracts_the_key_shift() {
    let dev = device();
    let mut r = rng("rope_write_kv_fp8 shifted");
    for specs in [&[(37usize, 20usize), (5000, 1), (0, 3)][..], &[(37, 20), (5000, 1), (0, 600)]] {
        for hd in [64usize, 128] {
            rope_fp8_shifted_case(&dev, &mut r, hd, None, specs);
            rope_fp8_shifted_case(&dev, &mut r, hd, Some(NormWeight::Plain), specs);
        }
    }
}

#[test]
fn gpu_rope_write_kv_fp8_matches_cpu() {
    let dev = device();
    let mut r = rng("rope_write_kv_fp8");
    // A decode-sized batch (one head a CTA), and one with a 600-token prefill chunk (a CTA per
    // row and group of heads, `rope_head_groups`).
    for specs in [&[(37usize, 20usize), (5000, 1), (0, 3)][..], &[(37, 20), (5000, 1), (0, 600)]] {
        for hd in [16usize, 64, 128] {
            for scales in [(1.0, 1.0), (0.0625, 3.0)] {
                rope_fp8_case(&dev, &mut r, hd, None, scales, specs);
            }
            rope_fp8_case(&dev, &mut r, hd, Some(NormWeight::Plain), (0.01, 0.5), specs);
        }
    }
}

/// One mixed batch (a prefill chunk over a cached prefix, decode rows at short and long
/// contexts, a prefill from 0, padding rows) through [`AttentionExtFp8Call`] against
/// `cpu::paged_attention_fp8`, plain and with a window, soft-cap and sinks.
/// `q_mag`: the queries' magnitude (the softmax scale is divided by it, so the scores stay
/// the same size): 1, or far past f16's range to check the tuned decode kernel's f16 queries.
fn attention_fp8_case(dev: &CudaDevice, r: &mut StdRng, (hd, nh, nkv, bs): (usize, usize, usize, usize), q_mag: f32) {
    let specs = [(45usize, 30usize), (3, 1), (3000, 1), (0, 20), (200, 1)];
    let pad = 3;
    let (num_blocks, tables, rows) = shuffled_tables(r, &specs, bs, 4);
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let (ks, vs) = (0.02f32, 0.5f32);
    // Every code of the cache, quantized from values within ±(448 × scale).
    let mut kc = vec![0u8; geo.layer_len()];
    let mut vc = vec![0u8; geo.layer_len()];
    cpu::fp8::quantize_e4m3(&rand_vec(r, geo.layer_len(), 8.0), ks, &mut kc);
    cpu::fp8::quantize_e4m3(&rand_vec(r, geo.layer_len(), 200.0), vs, &mut vc);
    let w = nh * hd;
    let q = rand_vec(r, (rows + pad) * w, q_mag);
    let sinks: Vec<f32> = (0..nh).map(|i| i as f32 * 0.5 - 1.0).collect();
    let mut meta = StepMeta::new(dev).expect("meta");
    let mut host = Vec::new();
    let mut row = 0;
    for (&(start, n), t) in specs.iter().zip(&tables) {
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        row += n;
    }
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let qd = up(dev, &q);
    let (kd, vd) = (dev.upload(&kc).expect("k codes"), dev.upload(&vc).expect("v codes"));
    let sinks_d = dev.upload(&sinks).expect("sinks");
    let scale = 1.0 / ((hd as f32).sqrt() * q_mag);
    for (window, softcap, with_sinks) in [(None, None, false), (Some(16usize), Some(2.0f32), true)] {
        let extras = AttnExtras { window, softcap, sinks: with_sinks.then_some(&sinks[..]) };
        let mut want = vec![0.0; q.len()];
        let mut row = 0;
        for (&(start, n), t) in specs.iter().zip(&tables) {
            let cache = Fp8KvLayerRef {
                k: &kc,
                v: &vc,
                k_scale: ks,
                v_scale: vs,
                block_size: bs,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            cpu::paged_attention_fp8(
                &q[row * w..(row + n) * w],
                nh,
                scale,
                SeqSpan { start_pos: start, n_tokens: n, block_table: t },
                cache,
                extras,
                &mut want[row * w..(row + n) * w],
            )
            .expect("cpu attention");
            row += n;
        }
        let mut out = poisoned(dev, q.len());
        AttentionExtFp8Call {
            q: &qd,
            k_cache: &kd,
            v_cache: &vd,
            k_scale: ks,
            v_scale: vs,
            meta: &meta,
            n_heads: nh,
            geo,
            scale,
            window,
            softcap,
            sinks: with_sinks.then_some(&sinks_d),
            out: &mut out,
        }
        .launch(dev)
        .expect("attention_ext_fp8");
        check(
            &format!("attention fp8 hd={hd} heads={nh}/{nkv} bs={bs} window={window:?} softcap={softcap:?}"),
            &down(dev, &out, q.len()),
            &want,
        );
        if window.is_none() && attention_supports(hd) {
            tuned_fp8_cases(dev, &qd, (&kd, &vd, ks, vs), &mut meta, (nh, geo, scale), &want);
        }
    }
    let mut out = poisoned(dev, q.len());
    for bad in [0.0, f32::INFINITY] {
        let call = AttentionExtFp8Call {
            q: &qd,
            k_cache: &kd,
            v_cache: &vd,
            k_scale: ks,
            v_scale: bad,
            meta: &meta,
            n_heads: nh,
            geo,
            scale,
            window: None,
            softcap: None,
            sinks: None,
            out: &mut out,
        };
        assert!(call.launch(dev).is_err(), "v_scale {bad} accepted");
    }
}

/// The tuned kernels over the same FP8 cache against the same reference (plain attention):
/// every FP8 decode variant on every row, unsplit and with splits (`Auto`, and `Exact(7)` as a
/// graph replays it); the router (`Mixed`: decode rows on the decode kernel, prefill chunks on
/// the prefill kernel); the 8-warp prefill kernel over a decode launch's output. Each launch
/// writes into a poisoned output. A zero or infinite scale is refused before any launch.
fn tuned_fp8_cases(
    dev: &CudaDevice,
    q: &CudaSlice<bf16>,
    (k, v, k_scale, v_scale): (&CudaSlice<u8>, &CudaSlice<u8>, f32, f32),
    meta: &mut StepMeta,
    (n_heads, geo, scale): (usize, KvGeometry, f32),
    want: &[f32],
) {
    let cache = KvCacheRef::Fp8 { k, v, k_scale, v_scale };
    let hd = geo.head_dim;
    let mut runs: Vec<(String, AttnKernel, AttnSplit)> = Vec::new();
    for variant in 0..ATTN_FP8_VARIANTS.len() {
        for split in [AttnSplit::Fixed(1), AttnSplit::Auto, AttnSplit::Exact(7)] {
            runs.push((format!("decode {variant} {split:?}"), AttnKernel::Decode { variant: Some(variant) }, split));
        }
    }
    runs.push(("mixed".into(), AttnKernel::Mixed, AttnSplit::Auto));
    for (label, kernel, split) in runs {
        let mut out = poisoned(dev, want.len());
        AttentionCall {
            q,
            cache,
            meta: &mut *meta,
            n_heads,
            geo,
            scale,
            out: &mut out,
            kernel,
            split,
            options: AttentionOptions::default(),
        }
        .launch(dev)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        check(
            &format!("tuned fp8 {label} hd={hd} heads={n_heads}/{}", geo.n_kv_heads),
            &down(dev, &out, want.len()),
            want,
        );
    }
    // Every prefill variant (CTA sizes, the warpgroup kernel where it runs this shape): a
    // decode launch covers every row, the prefill kernel then overwrites the prefill chunks'
    // rows with its own results.
    for variant in (0..PREFILL_VARIANTS).filter(|&v| prefill_runs(dev, v, n_heads, geo.n_kv_heads, hd)) {
        let mut out = poisoned(dev, want.len());
        for kernel in [AttnKernel::Decode { variant: None }, AttnKernel::Prefill { variant }] {
            AttentionCall {
                q,
                cache,
                meta: &mut *meta,
                n_heads,
                geo,
                scale,
                out: &mut out,
                kernel,
                split: AttnSplit::Auto,
                options: AttentionOptions::default(),
            }
            .launch(dev)
            .unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
        }
        check(&format!("tuned fp8 prefill {variant} hd={hd}"), &down(dev, &out, want.len()), want);
    }
    for bad in [0.0, f32::INFINITY] {
        let cache = KvCacheRef::Fp8 { k, v, k_scale: bad, v_scale };
        let mut out = poisoned(dev, want.len());
        let call = AttentionCall {
            q,
            cache,
            meta: &mut *meta,
            n_heads,
            geo,
            scale,
            out: &mut out,
            kernel: AttnKernel::Mixed,
            split: AttnSplit::Auto,
            options: AttentionOptions::default(),
        };
        assert!(call.launch(dev).is_err(), "k_scale {bad} accepted by the tuned kernels");
    }
}

/// Whether prefill variant `v` runs this shape here: the mma.sync CTA sizes always (the group
/// fits), the warpgroup kernel on `sm_90a` at head_dim 128.
fn prefill_runs(dev: &CudaDevice, v: usize, n_heads: usize, n_kv_heads: usize, hd: usize) -> bool {
    let fits = prefill_variant_warps(v).is_some_and(|w| n_heads / n_kv_heads <= 16 * w);
    if v == PREFILL_WGMMA {
        fits && dev.prefill_wgmma_capable() && prefill_wg_supported(n_heads, n_kv_heads, hd, false)
    } else {
        fits
    }
}

/// Llama-3.1-8B's attention shape (128, group 4), SmolLM2's (64, group 3), a small head_dim
/// and Phi's 96 with block size 5; a group of 12 (the 16-head CTA variant) at 128.
#[test]
fn gpu_attention_fp8_matches_cpu() {
    let dev = device();
    let mut r = rng("attention_fp8");
    let shapes = [(128usize, 8usize, 2usize, 16usize), (64, 9, 3, 16), (16, 4, 2, 16), (96, 6, 3, 5), (128, 24, 2, 16)];
    for shape in shapes {
        attention_fp8_case(&dev, &mut r, shape, 1.0);
    }
}

/// Queries of magnitude 1e5 (with the softmax scale 1e-5 smaller): beyond f16's 65,504, which
/// the tuned FP8 decode kernel's f16 products must scale down (by a power of two) rather than
/// overflow. Every kernel over the FP8 cache against the same CPU reference.
#[test]
fn gpu_attention_fp8_with_queries_beyond_f16_matches_cpu() {
    let dev = device();
    let mut r = rng("attention_fp8_large_q");
    for shape in [(128usize, 8usize, 2usize, 16usize), (64, 9, 3, 16)] {
        attention_fp8_case(&dev, &mut r, shape, 1e5);
    }
}

/// The bf16 variant whose arithmetic an FP8 variant repeats: the kernel of the same kind (tensor
/// core or streaming) with the same warps and heads per warp or CTA (the ring depth does not
/// change which warp takes which token).
fn bf16_twin(fp8_variant: usize) -> usize {
    let f = ATTN_FP8_VARIANTS[fp8_variant];
    ATTN_VARIANTS
        .iter()
        .position(|v| v.kind == f.kind && v.warps == f.warps && v.max_group == f.max_group)
        .expect("a bf16 twin")
}

/// An FP8 cache with scales 1 and a bf16 cache of its exact values. The FP8 prefill kernel
/// (each CTA size) must write bit for bit what its bf16 twin writes, since E4M3 → bf16 is exact
/// and nothing else differs. The FP8 decode kernel runs its products in f16 (exact codes, but
/// P rounded to f16 rather than bf16), so each decode variant at each split mode, and the
/// router, must match its bf16 twin within the bf16 tolerance instead (the relative error is
/// printed: it measures the f16 P against the bf16 P). Every head_dim the tuned kernels have,
/// a group of 4 and of 12, with padding rows.
#[test]
fn gpu_fp8_tuned_attention_equals_bf16_on_exact_images() {
    let dev = device();
    let mut r = rng("fp8_twins");
    for &(hd, nh, nkv) in &[(16usize, 8usize, 2usize), (32, 8, 2), (64, 9, 3), (128, 8, 2), (128, 24, 2)] {
        let bs = 16;
        let specs = [(45usize, 30usize), (3, 1), (3000, 1), (0, 20), (200, 1)];
        let pad = 3;
        let (num_blocks, tables, rows) = shuffled_tables(&mut r, &specs, bs, 4);
        let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        // Codes of magnitude below 16 (exponent field up to 10), never NaN.
        let code = |r: &mut StdRng| loop {
            let c: u8 = r.random();
            if (c >> 3) & 0xf <= 10 {
                break c;
            }
        };
        let kc: Vec<u8> = (0..geo.layer_len()).map(|_| code(&mut r)).collect();
        let vc: Vec<u8> = (0..geo.layer_len()).map(|_| code(&mut r)).collect();
        let image = |c: &[u8]| c.iter().map(|&x| e4m3_to_f32(x)).collect::<Vec<f32>>();
        let (kd, vd) = (dev.upload(&kc).expect("k codes"), dev.upload(&vc).expect("v codes"));
        let (kb, vb) = (up(&dev, &image(&kc)), up(&dev, &image(&vc)));
        let fp8 = KvCacheRef::Fp8 { k: &kd, v: &vd, k_scale: 1.0, v_scale: 1.0 };
        let bf = KvCacheRef::Bf16 { k: &kb, v: &vb };
        let w = nh * hd;
        let q = up(&dev, &rand_vec(&mut r, (rows + pad) * w, 1.0));
        let mut meta = StepMeta::new(&dev).expect("meta");
        let mut host = Vec::new();
        let mut row = 0;
        for (&(start, n), t) in specs.iter().zip(&tables) {
            host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
            row += n;
        }
        meta.set_padded(&dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
        let scale = 1.0 / (hd as f32).sqrt();
        let len = (rows + pad) * w;
        let mut run = |launches: &[(KvCacheRef<'_>, AttnKernel)], split: AttnSplit| -> Vec<u16> {
            let mut out = poisoned(&dev, len);
            for &(cache, kernel) in launches {
                AttentionCall {
                    q: &q,
                    cache,
                    meta: &mut meta,
                    n_heads: nh,
                    geo,
                    scale,
                    out: &mut out,
                    kernel,
                    split,
                    options: AttentionOptions::default(),
                }
                .launch(&dev)
                .unwrap_or_else(|e| panic!("{kernel:?} {split:?}: {e}"));
            }
            dev.download(&out, len).expect("download").iter().map(|v| v.to_bits()).collect()
        };
        // (label, FP8 side, bf16 side, split, bit-exact?)
        type Launches<'a> = Vec<(KvCacheRef<'a>, AttnKernel)>;
        let mut cases: Vec<(String, Launches<'_>, Launches<'_>, AttnSplit, bool)> = Vec::new();
        for fv in 0..ATTN_FP8_VARIANTS.len() {
            let (f, b) =
                (AttnKernel::Decode { variant: Some(fv) }, AttnKernel::Decode { variant: Some(bf16_twin(fv)) });
            // Fixed counts on both sides: `Auto` aims at more CTAs per SM for FP8 (SplitTarget),
            // and another split count sums in another order.
            for split in [AttnSplit::Fixed(1), AttnSplit::Fixed(3), AttnSplit::Exact(7)] {
                cases.push((format!("decode {fv}"), vec![(fp8, f)], vec![(bf, b)], split, false));
            }
        }
        for pv in (0..PREFILL_VARIANTS).filter(|&v| prefill_runs(&dev, v, nh, nkv, hd)) {
            // The bf16 decode kernel first (every row, the same on both sides), then the
            // prefill kernel over the chunks, on the FP8 cache and on its bf16 image.
            let d = AttnKernel::Decode { variant: Some(bf16_twin(0)) };
            let p = AttnKernel::Prefill { variant: pv };
            cases.push((
                format!("prefill {pv}"),
                vec![(bf, d), (fp8, p)],
                vec![(bf, d), (bf, p)],
                AttnSplit::Fixed(2),
                true,
            ));
        }
        let mixed = AttnKernel::Mixed;
        cases.push(("mixed".into(), vec![(fp8, mixed)], vec![(bf, mixed)], AttnSplit::Fixed(2), false));
        for (label, fk, bk, split, exact) in cases {
            let (a, b) = (run(&fk, split), run(&bk, split));
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            let nan = a.iter().filter(|&&x| bf16::from_bits(x).is_nan()).count();
            println!("hd={hd} heads={nh}/{nkv} {label} {split:?}: {differ} of {len} outputs differ, {nan} NaN");
            let what = format!("hd={hd} heads={nh}/{nkv} {label} {split:?}");
            if exact {
                assert!(differ == 0 && nan == 0, "{what}: {differ} differ, {nan} NaN");
            } else {
                // Padding rows are zeros on both sides; check() refuses any NaN left unwritten.
                let f = |v: &[u16]| v.iter().map(|&x| bf16::from_bits(x).to_f32()).collect::<Vec<f32>>();
                check(&format!("{what}: FP8 (f16 products) vs bf16 twin"), &f(&a), &f(&b));
            }
        }
    }
}
