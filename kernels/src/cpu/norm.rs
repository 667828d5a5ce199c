//! RMSNorm, alone and fused with the residual add that precedes it in every
//! transformer block: `residual += x; out = residual / rms(residual) * weight`.
//! Accumulation is in f64 so the CPU path is a trustworthy reference.
//!
//! [`head_rms_norm`] is the per-head q/k norm of Qwen3 and Gemma 3 (RMSNorm over each head's
//! `head_dim` values, one weight vector shared by all heads, applied before RoPE); Gemma's norms
//! scale by `1 + w` ([`NormWeight::OnePlus`]), everyone else's by `w`.

use super::{KernelError, check};
use rayon::prelude::*;

fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = 1.0 / ((ss / x.len() as f64) + eps as f64).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = ((v as f64) * inv) as f32 * g;
    }
}

/// `out = x / rms(x) * weight`, row by row (`x` is `rows × weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
    let d = weight.len();
    check("rms_norm", d > 0 && x.len().is_multiple_of(d) && out.len() == x.len(), || {
        format!("x {} values, weight {d}, out {}", x.len(), out.len())
    })?;
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, r)| norm_row(r, weight, eps, o));
    Ok(())
}

/// `residual += x; out = rms_norm(residual)`, row by row.
pub fn add_rms_norm(
    residual: &mut [f32],
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let d = weight.len();
    check(
        "add_rms_norm",
        d > 0 && x.len().is_multiple_of(d) && out.len() == x.len() && residual.len() == x.len(),
        || format!("residual {}, x {}, weight {d}, out {}", residual.len(), x.len(), out.len()),
    )?;
    out.par_chunks_mut(d).zip(residual.par_chunks_mut(d)).zip(x.par_chunks(d)).for_each(|((o, r), xr)| {
        for (a, &b) in r.iter_mut().zip(xr) {
            *a += b;
        }
        norm_row(r, weight, eps, o);
    });
    Ok(())
}

/// How an RMSNorm applies its weight vector `w` to the normalized `x̂`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormWeight {
    /// `x̂ · w` (Llama, Qwen, Mistral, Phi...).
    #[default]
    Plain,
    /// `x̂ · (1 + w)` (Gemma 1/2/3: their norm weights are stored as offsets from one).
    OnePlus,
}

impl NormWeight {
    /// What the weight is added to before scaling: 0 or 1 (what the GPU kernels take).
    pub fn offset(self) -> f32 {
        match self {
            Self::Plain => 0.0,
            Self::OnePlus => 1.0,
        }
    }
}

/// RMSNorm of every `head_dim`-wide head of `x` in place (`x` is `rows × heads × head_dim`,
/// `weight` is `head_dim`): the q/k norm of Qwen3 and Gemma 3, before RoPE.
pub fn head_rms_norm(x: &mut [f32], weight: &[f32], eps: f32, style: NormWeight) -> Result<(), KernelError> {
    let hd = weight.len();
    check("head_rms_norm", hd > 0 && x.len().is_multiple_of(hd), || {
        format!("x has {} values, not a multiple of head_dim {hd}", x.len())
    })?;
    let w: Vec<f32> = weight.iter().map(|&g| g + style.offset()).collect();
    x.par_chunks_mut(hd).for_each(|head| {
        let src = head.to_vec();
        norm_row(&src, &w, eps, head);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_norm_normalizes_each_head_with_plain_or_one_plus_weights() {
        // Two rows of three heads of 4: every head normalized on its own.
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * (1 + i / 4) as f32).collect();
        let w = [0.5f32, -1.0, 2.0, 0.25];
        let mut plain = x.clone();
        head_rms_norm(&mut plain, &w, 1e-6, NormWeight::Plain).unwrap();
        let mut gemma = x.clone();
        head_rms_norm(&mut gemma, &w, 1e-6, NormWeight::OnePlus).unwrap();
        for (h, src) in x.chunks(4).enumerate() {
            let rms = (src.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0 + 1e-6).sqrt();
            for i in 0..4 {
                let xn = src[i] as f64 / rms;
                assert!((plain[h * 4 + i] as f64 - xn * w[i] as f64).abs() < 1e-5, "head {h} elem {i}");
                assert!((gemma[h * 4 + i] as f64 - xn * (1.0 + w[i] as f64)).abs() < 1e-5, "head {h} elem {i}");
            }
        }
        assert!(head_rms_norm(&mut [0.0; 6], &w, 1e-6, NormWeight::Plain).is_err());
    }

    #[test]
    fn fused_equals_add_then_norm() {
        let x: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut res: Vec<f32> = (0..8).map(|i| (i as f32 * 1.3).cos()).collect();
        let w: Vec<f32> = (0..4).map(|i| 1.0 + i as f32 * 0.1).collect();
        let sum: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
        let mut want = vec![f32::NAN; 8];
        rms_norm(&sum, &w, 1e-5, &mut want).unwrap();
        let mut got = vec![f32::NAN; 8];
        add_rms_norm(&mut res, &x, &w, 1e-5, &mut got).unwrap();
        assert_eq!(res, sum);
        assert_eq!(got, want);
        // Row 0 by hand.
        let ms: f32 = sum[..4].iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((want[1] - sum[1] / (ms + 1e-5).sqrt() * w[1]).abs() < 1e-5);
    }
}
