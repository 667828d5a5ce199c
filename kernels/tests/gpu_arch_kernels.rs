//! The kernels added for the new architectures (Qwen3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3,
//! gpt-oss) against their CPU references (`baton_kernels::cpu`): q/k RMSNorm fused with RoPE
//! and the KV write, Gemma's `1 + w` norms and bf16-rounded embedding scale, GELU-tanh·mul,
//! logit soft-capping, MoE routing, permutation, grouped
//! GEMV and un-permute, attention with a sliding window, soft-cap and sinks at head_dims up to 256. Fresh random inputs every run (the seed is printed), outputs poisoned
//! (NaN) before each launch, ‖out − ref‖ / ‖ref‖ < 1e-2 for bf16 outputs, ids exact.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::{
    self, AttnExtras, ExpertWeights, KvLayerMut, KvLayerRef, MoeRouting, MoeRows, MoeScoring, NormWeight,
    RopeScalingKind, RopeTable, SeqSpan,
};
use baton_kernels::cuda::{
    AddRmsNormCall, AttentionExtCall, BiasAddF32Call, ClampedSwigluCall, CudaDevice, CudaSlice, GeluTanhMulCall,
    HostSeq, KvGeometry, MoeExpertKernel, MoeGroupedGemvCall, MoePermuteCall, MoeRouteCall, MoeUnpermuteCall, QkNorm,
    RmsNormCall, RopeExtras, RopeInput, RopeKvCall, ScaleRoundCall, SiluMulCall, SoftcapCall, StepMeta, bf16,
};
use common::{check, device, down, poisoned, rand_vec, rng, shuffled_tables, up};
use rand::{Rng, rngs::StdRng};

fn check32(what: &str, out: &[f32], want: &[f32], bound: f64) {
    let e = common::rel_err(out, want);
    println!("{what}: rel err {e:.2e}");
    assert!(e < bound, "{what}: rel err {e:.3e} >= {bound:.1e}");
}

fn down_i32(dev: &CudaDevice, s: &CudaSlice<i32>, n: usize) -> Vec<i32> {
    dev.download(s, n).expect("download")
}

fn down_f32(dev: &CudaDevice, s: &CudaSlice<f32>, n: usize) -> Vec<f32> {
    dev.download(s, n).expect("download")
}

/// RoPE + KV write with the extras at `hd` (q/k norm in `style` when given, the first `rot`
/// dims rotating), both input forms, with padding rows: q and the K cache against
/// `head_rms_norm` then `RopeTable::apply_partial` then `write_kv`; V copied exactly; padding
/// rows write nothing.
fn rope_extras_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    hd: usize,
    style: Option<NormWeight>,
    rot: usize,
    specs: &[(usize, usize)],
) {
    let (nh, nkv, bs, pad) = (6usize, 2usize, 16usize, 2usize);
    let (num_blocks, tables, rows) = shuffled_tables(r, specs, bs, 3);
    let positions: Vec<usize> = specs.iter().flat_map(|&(s, n)| s..s + n).collect();
    // Partial rotation with LongRoPE's per-frequency divisors and its attention factor on cos
    // and sin (Phi-4-mini); the full rotation plain.
    let table = if rot < hd {
        let factors: Vec<f32> = (0..rot / 2).map(|i| 1.0 + (i % 5) as f32 * 0.7).collect();
        RopeTable::with_factors(rot, 10_000.0, &factors, 1.19).expect("longrope table")
    } else {
        RopeTable::new(rot, 1_000_000.0, RopeScalingKind::None).expect("table")
    };
    let (qw_len, kw_len) = (nh * hd, nkv * hd);
    // Inputs of several magnitudes (the norm removes it) and weights around 0 or 1.
    let q = rand_vec(r, (rows + pad) * qw_len, 6.0);
    let k = rand_vec(r, (rows + pad) * kw_len, 0.3);
    let v = rand_vec(r, (rows + pad) * kw_len, 1.0);
    let base = if style == Some(NormWeight::OnePlus) { 0.0 } else { 1.0 };
    let q_w: Vec<f32> = rand_vec(r, hd, 0.5).iter().map(|x| x + base).collect();
    let k_w: Vec<f32> = rand_vec(r, hd, 0.5).iter().map(|x| x + base).collect();
    let eps = 1e-6;
    let (mut qn, mut kn) = (q[..rows * qw_len].to_vec(), k[..rows * kw_len].to_vec());
    if let Some(style) = style {
        cpu::head_rms_norm(&mut qn, &q_w, eps, style).expect("norm q");
        cpu::head_rms_norm(&mut kn, &k_w, eps, style).expect("norm k");
    }
    table.apply_partial(&mut qn, nh, hd, &positions).expect("rope q");
    table.apply_partial(&mut kn, nkv, hd, &positions).expect("rope k");
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let (mut kc, mut vc) = (vec![f32::NAN; geo.layer_len()], vec![f32::NAN; geo.layer_len()]);
    let mut row = 0;
    let mut host = Vec::new();
    for (&(start, n), t) in specs.iter().zip(&tables) {
        let mut layer = KvLayerMut { k: &mut kc, v: &mut vc, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let span = SeqSpan { start_pos: start, n_tokens: n, block_table: t };
        cpu::write_kv(&kn[row * kw_len..(row + n) * kw_len], &v[row * kw_len..(row + n) * kw_len], span, &mut layer)
            .expect("cpu write_kv");
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        row += n;
    }
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let inv = dev.upload(table.inv_freq()).expect("inv_freq");
    let (qwd, kwd) = (up(dev, &q_w), up(dev, &k_w));
    let extras = || RopeExtras {
        qk_norm: style.map(|weight| QkNorm { q_weight: &qwd, k_weight: &kwd, eps, weight }),
        rotary_dim: (rot < hd).then_some(rot),
        attention_factor: (rot < hd).then_some(table.attention_factor()),
    };
    let what = format!("rope hd={hd} rotary_dim={rot} qk_norm={style:?}");
    let compare_cache = |tag: &str, kcd: &CudaSlice<_>, vcd: &CudaSlice<_>| {
        let (gk, gv) = (down(dev, kcd, kc.len()), down(dev, vcd, vc.len()));
        let untouched = |c: &[f32], g: &[f32]| c.iter().zip(g).filter(|(a, _)| a.is_nan()).all(|(_, b)| b.is_nan());
        assert!(untouched(&kc, &gk) && untouched(&vc, &gv), "{what} {tag}: a padding row wrote into the cache");
        let pick = |c: &[f32], g: &[f32]| -> (Vec<f32>, Vec<f32>) {
            c.iter().zip(g).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*b, *a)).unzip()
        };
        let (gk, wk) = pick(&kc, &gk);
        let (gv, wv) = pick(&vc, &gv);
        assert_eq!(wk.len(), rows * kw_len, "{tag}: every row's K slot written once");
        check(&format!("{what} {tag} k cache"), &gk, &wk);
        assert_eq!(gv, wv, "{what} {tag}: V is copied exactly (not normalized)");
    };

    // Split buffers, rotated in place.
    let (mut qd, mut kd, vd) = (up(dev, &q), up(dev, &k), up(dev, &v));
    let (mut kcd, mut vcd) = (poisoned(dev, geo.layer_len()), poisoned(dev, geo.layer_len()));
    RopeKvCall {
        input: RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(dev, extras())
    .expect("split");
    check(&format!("{what} split q"), &down(dev, &qd, rows * qw_len), &qn);
    check(&format!("{what} split k"), &down(dev, &kd, rows * kw_len), &kn);
    compare_cache("split", &kcd, &vcd);

    // Rows [q | k | v] of one QKV projection.
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
    let (mut kcd, mut vcd) = (poisoned(dev, geo.layer_len()), poisoned(dev, geo.layer_len()));
    RopeKvCall {
        input: RopeInput::Fused { qkv: &up(dev, &qkv), q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(dev, extras())
    .expect("fused");
    check(&format!("{what} fused q"), &down(dev, &q_out, rows * qw_len), &qn);
    compare_cache("fused", &kcd, &vcd);

    // A norm weight shorter than head_dim, and an odd rotary_dim, are refused before anything
    // is enqueued.
    let short = up(dev, &q_w[..hd - 1]);
    let bad = RopeKvCall {
        input: RopeInput::Fused { qkv: &up(dev, &qkv), q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(
        dev,
        RopeExtras {
            qk_norm: Some(QkNorm { q_weight: &short, k_weight: &kwd, eps, weight: NormWeight::Plain }),
            ..RopeExtras::default()
        },
    );
    assert!(bad.is_err(), "short q_norm weight accepted");
    let odd = RopeKvCall {
        input: RopeInput::Fused { qkv: &up(dev, &qkv), q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch_with(dev, RopeExtras { rotary_dim: Some(rot - 1), ..RopeExtras::default() });
    assert!(odd.is_err(), "odd rotary_dim accepted");
}

/// Qwen3 (head_dim 128, `w`) and Gemma 3 (head_dim 256, `1 + w`) and the small head_dims of
/// the tiny fixtures (16, 32: fewer than 32 threads per head before rounding up); partial
/// rotation (Phi-4-mini: 96 of 128 dims; 12 of 16 in its tiny fixture), alone and with the norm.
#[test]
fn gpu_rope_qk_norm_write_kv_matches_cpu() {
    let dev = device();
    let mut r = rng("rope_qk_norm");
    // A decode-sized batch (one head a CTA), and one with a 600-token prefill chunk (a CTA per
    // row and group of heads, `rope_head_groups`).
    for specs in [&[(37usize, 20usize), (5000, 1), (0, 3)][..], &[(37, 20), (5000, 1), (0, 600)]] {
        for hd in [16usize, 32, 64, 128, 256] {
            for style in [NormWeight::Plain, NormWeight::OnePlus] {
                rope_extras_case(&dev, &mut r, hd, Some(style), hd, specs);
            }
        }
        for (hd, rot) in [(128usize, 96usize), (16, 12), (64, 2)] {
            rope_extras_case(&dev, &mut r, hd, None, rot, specs);
            rope_extras_case(&dev, &mut r, hd, Some(NormWeight::Plain), rot, specs);
        }
    }
}

/// gpt-oss's clamped SwiGLU over interleaved [gate, up] columns, values past the limit.
#[test]
fn gpu_clamped_swiglu_matches_cpu() {
    let dev = device();
    let mut r = rng("clamped_swiglu");
    for &(rows, d) in &[(1usize, 2880usize), (300, 32), (3, 7)] {
        let gu = rand_vec(&mut r, rows * 2 * d, 12.0);
        let mut want = vec![0.0; rows * d];
        cpu::clamped_swiglu(&gu, &mut want, d, 1.702, 7.0).expect("cpu");
        let mut out = poisoned(&dev, rows * d);
        ClampedSwigluCall { gate_up: &up(&dev, &gu), rows, d, alpha: 1.702, limit: 7.0, out: &mut out }
            .launch(&dev)
            .expect("clamped_swiglu");
        check(&format!("clamped_swiglu {rows}x{d}"), &down(&dev, &out, rows * d), &want);
    }
    let mut out = poisoned(&dev, 4);
    let bad =
        ClampedSwigluCall { gate_up: &up(&dev, &[1.0; 8]), rows: 1, d: 4, alpha: 1.702, limit: 0.0, out: &mut out };
    assert!(bad.launch(&dev).is_err(), "limit 0 accepted");
}

/// gpt-oss's router bias on its f32 logits: `x += bias` in f32, the bias read as bf16.
#[test]
fn gpu_bias_add_f32_matches_cpu() {
    let dev = device();
    let mut r = rng("bias_add_f32");
    for &(rows, n) in &[(1usize, 32usize), (300, 128), (7, 5)] {
        let x = rand_vec(&mut r, rows * n, 4.0);
        let bias = rand_vec(&mut r, n, 2.0);
        let bias_dev = up(&dev, &bias);
        // The bias as the device holds it (bf16), added in f32.
        let held = down(&dev, &bias_dev, n);
        let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v + held[i % n]).collect();
        let mut xd = dev.upload(&x).expect("upload");
        BiasAddF32Call { x: &mut xd, bias: &bias_dev, rows, n }.launch(&dev).expect("bias_add_f32");
        let got = down_f32(&dev, &xd, rows * n);
        assert_eq!(got, want, "bias_add_f32 {rows}x{n}: f32 sums of the same operands");
    }
    let mut xd = dev.upload(&[0.0f32; 4]).expect("upload");
    let bad = BiasAddF32Call { x: &mut xd, bias: &up(&dev, &[1.0; 2]), rows: 1, n: 4 };
    assert!(bad.launch(&dev).is_err(), "a bias shorter than the row accepted");
}

#[test]
fn gpu_gelu_tanh_mul_and_softcap_match_cpu() {
    let dev = device();
    let mut r = rng("gelu_tanh_mul");
    // d % 8 == 0 takes 8 outputs a thread; 1001 and 4 the one-output loop.
    for &(rows, d) in &[(1usize, 9216usize), (257, 1000), (3, 1001), (5, 4)] {
        let gu = rand_vec(&mut r, rows * 2 * d, 5.0);
        let mut want = vec![0.0; rows * d];
        cpu::gelu_tanh_mul(&gu, &mut want, d).expect("cpu");
        let mut out = poisoned(&dev, rows * d);
        GeluTanhMulCall { gate_up: &up(&dev, &gu), rows, d, out: &mut out }.launch(&dev).expect("gelu_tanh_mul");
        check(&format!("gelu_tanh_mul {rows}x{d}"), &down(&dev, &out, rows * d), &want);
    }
    let mut out = poisoned(&dev, 4);
    let short = GeluTanhMulCall { gate_up: &up(&dev, &[1.0; 7]), rows: 1, d: 4, out: &mut out };
    assert!(short.launch(&dev).is_err(), "short gate_up accepted");

    // Final-logit soft-capping (f32 logits in place), values well past the cap.
    for &(n, cap) in &[(262_144usize * 3, 30.0f32), (1001, 2.0)] {
        let x: Vec<f32> = (0..n).map(|_| r.random_range(-4.0 * cap..4.0 * cap)).collect();
        let mut want = x.clone();
        cpu::softcap(&mut want, cap).expect("cpu");
        let mut xd = dev.upload(&x).expect("upload");
        SoftcapCall { x: &mut xd, n, cap }.launch(&dev).expect("softcap");
        check32(&format!("softcap n={n} cap={cap}"), &down_f32(&dev, &xd, n), &want, 1e-5);
    }
    let mut xd = dev.upload(&[1.0f32; 4]).expect("upload");
    assert!(SoftcapCall { x: &mut xd, n: 4, cap: 0.0 }.launch(&dev).is_err(), "cap 0 accepted");
    assert!(SoftcapCall { x: &mut xd, n: 5, cap: 1.0 }.launch(&dev).is_err(), "n past the slice accepted");
}

/// Gemma's norms (`1 + w`, in f32) through both residual-stream norm kernels, at widths that
/// take the register path (2304, 64) and the loop (1001 is not a multiple of 4; 20480 is past
/// the registers), against the CPU norms with the weights offset; and the embedding scale
/// rounded to bf16, exactly.
#[test]
fn gpu_gemma_norms_and_embedding_scale_match_cpu() {
    let dev = device();
    let mut r = rng("gemma_norms");
    for &(rows, dim) in &[(3usize, 2304usize), (17, 64), (2, 1001), (1, 20480)] {
        for style in [NormWeight::Plain, NormWeight::OnePlus] {
            let x = rand_vec(&mut r, rows * dim, 4.0);
            let add = rand_vec(&mut r, rows * dim, 2.0);
            // Gemma's weights are offsets around 0; plain ones are around 1.
            let w = rand_vec(&mut r, dim, 0.5).iter().map(|v| v + 1.0 - style.offset()).collect::<Vec<_>>();
            let w_eff: Vec<f32> = w.iter().map(|v| v + style.offset()).collect();
            let mut want = vec![0.0; rows * dim];
            cpu::rms_norm(&x, &w_eff, 1e-6, &mut want).expect("cpu");
            let mut out = poisoned(&dev, rows * dim);
            let xd = dev.upload(&x).expect("upload");
            let call = RmsNormCall { x: &xd, weight: &up(&dev, &w), rows, dim, eps: 1e-6, out: &mut out };
            call.launch_with(&dev, style).expect("rms_norm");
            check(&format!("rms_norm {style:?} {rows}x{dim}"), &down(&dev, &out, rows * dim), &want);

            let (mut res, mut want) = (x.clone(), vec![0.0; rows * dim]);
            cpu::add_rms_norm(&mut res, &add, &w_eff, 1e-6, &mut want).expect("cpu");
            let mut resd = dev.upload(&x).expect("upload");
            let mut out = poisoned(&dev, rows * dim);
            let call = AddRmsNormCall {
                residual: &mut resd,
                x: &up(&dev, &add),
                weight: &up(&dev, &w),
                rows,
                dim,
                eps: 1e-6,
                out: &mut out,
            };
            call.launch_with(&dev, style).expect("add_rms_norm");
            check(&format!("add_rms_norm {style:?} {rows}x{dim}"), &down(&dev, &out, rows * dim), &want);
            check32(&format!("add_rms_norm residual {rows}x{dim}"), &down_f32(&dev, &resd, rows * dim), &res, 1e-6);
        }
    }

    // √hidden of Gemma 2 2B (2304): 48.0 is exact in bf16; √3840 is not.
    for &(n, s) in &[(5usize * 2304, 2304f32.sqrt()), (1001, 3840f32.sqrt())] {
        let x = rand_vec(&mut r, n, 0.05);
        let sb = bf16::from_f32(s).to_f32();
        let want: Vec<f32> = x.iter().map(|v| bf16::from_f32(v * sb).to_f32()).collect();
        let mut xd = dev.upload(&x).expect("upload");
        ScaleRoundCall { x: &mut xd, n, scale: s }.launch(&dev).expect("scale_round");
        assert_eq!(down_f32(&dev, &xd, n), want, "scale_round n={n} s={s}: not bf16(x · bf16(s)) exactly");
    }
    let mut xd = dev.upload(&[1.0f32; 4]).expect("upload");
    assert!(ScaleRoundCall { x: &mut xd, n: 5, scale: 2.0 }.launch(&dev).is_err(), "n past the slice accepted");
    assert!(ScaleRoundCall { x: &mut xd, n: 4, scale: f32::NAN }.launch(&dev).is_err(), "NaN scale accepted");
}

/// Routing and permutation for Mixtral (8 experts, top-2, renormalized), Qwen3-MoE (128,
/// top-8, with and without renormalization), gpt-oss (32, top-4), the sigmoid scoring with a
/// scale (256 experts, top-8), and one expert per token; row counts from a decode step to a
/// prefill whose assignments span several of the permutation's shared-memory chunks.
#[test]
fn gpu_moe_routing_and_permutation_match_cpu() {
    let dev = device();
    let mut r = rng("moe_route");
    let soft = |k, renormalize| MoeRouting { k, scoring: MoeScoring::Softmax, renormalize, scale: 1.0 };
    let cases = [
        (8usize, soft(2, true)),
        (128, soft(8, true)),
        (128, soft(8, false)),
        (32, soft(4, true)),
        (256, MoeRouting { k: 8, scoring: MoeScoring::Sigmoid, renormalize: true, scale: 2.5 }),
        (60, MoeRouting { k: 1, scoring: MoeScoring::Sigmoid, renormalize: false, scale: 1.0 }),
    ];
    for &(ne, routing) in &cases {
        for rows in [1usize, 37, 1500] {
            let k = routing.k;
            let logits: Vec<f32> = (0..rows * ne).map(|_| r.random_range(-3.0f32..3.0)).collect();
            let (mut want_ids, mut want_w) = (vec![0u32; rows * k], vec![0f32; rows * k]);
            cpu::moe_route(&logits, ne, routing, &mut want_ids, &mut want_w).expect("cpu route");
            let ld = dev.upload(&logits).expect("upload");
            let mut ids = dev.upload(&vec![-1i32; rows * k]).expect("ids");
            let mut w = dev.upload(&vec![f32::NAN; rows * k]).expect("weights");
            MoeRouteCall { logits: &ld, rows, n_experts: ne, routing, ids: &mut ids, weights: &mut w }
                .launch(&dev)
                .expect("route");
            let what = format!("moe_route e={ne} {routing:?} rows={rows}");
            let got_ids = down_i32(&dev, &ids, rows * k);
            let want_i32: Vec<i32> = want_ids.iter().map(|&e| e as i32).collect();
            assert_eq!(got_ids, want_i32, "{what}: expert ids");
            check32(&format!("{what} weights"), &down_f32(&dev, &w, rows * k), &want_w, 1e-5);

            let perm = cpu::moe_permute(&want_ids, ne).expect("cpu permute");
            let n = rows * k;
            let mut offsets = dev.upload(&vec![-1i32; ne + 1]).expect("offsets");
            let mut order = dev.upload(&vec![-1i32; n]).expect("order");
            let mut position = dev.upload(&vec![-1i32; n]).expect("position");
            MoePermuteCall {
                ids: &ids,
                assignments: n,
                n_experts: ne,
                offsets: &mut offsets,
                order: &mut order,
                position: &mut position,
            }
            .launch(&dev)
            .expect("permute");
            let as_i32 = |v: &[u32]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
            assert_eq!(down_i32(&dev, &offsets, ne + 1), as_i32(&perm.offsets), "{what}: offsets");
            assert_eq!(down_i32(&dev, &order, n), as_i32(&perm.order), "{what}: order (stable)");
            assert_eq!(down_i32(&dev, &position, n), as_i32(&perm.position), "{what}: position");
        }
    }
    // A row of NaN logits (an overflowed activation) gets in-range ids and NaN weights, as
    // the CPU reference gives, so the permutation places every assignment.
    let nan = dev.upload(&[f32::NAN; 16]).expect("upload");
    let (mut nan_ids, mut nan_w) = (dev.upload(&[-1i32; 4]).expect("ids"), dev.upload(&[0.0f32; 4]).expect("w"));
    MoeRouteCall {
        logits: &nan,
        rows: 2,
        n_experts: 8,
        routing: soft(2, true),
        ids: &mut nan_ids,
        weights: &mut nan_w,
    }
    .launch(&dev)
    .expect("route NaN rows");
    let got = down_i32(&dev, &nan_ids, 4);
    assert!(got.iter().all(|e| (0..8).contains(e)), "NaN rows routed to {got:?}");
    assert!(down_f32(&dev, &nan_w, 4).iter().all(|w| w.is_nan()), "NaN rows need NaN weights");
    let (mut cpu_ids, mut cpu_w) = ([0u32; 4], [0f32; 4]);
    cpu::moe_route(&[f32::NAN; 16], 8, soft(2, true), &mut cpu_ids, &mut cpu_w).expect("cpu route NaN rows");
    assert!(cpu_ids.iter().all(|&e| e < 8) && cpu_w.iter().all(|w| w.is_nan()), "{cpu_ids:?} {cpu_w:?}");

    // Refusals: k above the experts, too many experts, short outputs.
    let ld = dev.upload(&[0.0f32; 16]).expect("upload");
    let (mut ids, mut w) = (dev.alloc::<i32>(16).expect("ids"), dev.alloc::<f32>(16).expect("w"));
    let call = |ne, routing, ids: &mut CudaSlice<i32>, w: &mut CudaSlice<f32>| {
        MoeRouteCall { logits: &ld, rows: 2, n_experts: ne, routing, ids, weights: w }.launch(&dev)
    };
    assert!(call(8, soft(9, true), &mut ids, &mut w).is_err(), "k > experts accepted");
    assert!(call(300, soft(2, true), &mut ids, &mut w).is_err(), "300 experts accepted");
    let mut short = dev.alloc::<i32>(3).expect("short");
    assert!(call(8, soft(2, true), &mut short, &mut w).is_err(), "short ids accepted");
}

/// A whole MoE MLP on the device (route, permute, grouped gate_up product, SiLU·mul, grouped
/// down product, un-permute with and without a shared expert) against the CPU references; the
/// grouped products on `kernel` (the down projection on the GEMV when `inter` does not suit
/// the GEMM).
fn moe_mlp_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    (rows, ne, k, hidden, inter): (usize, usize, usize, usize, usize),
    kernel: MoeExpertKernel,
) {
    let routing = MoeRouting { k, scoring: MoeScoring::Softmax, renormalize: true, scale: 1.0 };
    let x = rand_vec(r, rows * hidden, 1.0);
    let logits: Vec<f32> = (0..rows * ne).map(|_| r.random_range(-2.0f32..2.0)).collect();
    // gate_up: each expert's [gate (inter rows) | up (inter rows)] × hidden; down: hidden × inter.
    let w1 = rand_vec(r, ne * 2 * inter * hidden, 1.0 / (hidden as f32).sqrt());
    let w2 = rand_vec(r, ne * hidden * inter, 1.0 / (inter as f32).sqrt());
    let shared = rand_vec(r, rows * hidden, 0.5);
    // A bias on the down projection (gpt-oss has one on both), the gate_up one left out.
    let b2 = rand_vec(r, ne * hidden, 0.5);
    let (mut ids, mut weights) = (vec![0u32; rows * k], vec![0f32; rows * k]);
    cpu::moe_route(&logits, ne, routing, &mut ids, &mut weights).expect("route");
    let perm = cpu::moe_permute(&ids, ne).expect("permute");
    let n = rows * k;
    let mut h1 = vec![0f32; n * 2 * inter];
    let w1v = ExpertWeights { w: &w1, n: 2 * inter, d: hidden, bias: None };
    cpu::moe_grouped_linear(&x, MoeRows::PerToken, w1v, &perm, k, &mut h1).expect("gate_up");
    let mut act = vec![0f32; n * inter];
    cpu::silu_mul(&h1, &mut act, inter).expect("silu");
    // The device rounds the activation to bf16 before the second GEMV: so does the reference.
    let act: Vec<f32> = act.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
    let mut h2 = vec![0f32; n * hidden];
    let w2v = ExpertWeights { w: &w2, n: hidden, d: inter, bias: Some(&b2) };
    cpu::moe_grouped_linear(&act, MoeRows::Permuted, w2v, &perm, k, &mut h2).expect("down");
    let h2r: Vec<f32> = h2.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
    let (mut want, mut want_shared) = (vec![0f32; rows * hidden], vec![0f32; rows * hidden]);
    cpu::moe_unpermute(&h2r, hidden, &perm, &weights, k, None, &mut want).expect("unpermute");
    cpu::moe_unpermute(&h2r, hidden, &perm, &weights, k, Some(&shared), &mut want_shared).expect("unpermute");

    let what = format!("moe mlp rows={rows} experts={ne} k={k} hidden={hidden} inter={inter} {kernel:?}");
    let down_kernel =
        if kernel == MoeExpertKernel::Gemm && !inter.is_multiple_of(32) { MoeExpertKernel::Gemv } else { kernel };
    let ld = dev.upload(&logits).expect("logits");
    let mut idd = dev.alloc::<i32>(n).expect("ids");
    let mut wd = dev.alloc::<f32>(n).expect("weights");
    MoeRouteCall { logits: &ld, rows, n_experts: ne, routing, ids: &mut idd, weights: &mut wd }
        .launch(dev)
        .expect("route");
    let mut offsets = dev.alloc::<i32>(ne + 1).expect("offsets");
    let mut order = dev.alloc::<i32>(n).expect("order");
    let mut position = dev.alloc::<i32>(n).expect("position");
    MoePermuteCall {
        ids: &idd,
        assignments: n,
        n_experts: ne,
        offsets: &mut offsets,
        order: &mut order,
        position: &mut position,
    }
    .launch(dev)
    .expect("permute");
    let (xd, w1d, w2d) = (up(dev, &x), up(dev, &w1), up(dev, &w2));
    let mut h1d = poisoned(dev, n * 2 * inter);
    MoeGroupedGemvCall {
        x: &xd,
        rows: MoeRows::PerToken,
        k,
        w: &w1d,
        bias: None,
        n_experts: ne,
        n: 2 * inter,
        d: hidden,
        offsets: &offsets,
        order: &order,
        assignments: n,
        out: &mut h1d,
    }
    .launch_with(dev, kernel)
    .expect("gate_up");
    check(&format!("{what} gate_up"), &down(dev, &h1d, n * 2 * inter), &h1);
    let mut actd = poisoned(dev, n * inter);
    SiluMulCall { gate_up: &h1d, rows: n, d: inter, out: &mut actd }.launch(dev).expect("silu");
    let mut h2d = poisoned(dev, n * hidden);
    let b2d = up(dev, &b2);
    MoeGroupedGemvCall {
        x: &actd,
        rows: MoeRows::Permuted,
        k,
        w: &w2d,
        bias: Some(&b2d),
        n_experts: ne,
        n: hidden,
        d: inter,
        offsets: &offsets,
        order: &order,
        assignments: n,
        out: &mut h2d,
    }
    .launch_with(dev, down_kernel)
    .expect("down");
    check(&format!("{what} down"), &down(dev, &h2d, n * hidden), &h2);
    let shared_d = up(dev, &shared);
    for (tag, sh, want) in [("no shared", None, &want), ("shared", Some(&shared_d), &want_shared)] {
        let mut out = poisoned(dev, rows * hidden);
        MoeUnpermuteCall {
            expert_out: &h2d,
            position: &position,
            weights: &wd,
            rows,
            k,
            d: hidden,
            shared: sh,
            out: &mut out,
        }
        .launch(dev)
        .expect("unpermute");
        check(&format!("{what} out ({tag})"), &down(dev, &out, rows * hidden), want);
    }
    // d not a multiple of 8 is refused.
    let bad = MoeGroupedGemvCall {
        x: &xd,
        rows: MoeRows::PerToken,
        k,
        w: &w1d,
        bias: None,
        n_experts: ne,
        n: 2 * inter,
        d: hidden - 1,
        offsets: &offsets,
        order: &order,
        assignments: n,
        out: &mut h1d,
    };
    assert!(bad.launch(dev).is_err(), "d % 8 != 0 accepted");
}

/// Mixtral-like (8 experts, top-2) and Qwen3-MoE-like (64 experts, top-6, more than 8 rows per
/// expert at 300 rows, so the GEMV's row batches repeat) shapes, decode to prefill sizes, on
/// the GEMV, the skinny tensor-core product and the tensor-core GEMM; and a prefill-sized step (1,000 rows over 32 experts,
/// top-4: ~125 entries an expert, so whole and partial 64-entry tiles) on the GEMM and on `Auto`.
#[test]
fn gpu_moe_grouped_gemv_and_unpermute_match_cpu() {
    let dev = device();
    let mut r = rng("moe_mlp");
    for kernel in [MoeExpertKernel::Gemv, MoeExpertKernel::Skinny, MoeExpertKernel::Gemm] {
        for rows in [1usize, 7, 300] {
            moe_mlp_case(&dev, &mut r, (rows, 8, 2, 64, 32), kernel);
            moe_mlp_case(&dev, &mut r, (rows, 64, 6, 256, 136), kernel);
        }
    }
    for kernel in [MoeExpertKernel::Gemm, MoeExpertKernel::Auto] {
        moe_mlp_case(&dev, &mut r, (1000, 32, 4, 256, 96), kernel);
    }
}

/// One mixed batch (a prefill chunk over a prefix longer than the window, decode rows at
/// short and long contexts, a prefill from 0, padding rows) through [`AttentionExtCall`]
/// against `cpu::paged_attention_ext`, for each combination of options.
fn attention_ext_case(dev: &CudaDevice, r: &mut StdRng, hd: usize, nh: usize, nkv: usize, bs: usize) {
    let specs = [(45usize, 30usize), (3, 1), (4000, 1), (0, 20), (200, 1)];
    let pad = 3;
    let (num_blocks, tables, rows) = shuffled_tables(r, &specs, bs, 4);
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let kc = rand_vec(r, geo.layer_len(), 1.0);
    let vc = rand_vec(r, geo.layer_len(), 1.0);
    let w = nh * hd;
    let q = rand_vec(r, (rows + pad) * w, 1.0);
    let sinks: Vec<f32> = (0..nh).map(|_| r.random_range(-2.0f32..4.0)).collect();
    let mut meta = StepMeta::new(dev).expect("meta");
    let mut host = Vec::new();
    let mut row = 0;
    for (&(start, n), t) in specs.iter().zip(&tables) {
        host.push(HostSeq { row_start: row, n_tokens: n, start_pos: start, block_table: t });
        row += n;
    }
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let (qd, kd, vd) = (up(dev, &q), up(dev, &kc), up(dev, &vc));
    let sinks_d = dev.upload(&sinks).expect("sinks");
    let scale = 1.0 / (hd as f32).sqrt() * 1.7;
    for (window, softcap, with_sinks) in [
        (None, None, false),
        (Some(16usize), None, false),
        (Some(16), Some(2.0f32), false),
        (None, Some(1.0), false),
        (Some(128), None, true),
        (None, None, true),
    ] {
        let extras = AttnExtras { window, softcap, sinks: with_sinks.then_some(&sinks[..]) };
        // Padding rows stay zero in the reference.
        let mut want = vec![0.0; q.len()];
        let mut row = 0;
        for (&(start, n), t) in specs.iter().zip(&tables) {
            cpu::paged_attention_ext(
                &q[row * w..(row + n) * w],
                nh,
                scale,
                SeqSpan { start_pos: start, n_tokens: n, block_table: t },
                KvLayerRef { k: &kc, v: &vc, block_size: bs, n_kv_heads: nkv, head_dim: hd },
                extras,
                &mut want[row * w..(row + n) * w],
            )
            .expect("cpu attention");
            row += n;
        }
        let mut out = poisoned(dev, q.len());
        AttentionExtCall {
            q: &qd,
            k_cache: &kd,
            v_cache: &vd,
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
        .expect("attention_ext");
        check(
            &format!(
                "attention_ext hd={hd} heads={nh}/{nkv} bs={bs} window={window:?} softcap={softcap:?} sinks={with_sinks}"
            ),
            &down(dev, &out, q.len()),
            &want,
        );
    }
    // Refusals: a zero window, sinks shorter than the heads.
    let short = dev.upload(&sinks[..nh - 1]).expect("short sinks");
    let mut out = poisoned(dev, q.len());
    for (window, sinks) in [(Some(0), None), (None, Some(&short))] {
        let call = AttentionExtCall {
            q: &qd,
            k_cache: &kd,
            v_cache: &vd,
            meta: &meta,
            n_heads: nh,
            geo,
            scale,
            window,
            softcap: None,
            sinks,
            out: &mut out,
        };
        assert!(call.launch(dev).is_err(), "bad window {window:?} or short sinks accepted");
    }
}

/// Gemma 2/3 (head_dim 256, and 32 with a GQA group of 4), gpt-oss (64, group 8), Phi-3 (96:
/// three dims a lane), the tiny fixtures' 24, Llama's 128; block sizes 16 and 5.
#[test]
fn gpu_attention_window_softcap_sinks_match_cpu() {
    let dev = device();
    let mut r = rng("attention_ext");
    for &(hd, nh, nkv, bs) in &[
        (256usize, 8usize, 4usize, 16usize),
        (32, 8, 2, 16),
        (64, 16, 2, 16),
        (96, 6, 3, 5),
        (24, 4, 2, 16),
        (128, 4, 1, 5),
    ] {
        attention_ext_case(&dev, &mut r, hd, nh, nkv, bs);
    }
}
