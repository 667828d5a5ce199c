//! The decode-sized MoE kernels against their CPU references (`baton_kernels::cpu`) and, for
//! the fusions, against the unfused launches bit for bit: routing + permutation in one launch
//! ([`MoeRoutePermuteCall`]), the tensor-core skinny grouped product over the experts in use
//! ([`MoeExpertKernel::Skinny`]), and that product with SiLU·mul or gpt-oss's clamped SwiGLU
//! in its epilogue ([`MoeGateUpActCall`]), the router fused with routing and permutation
//! ([`MoeRouterCall`], against the CPU: its logits are summed in another order) and the down
//! product with the un-permute fused ([`MoeDownUnpermuteCall`], bit for bit against the product
//! then [`MoeUnpermuteCall`]). Rows 1, 3, 64 and 300 (1, 3, 16 for the fused router); k 1, 2 and 8; 8, 60 and 128
//! experts; uniform routing (most experts unused at decode sizes) and skewed routing (every
//! token to the same experts). Fresh random inputs every run (the seed is printed), outputs
//! poisoned before each launch, ‖out − ref‖ / ‖ref‖ < 1e-2 for bf16 outputs, ids exact.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::{self, ExpertWeights, MoePermutation, MoeRouting, MoeRows, MoeScoring};
use baton_kernels::cuda::{
    ClampedSwigluCall, CudaDevice, CudaSlice, MOE_ROUTER_MAX_ROWS, MOE_UNPERMUTE_RESID_MAX_ROWS, MoeDownOut,
    MoeDownUnpermuteCall, MoeExpertKernel, MoeGateUpActCall, MoeGatedAct, MoeGroupedGemvCall, MoeRouteCall,
    MoeRoutePermuteCall, MoeRouterCall, MoeUnpermuteCall, SiluMulCall, bf16, moe_unpermute_counters,
};
use common::{check, device, down, poisoned, rand_vec, rng, up};
use rand::{Rng, rngs::StdRng};

/// (experts, k) pairs covering 8, 60 and 128 experts and k of 1, 2 and 8.
const ROUTINGS: [(usize, usize); 4] = [(8, 2), (60, 1), (128, 8), (8, 8)];
const ROWS: [usize; 4] = [1, 3, 64, 300];

/// Router logits: uniform, or skewed so that every row's top-k is the same k experts (with
/// k = 1, every token to one expert).
fn logits(r: &mut StdRng, rows: usize, ne: usize, k: usize, skewed: bool) -> Vec<f32> {
    let hot = r.random_range(0..ne);
    let mut l: Vec<f32> = (0..rows * ne).map(|_| r.random_range(-2.0f32..2.0)).collect();
    if skewed {
        for row in 0..rows {
            for j in 0..k {
                l[row * ne + (hot + j) % ne] += 20.0 - j as f32;
            }
        }
    }
    l
}

fn routing(ne: usize, k: usize) -> MoeRouting {
    // The sigmoid scoring for one of the shapes, softmax (renormalized) for the others.
    let scoring = if ne == 60 { MoeScoring::Sigmoid } else { MoeScoring::Softmax };
    MoeRouting { k, scoring, renormalize: true, scale: 1.0 }
}

/// The CPU routing and permutation of `logits`.
fn cpu_route(logits: &[f32], ne: usize, routing: MoeRouting) -> (Vec<u32>, Vec<f32>, MoePermutation) {
    let n = logits.len() / ne * routing.k;
    let (mut ids, mut w) = (vec![0u32; n], vec![0f32; n]);
    cpu::moe_route(logits, ne, routing, &mut ids, &mut w).expect("cpu route");
    let perm = cpu::moe_permute(&ids, ne).expect("cpu permute");
    (ids, w, perm)
}

fn as_i32(v: &[u32]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

/// A device routing (`[ids, offsets, order, position]` and weights) against the CPU's: the
/// integers exact, the weights to 1e-5.
fn check_route(
    dev: &CudaDevice,
    what: &str,
    [ids, offsets, order, position]: [&CudaSlice<i32>; 4],
    weights: &CudaSlice<f32>,
    (want_ids, want_w, perm): (&[u32], &[f32], &MoePermutation),
) {
    let (n, ne) = (want_ids.len(), perm.offsets.len() - 1);
    let got = |s: &CudaSlice<i32>, len| dev.download(s, len).expect("download");
    assert_eq!(got(ids, n), as_i32(want_ids), "{what}: ids");
    assert_eq!(got(offsets, ne + 1), as_i32(&perm.offsets), "{what}: offsets");
    assert_eq!(got(order, n), as_i32(&perm.order), "{what}: order");
    assert_eq!(got(position, n), as_i32(&perm.position), "{what}: position");
    let gw: Vec<f32> = dev.download(weights, n).expect("weights");
    let e = common::rel_err(&gw, want_w);
    assert!(e < 1e-5, "{what}: weights rel err {e:.2e}");
}

/// The device routing weights and permutation (offsets, order, position) of a routing,
/// through the fused launch.
struct DevicePerm {
    weights: CudaSlice<f32>,
    offsets: CudaSlice<i32>,
    order: CudaSlice<i32>,
    position: CudaSlice<i32>,
}

fn device_route(dev: &CudaDevice, logits: &[f32], rows: usize, ne: usize, routing: MoeRouting) -> DevicePerm {
    let n = rows * routing.k;
    let ld = dev.upload(logits).expect("logits");
    let mut ids = dev.upload(&vec![-1i32; n]).expect("ids");
    let mut p = DevicePerm {
        weights: dev.upload(&vec![f32::NAN; n]).expect("weights"),
        offsets: dev.upload(&vec![-1i32; ne + 1]).expect("offsets"),
        order: dev.upload(&vec![-1i32; n]).expect("order"),
        position: dev.upload(&vec![-1i32; n]).expect("position"),
    };
    MoeRoutePermuteCall {
        route: MoeRouteCall { logits: &ld, rows, n_experts: ne, routing, ids: &mut ids, weights: &mut p.weights },
        offsets: &mut p.offsets,
        order: &mut p.order,
        position: &mut p.position,
    }
    .launch(dev)
    .expect("route + permute");
    p
}

/// The fused routing + permutation (forced at every row count) and the two-kernel path
/// against the CPU: ids, offsets, order and position exact, weights to 1e-5.
#[test]
fn gpu_moe_route_permute_fused_matches_cpu() {
    let dev = device();
    let mut r = rng("moe_route_permute");
    for (ne, k) in ROUTINGS {
        for rows in ROWS {
            for skewed in [false, true] {
                let routing = routing(ne, k);
                let l = logits(&mut r, rows, ne, k, skewed);
                let (want_ids, want_w, perm) = cpu_route(&l, ne, routing);
                if skewed {
                    let used = perm.offsets.windows(2).filter(|w| w[1] > w[0]).count();
                    assert_eq!(used, k, "skewed logits route to {used} experts, want {k}");
                }
                let ld = dev.upload(&l).expect("logits");
                let n = rows * k;
                for fused in [true, false] {
                    let mut ids = dev.upload(&vec![-1i32; n]).expect("ids");
                    let mut w = dev.upload(&vec![f32::NAN; n]).expect("weights");
                    let mut offsets = dev.upload(&vec![-1i32; ne + 1]).expect("offsets");
                    let mut order = dev.upload(&vec![-1i32; n]).expect("order");
                    let mut position = dev.upload(&vec![-1i32; n]).expect("position");
                    MoeRoutePermuteCall {
                        route: MoeRouteCall {
                            logits: &ld,
                            rows,
                            n_experts: ne,
                            routing,
                            ids: &mut ids,
                            weights: &mut w,
                        },
                        offsets: &mut offsets,
                        order: &mut order,
                        position: &mut position,
                    }
                    .launch_with(&dev, fused)
                    .expect("route + permute");
                    let what = format!("route+permute e={ne} k={k} rows={rows} skewed={skewed} fused={fused}");
                    let got = [&ids, &offsets, &order, &position];
                    check_route(&dev, &what, got, &w, (&want_ids, &want_w, &perm));
                }
            }
        }
    }
    // Refusals before any launch: short permutation outputs, k above the experts.
    let ld = dev.upload(&[0.0f32; 16]).expect("logits");
    let (mut ids, mut w) = (dev.alloc::<i32>(4).expect("ids"), dev.alloc::<f32>(4).expect("w"));
    let (mut o, mut ord, mut pos) =
        (dev.alloc::<i32>(9).expect("o"), dev.alloc::<i32>(3).expect("ord"), dev.alloc::<i32>(4).expect("pos"));
    for fused in [true, false] {
        let call = MoeRoutePermuteCall {
            route: MoeRouteCall {
                logits: &ld,
                rows: 2,
                n_experts: 8,
                routing: routing(8, 2),
                ids: &mut ids,
                weights: &mut w,
            },
            offsets: &mut o,
            order: &mut ord,
            position: &mut pos,
        };
        assert!(call.launch_with(&dev, fused).is_err(), "short order accepted (fused {fused})");
    }
    let mut ord4 = dev.alloc::<i32>(4).expect("ord");
    let call = MoeRoutePermuteCall {
        route: MoeRouteCall {
            logits: &ld,
            rows: 2,
            n_experts: 8,
            routing: routing(8, 9),
            ids: &mut ids,
            weights: &mut w,
        },
        offsets: &mut o,
        order: &mut ord4,
        position: &mut pos,
    };
    assert!(call.launch(&dev).is_err(), "k > experts accepted");
}

/// Shapes of the product tests: (hidden, expert width). 256 / 136 exercise the narrow variant
/// with a partial last batch (136 inputs of the down projection); 2,048 / 768 is the
/// Qwen3-30B-A3B shape (the wide variant on gate_up), at decode sizes with 8 experts so the
/// CPU reference stays quick.
fn widths(rows: usize, ne: usize, k: usize) -> Vec<(usize, usize)> {
    let mut v = vec![(256, 136)];
    if ne == 8 && k == 2 && rows <= 64 {
        v.push((2048, 768));
    }
    v
}

/// The skinny product (both row sources, with a bias on one) against the CPU grouped linear.
#[test]
fn gpu_moe_skinny_product_matches_cpu() {
    let dev = device();
    let mut r = rng("moe_skinny");
    for (ne, k) in ROUTINGS {
        for rows in ROWS {
            for skewed in [false, true] {
                for (hidden, inter) in widths(rows, ne, k) {
                    let routing = routing(ne, k);
                    let l = logits(&mut r, rows, ne, k, skewed);
                    let (_, _, perm) = cpu_route(&l, ne, routing);
                    let p = device_route(&dev, &l, rows, ne, routing);
                    let a = rows * k;
                    let what = format!("skinny e={ne} k={k} rows={rows} skewed={skewed} {hidden}/{inter}");
                    // gate_up from the hidden states (per token), no bias.
                    let x = rand_vec(&mut r, rows * hidden, 1.0);
                    let w1 = rand_vec(&mut r, ne * 2 * inter * hidden, 1.0 / (hidden as f32).sqrt());
                    let mut want = vec![0f32; a * 2 * inter];
                    let wv = ExpertWeights { w: &w1, n: 2 * inter, d: hidden, bias: None };
                    cpu::moe_grouped_linear(&x, MoeRows::PerToken, wv, &perm, k, &mut want).expect("cpu");
                    let (xd, w1d) = (up(&dev, &x), up(&dev, &w1));
                    let mut out = poisoned(&dev, a * 2 * inter);
                    MoeGroupedGemvCall {
                        x: &xd,
                        rows: MoeRows::PerToken,
                        k,
                        w: &w1d,
                        bias: None,
                        n_experts: ne,
                        n: 2 * inter,
                        d: hidden,
                        offsets: &p.offsets,
                        order: &p.order,
                        assignments: a,
                        out: &mut out,
                    }
                    .launch_with(&dev, MoeExpertKernel::Skinny)
                    .expect("skinny gate_up");
                    check(&format!("{what} per-token"), &down(&dev, &out, a * 2 * inter), &want);
                    // down from permuted rows, with a bias.
                    let xp = rand_vec(&mut r, a * inter, 1.0);
                    let w2 = rand_vec(&mut r, ne * hidden * inter, 1.0 / (inter as f32).sqrt());
                    let b2 = rand_vec(&mut r, ne * hidden, 0.5);
                    let mut want2 = vec![0f32; a * hidden];
                    let wv2 = ExpertWeights { w: &w2, n: hidden, d: inter, bias: Some(&b2) };
                    cpu::moe_grouped_linear(&xp, MoeRows::Permuted, wv2, &perm, k, &mut want2).expect("cpu");
                    let (xpd, w2d, b2d) = (up(&dev, &xp), up(&dev, &w2), up(&dev, &b2));
                    let mut out2 = poisoned(&dev, a * hidden);
                    MoeGroupedGemvCall {
                        x: &xpd,
                        rows: MoeRows::Permuted,
                        k,
                        w: &w2d,
                        bias: Some(&b2d),
                        n_experts: ne,
                        n: hidden,
                        d: inter,
                        offsets: &p.offsets,
                        order: &p.order,
                        assignments: a,
                        out: &mut out2,
                    }
                    .launch_with(&dev, MoeExpertKernel::Skinny)
                    .expect("skinny down");
                    check(&format!("{what} permuted+bias"), &down(&dev, &out2, a * hidden), &want2);
                }
            }
        }
    }
}

fn bits(dev: &CudaDevice, s: &CudaSlice<bf16>, n: usize) -> Vec<u16> {
    dev.download(s, n).expect("download").iter().map(|v| v.to_bits()).collect()
}

/// gate_up with the activation fused, against the skinny product followed by the activation
/// kernel (bit for bit) and against the CPU (gate_up rounded to bf16 as the device stores it,
/// then the CPU activation); SiLU·mul over `[gate | up]` and the clamped SwiGLU over
/// interleaved columns (a small limit, so the clamps bite), each with and without a bias.
#[test]
fn gpu_moe_gate_up_act_is_bit_identical_to_unfused() {
    let dev = device();
    let mut r = rng("moe_gate_up_act");
    let acts = [MoeGatedAct::SiluMul, MoeGatedAct::ClampedSwiglu { alpha: 1.702, limit: 1.5 }];
    for (ne, k) in ROUTINGS {
        for rows in ROWS {
            for skewed in [false, true] {
                for (hidden, inter) in widths(rows, ne, k) {
                    let routing = routing(ne, k);
                    let l = logits(&mut r, rows, ne, k, skewed);
                    let (_, _, perm) = cpu_route(&l, ne, routing);
                    let p = device_route(&dev, &l, rows, ne, routing);
                    let a = rows * k;
                    let x = rand_vec(&mut r, rows * hidden, 1.0);
                    let w1 = rand_vec(&mut r, ne * 2 * inter * hidden, 4.0 / (hidden as f32).sqrt());
                    let b1 = rand_vec(&mut r, ne * 2 * inter, 0.5);
                    let (xd, w1d, b1d) = (up(&dev, &x), up(&dev, &w1), up(&dev, &b1));
                    for act in acts {
                        for with_bias in [false, true] {
                            let what = format!(
                                "gate_up+act e={ne} k={k} rows={rows} skewed={skewed} {hidden}/{inter} {act:?} bias={with_bias}"
                            );
                            let bias = with_bias.then_some(&b1d);
                            let mut gate_up = poisoned(&dev, a * 2 * inter);
                            MoeGroupedGemvCall {
                                x: &xd,
                                rows: MoeRows::PerToken,
                                k,
                                w: &w1d,
                                bias,
                                n_experts: ne,
                                n: 2 * inter,
                                d: hidden,
                                offsets: &p.offsets,
                                order: &p.order,
                                assignments: a,
                                out: &mut gate_up,
                            }
                            .launch_with(&dev, MoeExpertKernel::Skinny)
                            .expect("skinny gate_up");
                            let mut unfused = poisoned(&dev, a * inter);
                            match act {
                                MoeGatedAct::SiluMul => {
                                    SiluMulCall { gate_up: &gate_up, rows: a, d: inter, out: &mut unfused }.launch(&dev)
                                }
                                MoeGatedAct::ClampedSwiglu { alpha, limit } => ClampedSwigluCall {
                                    gate_up: &gate_up,
                                    rows: a,
                                    d: inter,
                                    alpha,
                                    limit,
                                    out: &mut unfused,
                                }
                                .launch(&dev),
                            }
                            .expect("activation");
                            let mut fused = poisoned(&dev, a * inter);
                            MoeGateUpActCall {
                                x: &xd,
                                rows: MoeRows::PerToken,
                                k,
                                w: &w1d,
                                bias,
                                n_experts: ne,
                                inter,
                                d: hidden,
                                act,
                                offsets: &p.offsets,
                                order: &p.order,
                                assignments: a,
                                out: &mut fused,
                            }
                            .launch(&dev)
                            .expect("fused gate_up + activation");
                            let (fb, ub) = (bits(&dev, &fused, a * inter), bits(&dev, &unfused, a * inter));
                            if let Some(i) = (0..fb.len()).find(|&i| fb[i] != ub[i]) {
                                panic!("{what}: fused differs from unfused at {i}: {:#06x} vs {:#06x}", fb[i], ub[i]);
                            }
                            // The CPU: the product (rounded to bf16, as stored), then the activation.
                            let wv =
                                ExpertWeights { w: &w1, n: 2 * inter, d: hidden, bias: with_bias.then_some(&b1[..]) };
                            let mut h = vec![0f32; a * 2 * inter];
                            cpu::moe_grouped_linear(&x, MoeRows::PerToken, wv, &perm, k, &mut h).expect("cpu");
                            let h: Vec<f32> = h.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
                            let mut want = vec![0f32; a * inter];
                            match act {
                                MoeGatedAct::SiluMul => cpu::silu_mul(&h, &mut want, inter),
                                MoeGatedAct::ClampedSwiglu { alpha, limit } => {
                                    cpu::clamped_swiglu(&h, &mut want, inter, alpha, limit)
                                }
                            }
                            .expect("cpu activation");
                            check(&what, &down(&dev, &fused, a * inter), &want);
                        }
                    }
                }
            }
        }
    }
    // Refusals: a non-finite or non-positive limit, d not a multiple of 8, a short output.
    // 2 tokens of 8 inputs, 2 experts of 2 × 16 rows.
    let (xd, wd) = (up(&dev, &[0.5; 16]), up(&dev, &[0.5; 2 * 32 * 8]));
    let p = device_route(&dev, &[1.0, 0.0, 0.0, 1.0], 2, 2, routing(2, 1));
    for (act, d, out_len) in [
        (MoeGatedAct::ClampedSwiglu { alpha: 1.0, limit: 0.0 }, 8, 32),
        (MoeGatedAct::ClampedSwiglu { alpha: f32::NAN, limit: 7.0 }, 8, 32),
        (MoeGatedAct::SiluMul, 6, 32),
        (MoeGatedAct::SiluMul, 8, 31),
    ] {
        let mut out = poisoned(&dev, out_len);
        let call = MoeGateUpActCall {
            x: &xd,
            rows: MoeRows::PerToken,
            k: 1,
            w: &wd,
            bias: None,
            n_experts: 2,
            inter: 16,
            d,
            act,
            offsets: &p.offsets,
            order: &p.order,
            assignments: 2,
            out: &mut out,
        };
        assert!(call.launch(&dev).is_err(), "{act:?} d={d} out={out_len} accepted");
    }
}

/// Router logits on the CPU (`x · wᵀ + bias`, f32), redrawn from `x` until no row has two of
/// its k + 1 largest logits within 1e-4 of each other, so that the device's other summation
/// order (f32 rounding, ~1e-6) cannot swap a choice or its rank.
fn separated_logits(
    r: &mut StdRng,
    rows: usize,
    h: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    ne: usize,
    k: usize,
) -> (Vec<f32>, Vec<f32>) {
    for _ in 0..100 {
        let x = rand_vec(r, rows * h, 1.0);
        let mut l = vec![0f32; rows * ne];
        cpu::linear(&x, w, bias, rows, h, ne, &mut l).expect("cpu router");
        let separated = l.chunks(ne).all(|row| {
            let mut v = row.to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v[..(k + 1).min(ne)].windows(2).all(|p| p[0] - p[1] > 1e-4)
        });
        if separated {
            return (x, l);
        }
    }
    panic!("no well-separated router logits in 100 draws");
}

/// The router fused with routing and permutation ([`MoeRouterCall`]) against the CPU: logits
/// to 1e-5 (f32, summed in another order), ids, offsets, order and position exact, weights to
/// 1e-5; hidden 136 (a partial batch of 16-byte chunks), 256 and 2,048 (128 experts); with and
/// without the router bias. Each case launches twice on fresh poisoned outputs (the counter the
/// first launch's last CTA reset must give the same result again) and checks the counter is 0.
#[test]
fn gpu_moe_router_fused_matches_cpu() {
    let dev = device();
    let mut r = rng("moe_router_fused");
    for (ne, k) in ROUTINGS {
        for rows in [1, 3, MOE_ROUTER_MAX_ROWS] {
            for h in [136, 256, 2048] {
                if h == 2048 && ne != 128 {
                    continue;
                }
                for with_bias in [false, true] {
                    let routing = routing(ne, k);
                    let what = format!("router e={ne} k={k} rows={rows} h={h} bias={with_bias}");
                    let w = rand_vec(&mut r, ne * h, 1.0 / (h as f32).sqrt());
                    let b = rand_vec(&mut r, ne, 0.5);
                    let bias = with_bias.then_some(&b[..]);
                    let (x, l) = separated_logits(&mut r, rows, h, &w, bias, ne, k);
                    let (want_ids, want_w, perm) = cpu_route(&l, ne, routing);
                    let (xd, wd, bd) = (up(&dev, &x), up(&dev, &w), up(&dev, &b));
                    let n = rows * k;
                    let mut counter = dev.upload(&[0u32]).expect("counter");
                    for launch in 0..2 {
                        let logits = dev.upload(&vec![f32::NAN; rows * ne]).expect("logits");
                        let mut ids = dev.upload(&vec![-1i32; n]).expect("ids");
                        let mut wts = dev.upload(&vec![f32::NAN; n]).expect("weights");
                        let mut offsets = dev.upload(&vec![-1i32; ne + 1]).expect("offsets");
                        let mut order = dev.upload(&vec![-1i32; n]).expect("order");
                        let mut position = dev.upload(&vec![-1i32; n]).expect("position");
                        MoeRouterCall {
                            x: &xd,
                            h,
                            w: &wd,
                            bias: with_bias.then_some(&bd),
                            counter: &mut counter,
                            then: MoeRoutePermuteCall {
                                route: MoeRouteCall {
                                    logits: &logits,
                                    rows,
                                    n_experts: ne,
                                    routing,
                                    ids: &mut ids,
                                    weights: &mut wts,
                                },
                                offsets: &mut offsets,
                                order: &mut order,
                                position: &mut position,
                            },
                        }
                        .launch(&dev)
                        .expect("fused router");
                        let what = format!("{what} launch {launch}");
                        let gl: Vec<f32> = dev.download(&logits, rows * ne).expect("logits");
                        let e = common::rel_err(&gl, &l);
                        assert!(e < 1e-5, "{what}: logits rel err {e:.2e}");
                        let got = [&ids, &offsets, &order, &position];
                        check_route(&dev, &what, got, &wts, (&want_ids, &want_w, &perm));
                        assert_eq!(dev.download(&counter, 1).expect("counter"), vec![0u32], "{what}: counter left set");
                    }
                }
            }
        }
    }
    // Refusals before any launch: more rows than the kernel routes, a hidden width off 8.
    let ld = dev.alloc::<f32>(17 * 8).expect("logits");
    let (xd, wd) = (up(&dev, &vec![0.5; 17 * 16]), up(&dev, &vec![0.5; 8 * 16]));
    let (mut ids, mut w) = (dev.alloc::<i32>(34).expect("ids"), dev.alloc::<f32>(34).expect("w"));
    let (mut o, mut ord, mut pos) =
        (dev.alloc::<i32>(9).expect("o"), dev.alloc::<i32>(34).expect("ord"), dev.alloc::<i32>(34).expect("pos"));
    let mut counter = dev.upload(&[0u32]).expect("counter");
    for (rows, h) in [(17, 8), (2, 12)] {
        let call = MoeRouterCall {
            x: &xd,
            h,
            w: &wd,
            bias: None,
            counter: &mut counter,
            then: MoeRoutePermuteCall {
                route: MoeRouteCall {
                    logits: &ld,
                    rows,
                    n_experts: 8,
                    routing: routing(8, 2),
                    ids: &mut ids,
                    weights: &mut w,
                },
                offsets: &mut o,
                order: &mut ord,
                position: &mut pos,
            },
        };
        assert!(call.launch(&dev).is_err(), "rows {rows} / hidden {h} accepted");
    }
}

/// The down product with the un-permute fused ([`MoeDownUnpermuteCall`]) against the skinny
/// product followed by [`MoeUnpermuteCall`], bit for bit (the entries' outputs and the token
/// rows), and against the CPU (product rounded to bf16 as stored, then the weighted sum); with
/// and without a bias, uniform and skewed routing (with k = 1, every token to one expert, so a
/// tile's one active CTA may not be its last), rows up to 64. Each case launches twice on fresh
/// poisoned outputs and checks the tile counters are back at 0. Up to 16 rows it also runs the
/// residual form ([`MoeDownOut::Residual`]): the residual and the tiles' sums of squares bit for
/// bit against the unfused rows added on the host.
#[test]
fn gpu_moe_down_unpermute_is_bit_identical_to_unfused() {
    let dev = device();
    let mut r = rng("moe_down_unpermute");
    for (ne, k) in ROUTINGS {
        for rows in [1, 3, 16, 64] {
            for skewed in [false, true] {
                for (hidden, inter) in widths(rows, ne, k) {
                    let routing = routing(ne, k);
                    let l = logits(&mut r, rows, ne, k, skewed);
                    let (_, want_w, perm) = cpu_route(&l, ne, routing);
                    let p = device_route(&dev, &l, rows, ne, routing);
                    let a = rows * k;
                    let xp = rand_vec(&mut r, a * inter, 1.0);
                    let w2 = rand_vec(&mut r, ne * hidden * inter, 1.0 / (inter as f32).sqrt());
                    let b2 = rand_vec(&mut r, ne * hidden, 0.5);
                    let (xpd, w2d, b2d) = (up(&dev, &xp), up(&dev, &w2), up(&dev, &b2));
                    let tiles = moe_unpermute_counters(hidden);
                    let mut counters = dev.upload(&vec![0u32; tiles]).expect("counters");
                    for with_bias in [false, true] {
                        let what = format!(
                            "down+unpermute e={ne} k={k} rows={rows} skewed={skewed} {hidden}/{inter} bias={with_bias}"
                        );
                        let bias = with_bias.then_some(&b2d);
                        let mut y = poisoned(&dev, a * hidden);
                        MoeGroupedGemvCall {
                            x: &xpd,
                            rows: MoeRows::Permuted,
                            k,
                            w: &w2d,
                            bias,
                            n_experts: ne,
                            n: hidden,
                            d: inter,
                            offsets: &p.offsets,
                            order: &p.order,
                            assignments: a,
                            out: &mut y,
                        }
                        .launch_with(&dev, MoeExpertKernel::Skinny)
                        .expect("skinny down");
                        let mut unfused = poisoned(&dev, rows * hidden);
                        MoeUnpermuteCall {
                            expert_out: &y,
                            position: &p.position,
                            weights: &p.weights,
                            rows,
                            k,
                            d: hidden,
                            shared: None,
                            out: &mut unfused,
                        }
                        .launch(&dev)
                        .expect("un-permute");
                        let (yb, ub) = (bits(&dev, &y, a * hidden), bits(&dev, &unfused, rows * hidden));
                        for launch in 0..2 {
                            let mut fy = poisoned(&dev, a * hidden);
                            let mut fused = poisoned(&dev, rows * hidden);
                            MoeDownUnpermuteCall {
                                x: &xpd,
                                k,
                                w: &w2d,
                                bias,
                                n_experts: ne,
                                n: hidden,
                                d: inter,
                                offsets: &p.offsets,
                                order: &p.order,
                                position: &p.position,
                                weights: &p.weights,
                                assignments: a,
                                expert_out: &mut fy,
                                counters: &mut counters,
                                out: MoeDownOut::Rows(&mut fused),
                            }
                            .launch(&dev)
                            .expect("fused down + un-permute");
                            let what = format!("{what} launch {launch}");
                            let fyb = bits(&dev, &fy, a * hidden);
                            if let Some(i) = (0..yb.len()).find(|&i| fyb[i] != yb[i]) {
                                panic!("{what}: entry outputs differ at {i}: {:#06x} vs {:#06x}", fyb[i], yb[i]);
                            }
                            let fb = bits(&dev, &fused, rows * hidden);
                            if let Some(i) = (0..ub.len()).find(|&i| fb[i] != ub[i]) {
                                panic!("{what}: fused differs from unfused at {i}: {:#06x} vs {:#06x}", fb[i], ub[i]);
                            }
                            let left: Vec<u32> = dev.download(&counters, tiles).expect("counters");
                            assert!(left.iter().all(|&c| c == 0), "{what}: tile counters left set: {left:?}");
                        }
                        if rows <= MOE_UNPERMUTE_RESID_MAX_ROWS {
                            // The residual form: the same rows added to a random residual stream
                            // (bf16 rounded, then the f32 add), and each tile's sum of squares of
                            // the new residual over its 16 columns in column order, bit for bit.
                            let what = format!("{what} into the residual");
                            let res0: Vec<f32> = (0..rows * hidden).map(|_| r.random_range(-2.0f32..2.0)).collect();
                            let mut residual = dev.upload(&res0).expect("residual");
                            let mut stats = dev.upload(&vec![f32::NAN; rows * tiles]).expect("stats");
                            let mut fy = poisoned(&dev, a * hidden);
                            MoeDownUnpermuteCall {
                                x: &xpd,
                                k,
                                w: &w2d,
                                bias,
                                n_experts: ne,
                                n: hidden,
                                d: inter,
                                offsets: &p.offsets,
                                order: &p.order,
                                position: &p.position,
                                weights: &p.weights,
                                assignments: a,
                                expert_out: &mut fy,
                                counters: &mut counters,
                                out: MoeDownOut::Residual { residual: &mut residual, stats: &mut stats },
                            }
                            .launch(&dev)
                            .expect("fused down + un-permute into the residual");
                            let got: Vec<f32> = dev.download(&residual, rows * hidden).expect("residual");
                            for i in 0..rows * hidden {
                                let want = res0[i] + bf16::from_bits(ub[i]).to_f32();
                                assert_eq!(
                                    got[i].to_bits(),
                                    want.to_bits(),
                                    "{what}: residual {i}: {} vs {want}",
                                    got[i]
                                );
                            }
                            let got_stats: Vec<f32> = dev.download(&stats, rows * tiles).expect("stats");
                            for row in 0..rows {
                                for t in 0..tiles {
                                    let cols = t * 16..(t * 16 + 16).min(hidden);
                                    let want = cols
                                        .map(|c| got[row * hidden + c] * got[row * hidden + c])
                                        .fold(0f32, |s, q| s + q);
                                    let g = got_stats[row * tiles + t];
                                    assert_eq!(
                                        g.to_bits(),
                                        want.to_bits(),
                                        "{what}: stats row {row} tile {t}: {g} vs {want}"
                                    );
                                }
                            }
                            let left: Vec<u32> = dev.download(&counters, tiles).expect("counters");
                            assert!(left.iter().all(|&c| c == 0), "{what}: tile counters left set: {left:?}");
                        }
                        // The CPU: the product (rounded to bf16, as stored), then the weighted sum.
                        let wv = ExpertWeights { w: &w2, n: hidden, d: inter, bias: with_bias.then_some(&b2[..]) };
                        let mut ycpu = vec![0f32; a * hidden];
                        cpu::moe_grouped_linear(&xp, MoeRows::Permuted, wv, &perm, k, &mut ycpu).expect("cpu");
                        let ycpu: Vec<f32> = ycpu.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
                        let mut want = vec![0f32; rows * hidden];
                        cpu::moe_unpermute(&ycpu, hidden, &perm, &want_w, k, None, &mut want).expect("cpu un-permute");
                        check(&what, &down(&dev, &unfused, rows * hidden), &want);
                    }
                }
            }
        }
    }
}

/// Expert ids for `rows × k` assignments over `ne` experts: `uniform`; one expert taking 80 %
/// of them and the rest spread over the lower half of the experts (the upper half empty); or
/// every assignment to one expert.
fn skewed_ids(r: &mut StdRng, n: usize, ne: usize, mode: usize) -> Vec<u32> {
    let hot = r.random_range(0..ne) as u32;
    (0..n)
        .map(|_| match mode {
            0 => r.random_range(0..ne) as u32,
            1 if r.random_range(0..10) < 8 => hot,
            1 => r.random_range(0..ne / 2) as u32,
            _ => hot,
        })
        .collect()
}

/// The wide-tiled grouped GEMM ([`MoeExpertKernel::GemmWide`]) and the 64 × 64 one against
/// the CPU over skewed routings (uniform; one expert with 80 % of the entries and half the
/// experts empty; every entry on one expert), both row sources, with and without a bias,
/// output widths that are and are not multiples of the 128-column tile, inputs of 96 to 2,048
/// (multiples of the 32-input step); outputs poisoned. Also checks the automatic choice takes
/// the wide kernel from 64 entries an expert.
#[test]
fn gpu_moe_wide_gemm_matches_cpu_on_skewed_routings() {
    let dev = device();
    let mut r = rng("moe_wide_gemm");
    // (tokens, k, experts, n, d)
    let shapes = [(600, 4, 16, 320, 256), (300, 8, 32, 256, 96), (1100, 2, 8, 200, 160), (80, 8, 8, 1536, 2048)];
    for (rows, k, ne, n, d) in shapes {
        let a = rows * k;
        assert!(
            baton_kernels::cuda::moe_gemm_wide_preferred(a, ne, d),
            "{rows}×{k} over {ne} should take the wide GEMM"
        );
        for mode in 0..3 {
            let ids = skewed_ids(&mut r, a, ne, mode);
            let perm = cpu::moe_permute(&ids, ne).expect("cpu permute");
            let offsets = dev.upload(&as_i32(&perm.offsets)).expect("offsets");
            let order = dev.upload(&as_i32(&perm.order)).expect("order");
            let w = rand_vec(&mut r, ne * n * d, 1.0 / (d as f32).sqrt());
            let b = rand_vec(&mut r, ne * n, 0.5);
            let (wd, bd) = (up(&dev, &w), up(&dev, &b));
            for rows_src in [MoeRows::PerToken, MoeRows::Permuted] {
                let x_rows = if rows_src == MoeRows::PerToken { rows } else { a };
                let x = rand_vec(&mut r, x_rows * d, 1.0);
                let xd = up(&dev, &x);
                for with_bias in [false, true] {
                    let wv = ExpertWeights { w: &w, n, d, bias: with_bias.then_some(&b[..]) };
                    let mut want = vec![0f32; a * n];
                    cpu::moe_grouped_linear(&x, rows_src, wv, &perm, k, &mut want).expect("cpu");
                    for kernel in [MoeExpertKernel::GemmWide, MoeExpertKernel::Gemm, MoeExpertKernel::Auto] {
                        let what = format!(
                            "gemm {kernel:?} rows={rows} k={k} e={ne} n={n} d={d} skew={mode} {rows_src:?} bias={with_bias}"
                        );
                        let mut out = poisoned(&dev, a * n);
                        MoeGroupedGemvCall {
                            x: &xd,
                            rows: rows_src,
                            k,
                            w: &wd,
                            bias: with_bias.then_some(&bd),
                            n_experts: ne,
                            n,
                            d,
                            offsets: &offsets,
                            order: &order,
                            assignments: a,
                            out: &mut out,
                        }
                        .launch_with(&dev, kernel)
                        .expect("grouped GEMM");
                        check(&what, &down(&dev, &out, a * n), &want);
                    }
                }
            }
        }
    }
}
