//! SiLU·mul, the SwiGLU gate: `out[i] = silu(gate[i]) * up[i]` where each row of
//! `gate_up` is `[gate (d) | up (d)]` (the gate and up projections fused into one GEMM).

use super::{KernelError, check};
use rayon::prelude::*;

/// `out` is `rows × d`; `gate_up` is `rows × 2d`.
pub fn silu_mul(gate_up: &[f32], out: &mut [f32], d: usize) -> Result<(), KernelError> {
    check("silu_mul", d > 0 && gate_up.len() == out.len() * 2 && out.len().is_multiple_of(d), || {
        format!("gate_up has {} values, out {} values, d = {d}", gate_up.len(), out.len())
    })?;
    out.par_chunks_mut(d).zip(gate_up.par_chunks(2 * d)).for_each(|(o, gu)| {
        let (g, u) = gu.split_at(d);
        for i in 0..d {
            let x = g[i];
            o[i] = x / (1.0 + (-x).exp()) * u[i];
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_definition() {
        let gu = [1.0f32, -2.0, 0.5, 3.0, 4.0, -1.0];
        let mut out = [f32::NAN; 3];
        silu_mul(&gu, &mut out, 3).unwrap();
        for i in 0..3 {
            let g = gu[i] as f64;
            let want = g / (1.0 + (-g).exp()) * gu[3 + i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-6);
        }
        assert!(silu_mul(&gu, &mut [0.0; 2], 3).is_err());
    }
}
