//! Every CUDA kernel against its CPU reference (`baton_kernels::cpu`), on fresh random
//! inputs (the seed is printed), with outputs poisoned (NaN) before each launch so an
//! unwritten element fails. Inputs are rounded to bf16 first so that both sides see the
//! same values; the check is ‖out − ref‖ / ‖ref‖ < 1e-2 (bf16 storage).
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do
//! not skip) when no device can be opened. Run them with `scripts/gpu-tests.sh`.

mod common;

use baton_kernels::cpu::{self, KvLayerMut, KvLayerRef, RopeScalingKind, RopeTable, SeqSpan};
use baton_kernels::cuda::{
    ATTN_VARIANTS, AddRmsNormCall, AttentionCall, AttentionOptions, AttnKernel, AttnSplit, BiasAddCall, CopyColsCall,
    CudaDevice, CudaOptions, CudaSlice, DeviceRow, EmbedCall, GEMV_KERNEL_MAX_M, GEMV_VARIANTS, GatherRowsCall,
    HostSeq, KvCacheRef, KvGeometry, LinearCall, LinearKernel, LtSearch, LtShape, RmsNormCall, RopeInput, RopeKvCall,
    SampleBuffers, SiluMulCall, StepIds, StepMeta, bf16, gemv_supports,
};
use common::{check, device, down, poisoned, rand_vec, rel_err, rng, shuffled_tables, up};
use rand::{Rng, rngs::StdRng};

fn up32(dev: &CudaDevice, v: &[f32]) -> CudaSlice<f32> {
    dev.upload(v).expect("upload")
}

fn poisoned32(dev: &CudaDevice, n: usize) -> CudaSlice<f32> {
    dev.upload(&vec![f32::NAN; n]).expect("upload poison")
}

fn down32(dev: &CudaDevice, s: &CudaSlice<f32>, n: usize) -> Vec<f32> {
    dev.download(s, n).expect("download")
}

/// The f32 check (f32 arithmetic, f32 storage): ‖out − ref‖ / ‖ref‖ < 1e-5.
fn check32(what: &str, out: &[f32], want: &[f32]) {
    check32_within(what, out, want, 1e-5);
}

/// [`check32`] with a bound of the caller's: a dot product of `k` terms summed in another
/// order than the reference's (cuBLASLt's split-K algorithms) differs by up to ~k·ε.
fn check32_within(what: &str, out: &[f32], want: &[f32], bound: f64) {
    let e = rel_err(out, want);
    println!("{what}: rel err {e:.2e}");
    assert!(e < bound, "{what}: rel err {e:.3e} >= {bound:.1e}");
}

#[test]
fn gpu_embed_matches_cpu() {
    let dev = device();
    let mut r = rng("embed");
    for &(vocab, dim, n) in &[(1000usize, 257usize, 1usize), (517, 4096, 257)] {
        let table = rand_vec(&mut r, vocab * dim, 1.0);
        let tokens: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
        let mut want = vec![0.0; n * dim];
        cpu::embed(&tokens, &table, dim, &mut want).expect("cpu embed");
        let t = up(&dev, &table);
        let mut out = poisoned32(&dev, n * dim);
        let mut ids = StepIds::new(&dev).expect("ids");
        ids.stage(&dev, &tokens, vocab, &[], None).expect("stage");
        EmbedCall { ids: &ids, table: &t, vocab, dim, out: &mut out }.launch(&dev).expect("embed");
        let got = down32(&dev, &out, n * dim);
        assert_eq!(got, want, "embed is a copy (bf16 widened to f32) and must be exact");
        assert!(ids.stage(&dev, &[vocab as u32], vocab, &[], None).is_err(), "bad token accepted");
        // Ids checked against a larger vocabulary than the table's are refused at launch.
        ids.stage(&dev, &tokens, vocab + 1, &[], None).expect("stage");
        let call = EmbedCall { ids: &ids, table: &t, vocab, dim, out: &mut out };
        assert!(call.launch(&dev).is_err(), "ids of another vocabulary accepted");
    }
}

/// A step planned before the previous step's tokens reached the host embeds them straight
/// from the sampler: rows named as pending take the greedy picks of a sampling that was
/// launched and not collected, the other rows their host ids; bad pending lists are refused.
#[test]
fn gpu_pending_ids_come_from_the_sampler() {
    let dev = device();
    let mut r = rng("pending_ids");
    let (vocab, dim, n_logit_rows) = (3001usize, 96usize, 37usize);
    let logits: Vec<f32> = (0..n_logit_rows * vocab).map(|_| r.random_range(-4.0f32..4.0)).collect();
    let argmax: Vec<u32> = logits
        .chunks_exact(vocab)
        .map(|row| (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap_or(0) as u32)
        .collect();
    // Sample the logit rows in a shuffled order, so sampler row i is logit row order[i].
    let mut order: Vec<usize> = (0..n_logit_rows).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, r.random_range(0..=i));
    }
    let rows: Vec<DeviceRow<'_>> = order
        .iter()
        .map(|&l| DeviceRow {
            logit_row: l,
            ops: &[],
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logprobs: None,
            u: 0.0,
            allowed: None,
        })
        .collect();
    let mut d_logits = up32(&dev, &logits);
    let mut bufs = SampleBuffers::new(&dev).expect("buffers");
    dev.sample_rows_launch(&mut d_logits, n_logit_rows, vocab, &rows, &mut bufs).expect("launch");
    // The next step: 50 rows, every third one pending on sampler row (row * 7) % 37.
    let n = 50;
    let mut tokens: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
    let pending: Vec<(usize, usize)> = (0..n).step_by(3).map(|row| (row, (row * 7) % n_logit_rows)).collect();
    for &(row, _) in &pending {
        tokens[row] = u32::MAX; // ignored: must not reach the vocabulary check
    }
    let table = rand_vec(&mut r, vocab * dim, 1.0);
    let t = up(&dev, &table);
    let mut ids = StepIds::new(&dev).expect("ids");
    ids.stage(&dev, &tokens, vocab, &pending, Some(&bufs)).expect("stage");
    let mut out = poisoned32(&dev, n * dim);
    EmbedCall { ids: &ids, table: &t, vocab, dim, out: &mut out }.launch(&dev).expect("embed");
    let mut want_tokens = tokens.clone();
    for &(row, i) in &pending {
        want_tokens[row] = argmax[order[i]];
    }
    let mut want = vec![0.0; n * dim];
    cpu::embed(&want_tokens, &table, dim, &mut want).expect("cpu embed");
    assert_eq!(down32(&dev, &out, n * dim), want, "pending rows embed the sampler's picks");
    let picks = dev.sample_rows_collect(&mut bufs).expect("collect");
    assert_eq!(picks.iter().map(|p| p.token).collect::<Vec<_>>(), order.iter().map(|&l| argmax[l]).collect::<Vec<_>>());
    assert!(dev.sample_rows_collect(&mut bufs).is_err(), "a launch is collected once");
    for (bad, why) in [
        (vec![(0, n_logit_rows)], "a sampler row past the launch"),
        (vec![(n, 0)], "a row past the step"),
        (vec![(3, 0), (3, 1)], "a row named twice"),
    ] {
        assert!(ids.stage(&dev, &tokens, vocab, &bad, Some(&bufs)).is_err(), "{why} accepted");
    }
    assert!(ids.stage(&dev, &want_tokens, vocab, &[(0, 0)], None).is_err(), "pending without a sampling accepted");
    let mut host_bad = want_tokens.clone();
    host_bad[1] = vocab as u32;
    assert!(ids.stage(&dev, &host_bad, vocab, &[(0, 0)], Some(&bufs)).is_err(), "a bad host id accepted");
}

/// RMSNorm of the f32 residual stream, alone and fused with the add of a bf16 branch
/// output: the normalized output is bf16 (1e-2), the updated residual f32 (1e-5, and it
/// must not be rounded to bf16: the residual carries values no bf16 can hold).
#[test]
fn gpu_rms_norm_and_fused_residual_match_cpu() {
    let dev = device();
    let mut r = rng("rms_norm");
    // Rows held in registers (dim % 4 == 0, at most 16 per thread of 1,024), and the loops
    // (1001: not a multiple of 4; 17000: wider than 16,384).
    for &(rows, dim) in &[(1usize, 4096usize), (257, 1000), (3, 64), (2, 2048), (3, 1001), (2, 17000)] {
        let x = rand_vec(&mut r, rows * dim, 2.0);
        // A residual with full f32 mantissas (not bf16-representable).
        let res: Vec<f32> = (0..rows * dim).map(|_| r.random_range(-8.0f32..8.0)).collect();
        let w = rand_vec(&mut r, dim, 1.5);
        let mut want = vec![0.0; rows * dim];
        cpu::rms_norm(&res, &w, 1e-5, &mut want).expect("cpu");
        let (resd0, xd, wd) = (up32(&dev, &res), up(&dev, &x), up(&dev, &w));
        let mut out = poisoned(&dev, rows * dim);
        RmsNormCall { x: &resd0, weight: &wd, rows, dim, eps: 1e-5, out: &mut out }.launch(&dev).expect("rms_norm");
        check(&format!("rms_norm {rows}x{dim}"), &down(&dev, &out, rows * dim), &want);

        let mut res_cpu = res.clone();
        cpu::add_rms_norm(&mut res_cpu, &x, &w, 1e-5, &mut want).expect("cpu");
        let mut resd = up32(&dev, &res);
        let mut out = poisoned(&dev, rows * dim);
        AddRmsNormCall { residual: &mut resd, x: &xd, weight: &wd, rows, dim, eps: 1e-5, out: &mut out }
            .launch(&dev)
            .expect("add_rms_norm");
        check(&format!("add_rms_norm out {rows}x{dim}"), &down(&dev, &out, rows * dim), &want);
        let got_res = down32(&dev, &resd, rows * dim);
        check32(&format!("add_rms_norm residual {rows}x{dim}"), &got_res, &res_cpu);
        let bf16_exact = got_res.iter().filter(|v| bf16::from_f32(**v).to_f32() == **v).count();
        assert!(bf16_exact * 2 < got_res.len(), "the f32 residual was rounded to bf16");

        // Row gather of the residual stream: an exact copy.
        let pick: Vec<usize> = (0..rows.min(5)).map(|_| r.random_range(0..rows)).collect();
        let mut ids = dev.alloc::<i32>(1).expect("alloc");
        let mut g = poisoned32(&dev, pick.len() * dim);
        GatherRowsCall { src: &resd, src_rows: rows, width: dim, rows: &pick, scratch: &mut ids, dst: &mut g }
            .launch(&dev)
            .expect("gather f32");
        let wg: Vec<f32> = pick.iter().flat_map(|&p| res_cpu[p * dim..(p + 1) * dim].to_vec()).collect();
        assert_eq!(down32(&dev, &g, pick.len() * dim), wg);
        let bad =
            GatherRowsCall { src: &resd, src_rows: rows, width: dim, rows: &[rows], scratch: &mut ids, dst: &mut g };
        assert!(bad.launch(&dev).is_err(), "bad row accepted");
    }
}

#[test]
fn gpu_silu_mul_bias_and_copies_match_cpu() {
    let dev = device();
    let mut r = rng("silu_mul");
    // d % 8 == 0 takes 8 outputs a thread; 1001 and 4 the one-output loop.
    for &(rows, d) in &[(1usize, 14336usize), (257, 1000), (3, 1001), (5, 4)] {
        let gu = rand_vec(&mut r, rows * 2 * d, 4.0);
        let mut want = vec![0.0; rows * d];
        cpu::silu_mul(&gu, &mut want, d).expect("cpu");
        let gd = up(&dev, &gu);
        let mut out = poisoned(&dev, rows * d);
        SiluMulCall { gate_up: &gd, rows, d, out: &mut out }.launch(&dev).expect("silu_mul");
        check(&format!("silu_mul {rows}x{d}"), &down(&dev, &out, rows * d), &want);

        // Bias add in place.
        let b = rand_vec(&mut r, d, 1.0);
        let mut x = up(&dev, &want);
        BiasAddCall { x: &mut x, bias: &up(&dev, &b), rows, n: d }.launch(&dev).expect("bias_add");
        let wb: Vec<f32> = want.iter().enumerate().map(|(i, v)| v + b[i % d]).collect();
        check(&format!("bias_add {rows}x{d}"), &down(&dev, &x, rows * d), &wb);

        // Column band [d/3, d/3 + d/2) and a row gather, both exact copies.
        let (c0, cw) = (d / 3, d / 2);
        let mut band = poisoned(&dev, rows * cw);
        CopyColsCall { src: &gd, rows, src_width: 2 * d, col0: c0, dst: &mut band, dst_width: cw }
            .launch(&dev)
            .expect("copy_cols");
        let wband: Vec<f32> = (0..rows).flat_map(|i| gu[i * 2 * d + c0..i * 2 * d + c0 + cw].to_vec()).collect();
        assert_eq!(down(&dev, &band, rows * cw), wband);
        let pick: Vec<usize> = (0..rows.min(5)).map(|_| r.random_range(0..rows)).collect();
        let mut ids = dev.alloc::<i32>(1).expect("alloc");
        let mut g = poisoned(&dev, pick.len() * 2 * d);
        GatherRowsCall { src: &gd, src_rows: rows, width: 2 * d, rows: &pick, scratch: &mut ids, dst: &mut g }
            .launch(&dev)
            .expect("gather");
        let wg: Vec<f32> = pick.iter().flat_map(|&p| gu[p * 2 * d..(p + 1) * 2 * d].to_vec()).collect();
        assert_eq!(down(&dev, &g, pick.len() * 2 * d), wg);
    }
}

#[test]
fn gpu_linear_matches_cpu_gemm() {
    let dev = device();
    let mut r = rng("linear");
    // cuBLAS, and cuBLASLt's measured choice (Tuned: the first call times every candidate and
    // must leave the chosen one's product; the second launches the kept choice).
    for &(m, k, n) in
        &[(1usize, 4096usize, 1000usize), (257, 1024, 1536), (7, 64, 384), (64, 4096, 4096), (24, 14336, 4096)]
    {
        let x = rand_vec(&mut r, m * k, 1.0);
        let w = rand_vec(&mut r, n * k, 0.05);
        let mut want = vec![0.0; m * n];
        cpu::linear(&x, &w, None, m, k, n, &mut want).expect("cpu");
        let (xd, wd) = (up(&dev, &x), up(&dev, &w));
        for kernel in [LinearKernel::Cublas, LinearKernel::Tuned, LinearKernel::Tuned] {
            let mut out = poisoned(&dev, m * n);
            LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out, kernel }.launch(&dev).expect("linear");
            check(&format!("linear {kernel:?} m={m} k={k} n={n}"), &down(&dev, &out, m * n), &want);
            // The LM head's f32 output: only bf16 operands round, so it sits far closer (1e-5).
            let mut out32 = poisoned32(&dev, m * n);
            LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out32, kernel }.launch(&dev).expect("linear_f32_out");
            // 1e-5 up to k = 4096, growing with k past it (f32 sums of k terms; at k = 14,336
            // a split-K algorithm measured 1.6e-5).
            let bound = 1e-5 * (k as f64 / 4096.0).max(1.0);
            check32_within(
                &format!("linear_f32_out {kernel:?} m={m} k={k} n={n}"),
                &down32(&dev, &out32, m * n),
                &want,
                bound,
            );
        }
    }
}

/// Every configuration of cuBLASLt's split-K search (`LtSearch::SplitK`: the heuristic's
/// first picks and their split-K variants, which the tuner may choose) against the CPU GEMM,
/// bf16 and f32 outputs, each into a poisoned buffer: a split reduction that dropped or doubled
/// a slice of k would miss by far more than the bound.
#[test]
fn gpu_lt_split_k_candidates_match_cpu_gemm() {
    let dev = device();
    let mut r = rng("lt_split_k");
    for &(m, k, n) in &[(64usize, 4096usize, 4096usize), (32, 14336, 1024), (200, 1024, 1536)] {
        let x = rand_vec(&mut r, m * k, 1.0);
        let w = rand_vec(&mut r, n * k, 0.05);
        let mut want = vec![0.0; m * n];
        cpu::linear(&x, &w, None, m, k, n, &mut want).expect("cpu");
        let (xd, wd) = (up(&dev, &x), up(&dev, &w));
        for f32_out in [false, true] {
            let shape = LtShape { m, n, k, f32_out, fp8: false };
            let probe = dev.lt_probe(shape, LtSearch::SplitK(12)).expect("probe");
            let split = probe.infos().iter().filter(|a| a.split_k > 1).count();
            eprintln!("m={m} k={k} n={n} f32_out={f32_out}: {} candidates, {split} split", probe.infos().len());
            assert!(!probe.infos().is_empty(), "no candidate for {shape:?}");
            for (i, info) in probe.infos().iter().enumerate() {
                let what = format!("lt candidate {i} ({info}) m={m} k={k} n={n} f32_out={f32_out}");
                if f32_out {
                    let mut out = poisoned32(&dev, m * n);
                    dev.lt_probe_launch(&probe, i, &xd, &wd, &mut out).expect("launch");
                    let bound = 1e-5 * (k as f64 / 4096.0).max(1.0);
                    check32_within(&what, &down32(&dev, &out, m * n), &want, bound);
                } else {
                    let mut out = poisoned(&dev, m * n);
                    dev.lt_probe_launch(&probe, i, &xd, &wd, &mut out).expect("launch");
                    check(&what, &down(&dev, &out, m * n), &want);
                }
            }
        }
    }
}

/// `x · wᵀ` in f64 (the inputs are already bf16 values).
fn gemm_f64(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            out[i * n + j] = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32;
        }
    }
    out
}

/// The skinny GEMM against an f64 reference, every variant, bf16 and f32 outputs: m across
/// both instantiations (≤ 8 and 9..16 rows), k a multiple of 8 but not of a whole batch
/// (4104, 136, 8: the partial last batch) and long (14336), n not a multiple of the 16 rows
/// of a CTA. Outputs past m × n must stay untouched; shapes the kernel cannot take are
/// refused, and cuBLAS (the backend's fallback) takes them.
#[test]
fn gpu_gemv_matches_cpu() {
    let dev = device();
    let mut r = rng("gemv");
    for &(k, n) in &[(4096usize, 1000usize), (4104, 257), (136, 1000), (8, 33), (14336, 64)] {
        for m in [1usize, 2, 3, 5, 8, 9, GEMV_KERNEL_MAX_M] {
            let x = rand_vec(&mut r, m * k, 1.0);
            let w = rand_vec(&mut r, n * k, 0.05);
            let want = gemm_f64(&x, &w, m, k, n);
            let (xd, wd) = (up(&dev, &x), up(&dev, &w));
            let spare = 64;
            for (vi, v) in GEMV_VARIANTS.iter().enumerate() {
                let what = format!("gemv {v:?} m={m} k={k} n={n}");
                let mut out = poisoned(&dev, m * n + spare);
                let kernel = LinearKernel::Gemv { variant: Some(vi) };
                LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out, kernel }.launch(&dev).expect("gemv");
                let got = down(&dev, &out, m * n + spare);
                assert!(got[m * n..].iter().all(|v| v.is_nan()), "{what}: wrote past m × n");
                check(&what, &got[..m * n], &want);
                // f32 output: only the bf16 operands round (1e-5, as cuBLAS's linear_f32_out).
                let mut out32 = poisoned32(&dev, m * n + spare);
                LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out32, kernel }.launch(&dev).expect("gemv_f32_out");
                let got = down32(&dev, &out32, m * n + spare);
                assert!(got[m * n..].iter().all(|v| v.is_nan()), "{what} f32: wrote past m × n");
                check32(&format!("{what} f32"), &got[..m * n], &want);
            }
            // The default entry points.
            let mut out = poisoned(&dev, m * n);
            LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out, kernel: LinearKernel::GEMV }
                .launch(&dev)
                .expect("gemv");
            check(&format!("gemv default m={m} k={k} n={n}"), &down(&dev, &out, m * n), &want);
            let mut out32 = poisoned32(&dev, m * n);
            LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out32, kernel: LinearKernel::GEMV }
                .launch(&dev)
                .expect("gemv_f32_out");
            check32(&format!("gemv_f32_out default m={m} k={k} n={n}"), &down32(&dev, &out32, m * n), &want);
            // With more of the weights pulled into L2 before the wait (half the matrix, all of
            // it): a prefetch changes no bit of the result, and reads nothing past the rows.
            let default_bits = down(&dev, &out, m * n);
            for budget in [n * k, usize::MAX] {
                dev.set_gemv_l2_prefetch(budget);
                let mut out = poisoned(&dev, m * n + spare);
                LinearCall { x: &xd, m, k, w: &wd, n, out: &mut out, kernel: LinearKernel::GEMV }
                    .launch(&dev)
                    .expect("gemv with prefetch");
                let got = down(&dev, &out, m * n + spare);
                assert!(got[m * n..].iter().all(|v| v.is_nan()), "prefetch {budget}: wrote past m × n");
                let same = got[..m * n].iter().zip(&default_bits).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "gemv m={m} k={k} n={n}: prefetch budget {budget} changed the result");
            }
            dev.set_gemv_l2_prefetch(0);
        }
    }

    // Refusals: too many rows, k off a multiple of 8, a short output, an unknown variant.
    let (m, k, n) = (GEMV_KERNEL_MAX_M + 1, 4100usize, 40usize);
    let x = rand_vec(&mut r, m * k, 1.0);
    let w = rand_vec(&mut r, n * k, 0.05);
    let (xd, wd) = (up(&dev, &x), up(&dev, &w));
    let mut out = poisoned(&dev, m * n);
    let mut out32 = poisoned32(&dev, m * n);
    assert!(!gemv_supports(1, k) && !gemv_supports(m, 4096));
    let bad_k = LinearCall { x: &xd, m: 1, k, w: &wd, n, out: &mut out, kernel: LinearKernel::GEMV };
    assert!(bad_k.launch(&dev).is_err(), "k % 8 != 0 accepted");
    let bad_k = LinearCall { x: &xd, m: 1, k, w: &wd, n, out: &mut out32, kernel: LinearKernel::GEMV };
    assert!(bad_k.launch(&dev).is_err(), "k % 8 != 0 accepted (f32)");
    let many_rows = LinearCall { x: &xd, m, k: 4096, w: &wd, n, out: &mut out, kernel: LinearKernel::GEMV };
    assert!(many_rows.launch(&dev).is_err(), "m > GEMV_KERNEL_MAX_M accepted");
    let mut short = poisoned(&dev, n - 1);
    let short_out = LinearCall { x: &xd, m: 1, k: 4096, w: &wd, n, out: &mut short, kernel: LinearKernel::GEMV };
    assert!(short_out.launch(&dev).is_err(), "short output accepted");
    let kernel = LinearKernel::Gemv { variant: Some(GEMV_VARIANTS.len()) };
    let bad_variant = LinearCall { x: &xd, m: 1, k: 4096, w: &wd, n, out: &mut out, kernel };
    assert!(bad_variant.launch(&dev).is_err(), "bad variant");
    LinearCall { x: &xd, m: 0, k: 4096, w: &wd, n, out: &mut out, kernel: LinearKernel::GEMV }
        .launch(&dev)
        .expect("m = 0 is a no-op");
    // What the backend does with those shapes instead: cuBLAS.
    for mm in [1usize, m] {
        let mut out = poisoned(&dev, mm * n);
        LinearCall { x: &xd, m: mm, k, w: &wd, n, out: &mut out, kernel: LinearKernel::Cublas }
            .launch(&dev)
            .expect("linear");
        check(
            &format!("cuBLAS fallback m={mm} k={k} n={n}"),
            &down(&dev, &out, mm * n),
            &gemm_f64(&x[..mm * k], &w, mm, k, n),
        );
    }
}

fn rope_case(dev: &CudaDevice, r: &mut StdRng, hd: usize, scaling: RopeScalingKind, theta: f32) {
    let (nh, nkv, bs) = (8usize, 2usize, 16usize);
    // Three sequences: a long prefill chunk over a prefix, a decode row at a large position,
    // and a short prefill from 0.
    let specs = [(37usize, 20usize), (100_003, 1), (0, 5)];
    let rows: usize = specs.iter().map(|s| s.1).sum();
    let num_blocks = 64;
    let mut tables = Vec::new();
    let mut seqs = Vec::new();
    let mut row = 0;
    let mut positions = Vec::new();
    for &(start, n) in &specs {
        // Logical blocks below the chunk point anywhere (never read); the chunk's own
        // blocks are distinct physical blocks.
        let nb = (start + n).div_ceil(bs);
        let mut t: Vec<u32> = (0..nb).map(|_| r.random_range(0..num_blocks as u32)).collect();
        for (j, lb) in (start / bs..nb).enumerate() {
            t[lb] = (seqs.len() * 8 + j) as u32;
        }
        tables.push(t);
        seqs.push((row, n, start));
        positions.extend(start..start + n);
        row += n;
    }
    let table = RopeTable::new(hd, theta, scaling).expect("table");
    let q = rand_vec(r, rows * nh * hd, 1.0);
    let k = rand_vec(r, rows * nkv * hd, 1.0);
    let v = rand_vec(r, rows * nkv * hd, 1.0);
    let (mut qw, mut kw) = (q.clone(), k.clone());
    table.apply(&mut qw, nh, &positions).expect("rope q");
    table.apply(&mut kw, nkv, &positions).expect("rope k");
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let mut kc = vec![f32::NAN; geo.layer_len()];
    let mut vc = vec![f32::NAN; geo.layer_len()];
    let stride = nkv * hd;
    for (s, t) in seqs.iter().zip(&tables) {
        let mut layer = KvLayerMut { k: &mut kc, v: &mut vc, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        cpu::write_kv(
            &kw[s.0 * stride..(s.0 + s.1) * stride],
            &v[s.0 * stride..(s.0 + s.1) * stride],
            SeqSpan { start_pos: s.2, n_tokens: s.1, block_table: t },
            &mut layer,
        )
        .expect("cpu write_kv");
    }
    let host: Vec<HostSeq<'_>> = seqs
        .iter()
        .zip(&tables)
        .map(|(s, t)| HostSeq { row_start: s.0, n_tokens: s.1, start_pos: s.2, block_table: t })
        .collect();
    // Two padding rows (a CUDA-graph bucket) follow the real ones: they must write no slot.
    let pad = 2;
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, rows, rows + pad, bs, num_blocks).expect("meta set");
    let with_pad =
        |x: &[f32], w: usize| -> Vec<f32> { x.iter().copied().chain((0..pad * w).map(|i| i as f32)).collect() };
    let (mut qd, mut kd, vd) =
        (up(dev, &with_pad(&q, nh * hd)), up(dev, &with_pad(&k, stride)), up(dev, &with_pad(&v, stride)));
    let mut kcd = poisoned(dev, geo.layer_len());
    let mut vcd = poisoned(dev, geo.layer_len());
    let inv = dev.upload(table.inv_freq()).expect("inv_freq");
    RopeKvCall {
        input: RopeInput::Split { q: &mut qd, k: &mut kd, v: &vd },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch(dev)
    .expect("rope_write_kv");
    let what = format!("rope hd={hd} {scaling:?}");
    check(&format!("{what} q"), &down(dev, &qd, q.len()), &qw);
    check(&format!("{what} k"), &down(dev, &kd, k.len()), &kw);
    // Compare the cache only where the CPU wrote (NaN elsewhere on both sides).
    let (gk, gv) = (down(dev, &kcd, kc.len()), down(dev, &vcd, vc.len()));
    let untouched = |c: &[f32], g: &[f32]| c.iter().zip(g).filter(|(a, _)| a.is_nan()).all(|(_, b)| b.is_nan());
    assert!(untouched(&kc, &gk) && untouched(&vc, &gv), "{what}: a padding row wrote into the cache");
    let pick = |c: &[f32], g: &[f32]| -> (Vec<f32>, Vec<f32>) {
        c.iter().zip(g).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*b, *a)).unzip()
    };
    let (gk, wk) = pick(&kc, &gk);
    let (gv, wv) = pick(&vc, &gv);
    assert_eq!(wk.len(), rows * stride, "every row's K slot written once");
    check(&format!("{what} k cache"), &gk, &wk);
    assert_eq!(gv, wv, "V is copied exactly");

    // The fused entry: the same rows as [q | k | v] of one QKV projection, rotated q out,
    // k and v to the cache only (padding rows included, writing nothing).
    let padded = rows + pad;
    let (qp, kp, vp) = (with_pad(&q, nh * hd), with_pad(&k, stride), with_pad(&v, stride));
    let qkv: Vec<f32> = (0..padded)
        .flat_map(|r| {
            let q = &qp[r * nh * hd..(r + 1) * nh * hd];
            q.iter().chain(&kp[r * stride..(r + 1) * stride]).chain(&vp[r * stride..(r + 1) * stride]).copied()
        })
        .collect();
    let mut q_out = poisoned(dev, padded * nh * hd);
    let mut kcd = poisoned(dev, geo.layer_len());
    let mut vcd = poisoned(dev, geo.layer_len());
    RopeKvCall {
        input: RopeInput::Fused { qkv: &up(dev, &qkv), q_out: &mut q_out },
        k_cache: &mut kcd,
        v_cache: &mut vcd,
        meta: &meta,
        inv_freq: &inv,
        n_heads: nh,
        geo,
    }
    .launch(dev)
    .expect("fused");
    check(&format!("{what} fused q"), &down(dev, &q_out, q.len()), &qw);
    let (gk, gv) = (down(dev, &kcd, kc.len()), down(dev, &vcd, vc.len()));
    assert!(untouched(&kc, &gk) && untouched(&vc, &gv), "{what} fused: a padding row wrote into the cache");
    let (gk, wk) = pick(&kc, &gk);
    let (gv, wv) = pick(&vc, &gv);
    assert_eq!(wk.len(), rows * stride, "fused: every row's K slot written once");
    check(&format!("{what} fused k cache"), &gk, &wk);
    assert_eq!(gv, wv, "fused: V is copied exactly");
}

#[test]
fn gpu_rope_write_kv_matches_cpu() {
    let dev = device();
    let mut r = rng("rope");
    for hd in [64usize, 128] {
        rope_case(&dev, &mut r, hd, RopeScalingKind::None, 10_000.0);
        rope_case(&dev, &mut r, hd, RopeScalingKind::Linear { factor: 4.0 }, 10_000.0);
        rope_case(
            &dev,
            &mut r,
            hd,
            RopeScalingKind::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            500_000.0,
        );
    }
}

/// A mixed batch: each `(start_pos, n_tokens)` is one sequence over a cache of `bs`-token
/// blocks filled with random K/V (so reading a wrong slot is an error, not a zero), followed by
/// `pad` padding rows (a CUDA-graph bucket's unused rows: context 0, output zeros) whose q is
/// random too.
fn attention_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    hd: usize,
    nh: usize,
    nkv: usize,
    bs: usize,
    pad: usize,
    specs: &[(usize, usize)],
) {
    let (num_blocks, tables, rows) = shuffled_tables(r, specs, bs, 5);
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let kc = rand_vec(r, geo.layer_len(), 1.0);
    let vc = rand_vec(r, geo.layer_len(), 1.0);
    let padded = rows + pad;
    let q = rand_vec(r, padded * nh * hd, 1.0);
    let scale = 1.0 / (hd as f32).sqrt();
    // Padding rows stay zero in the reference.
    let mut want = vec![0.0; q.len()];
    let mut host = Vec::new();
    let mut row = 0;
    let w = nh * hd;
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
        row += n;
    }
    let mut meta = StepMeta::new(dev).expect("meta");
    meta.set_padded(dev, &host, rows, padded, bs, num_blocks).expect("meta set");
    let (qd, kd, vd) = (up(dev, &q), up(dev, &kc), up(dev, &vc));
    let attention = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, kernel, split| {
        AttentionCall {
            q: &qd,
            cache: KvCacheRef::Bf16 { k: &kd, v: &vd },
            meta,
            n_heads: nh,
            geo,
            scale,
            out,
            kernel,
            split,
            options: AttentionOptions::default(),
        }
        .launch(dev)
    };
    // Every variant (register and tensor-core kernels), unsplit, split as the device would
    // choose, split finely (many splits past short rows' contexts), and an exact split count
    // (one launch shape for any contexts, as a captured graph uses); then the default entry
    // point.
    for (vi, v) in ATTN_VARIANTS.iter().enumerate() {
        for split in
            [AttnSplit::Fixed(1), AttnSplit::Auto, AttnSplit::Fixed(64), AttnSplit::Exact(5), AttnSplit::Exact(128)]
        {
            let mut out = poisoned(dev, q.len());
            let kernel = AttnKernel::Decode { variant: Some(vi) };
            attention(&mut meta, &mut out, kernel, split).expect("attention");
            check(
                &format!(
                    "attention {} {split:?} hd={hd} heads={nh}/{nkv} bs={bs} seqs={} rows={rows}+{pad}",
                    v.label(),
                    specs.len()
                ),
                &down(dev, &out, q.len()),
                &want,
            );
        }
    }
    let mut out = poisoned(dev, q.len());
    attention(&mut meta, &mut out, AttnKernel::DECODE, AttnSplit::Auto).expect("attention");
    check(&format!("attention default hd={hd} heads={nh}/{nkv} bs={bs}"), &down(dev, &out, q.len()), &want);
    // The default variant with an exact split count, as a graph replay launches it.
    let mut out = poisoned(dev, q.len());
    attention(&mut meta, &mut out, AttnKernel::DECODE, AttnSplit::Exact(16)).expect("attention");
    check(&format!("attention default exact-16 hd={hd} heads={nh}/{nkv} bs={bs}"), &down(dev, &out, q.len()), &want);
}

/// Every attention variant against the CPU: head_dims 16/32/64/128 (every variant, the
/// tensor-core ones included, is instantiated for all four), GQA groups 1, 3, 4, 7, 12, block
/// sizes 16, 1, 5, 7, contexts off every multiple, padding rows.
#[test]
fn gpu_paged_attention_matches_cpu() {
    let dev = device();
    let mut r = rng("attention");
    // Decode rows at context lengths off the block size, a prefill chunk over a cached
    // prefix, a prefill from scratch, one long context.
    let mixed = [(0usize, 1usize), (16, 1), (40, 1), (1000, 1), (37, 20), (0, 33), (2050, 1)];
    for hd in [64usize, 128] {
        for &(nh, nkv) in &[(8usize, 8usize), (32, 8), (28, 4), (24, 2), (12, 4)] {
            attention_case(&dev, &mut r, hd, nh, nkv, 16, 0, &mixed);
        }
        attention_case(&dev, &mut r, hd, 4, 2, 16, 0, &[(300, 1)]);
        // 257 decode rows with random context lengths, and 3 padding rows.
        let many: Vec<(usize, usize)> = (0..257).map(|_| (r.random_range(0..300), 1)).collect();
        attention_case(&dev, &mut r, hd, 32, 8, 16, 3, &many);
    }
    // Batch 1 at a long context not a multiple of the block size (the split path's case).
    attention_case(&dev, &mut r, 128, 32, 8, 16, 0, &[(4100, 1)]);
    // Block sizes that are not a multiple of anything (a stage of 16 tokens spans several
    // blocks, or a block straddles stages).
    let odd = [(0usize, 1usize), (6, 1), (200, 1), (33, 9), (517, 1)];
    for bs in [1usize, 5, 7] {
        attention_case(&dev, &mut r, 128, 32, 8, bs, 2, &odd);
        attention_case(&dev, &mut r, 64, 12, 4, bs, 0, &odd);
    }
    // The tiny test models' head_dim, and 32.
    attention_case(&dev, &mut r, 16, 4, 2, 16, 1, &mixed);
    attention_case(&dev, &mut r, 32, 8, 2, 16, 0, &mixed);
    attention_case(&dev, &mut r, 16, 12, 1, 5, 0, &mixed);
}

#[test]
fn gpu_step_meta_refuses_bad_tables() {
    let dev = device();
    let mut meta = StepMeta::new(&dev).expect("meta");
    let bad_block = [HostSeq { row_start: 0, n_tokens: 1, start_pos: 0, block_table: &[9] }];
    assert!(meta.set(&dev, &bad_block, 1, 16, 4).is_err());
    let short = [HostSeq { row_start: 0, n_tokens: 1, start_pos: 16, block_table: &[0] }];
    assert!(meta.set(&dev, &short, 1, 16, 4).is_err());
    let uncovered = [HostSeq { row_start: 0, n_tokens: 1, start_pos: 0, block_table: &[0] }];
    assert!(meta.set(&dev, &uncovered, 2, 16, 4).is_err());
}

#[test]
fn gpu_kernel_cache_round_trip() {
    let dir = std::env::temp_dir().join(format!("baton-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = CudaOptions { ordinal: 0, cache_dir: Some(dir.clone()), ..Default::default() };
    let first = CudaDevice::open(&opts).expect("open");
    assert!(!first.module_load().1, "an empty cache cannot hit");
    drop(first);
    let second = CudaDevice::open(&opts).expect("open again");
    let (ms, hit) = second.module_load();
    println!("arch {} cached load {ms:.1} ms", second.arch());
    assert!(hit, "second open must load from the cache");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A device opened for one model (a dense bf16 model of head_dim 128) compiles and loads only
/// that model's modules, and a kernel of a module it left out fails its launch with an error
/// naming the module, not a panic.
#[test]
fn gpu_device_for_one_model_loads_only_its_modules() {
    use baton_kernels::cuda::{ClampedSwigluCall, CudaError, KernelNeeds, QuantRows, QuantizeRowsCall};
    let needs = KernelNeeds::model(128, false, false);
    let cache = std::env::temp_dir().join("baton-gpu-test-kernels");
    let dev =
        CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: Some(cache), needs: needs.clone() }).expect("open");
    let loaded: Vec<String> = dev.module_reports().iter().map(|r| r.name.clone()).collect();
    let wanted: Vec<String> = needs.modules().iter().map(|m| m.name()).collect();
    assert_eq!(loaded, wanted);
    let gate_up = dev.upload(&[bf16::from_f32(0.5); 2 * 64]).expect("up");
    let mut out = dev.upload(&[bf16::from_f32(f32::NAN); 64]).expect("up");
    let moe =
        ClampedSwigluCall { gate_up: &gate_up, rows: 1, d: 64, alpha: 1.702, limit: 7.0, out: &mut out }.launch(&dev);
    assert!(matches!(&moe, Err(CudaError::NotLoaded { module, .. }) if module == "moe"), "{moe:?}");
    let (mut codes, mut scales) = (dev.alloc::<u8>(64).expect("alloc"), dev.alloc::<f32>(1).expect("alloc"));
    let x = QuantRows::Bf16(&gate_up);
    let fp8 = QuantizeRowsCall { x, m: 1, k: 64, codes: &mut codes, scales: &mut scales, row0: 0 }.launch(&dev);
    assert!(matches!(&fp8, Err(CudaError::NotLoaded { module, .. }) if module == "fp8"), "{fp8:?}");
    // The modules it did load run: the same device converts a row.
    let mut f = dev.upload(&[f32::NAN; 128]).expect("up");
    baton_kernels::cuda::CastCall { src: &gate_up, dst: &mut f, n: 128 }.launch(&dev).expect("bf16_to_f32");
    assert!(dev.download(&f, 128).expect("download").iter().all(|&v| v == 0.5));
}
