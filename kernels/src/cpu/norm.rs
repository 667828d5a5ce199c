//! RMSNorm, alone and fused with the residual add that precedes it in every
//! transformer block: `residual += x; out = residual / rms(residual) * weight`.
//! Accumulation is in f64 so the CPU path is a trustworthy reference.

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

#[cfg(test)]
mod tests {
    use super::*;

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
