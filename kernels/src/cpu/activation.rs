//! Gated MLP activations over rows of `gate_up = [gate (d) | up (d)]` (the gate and up
//! projections fused into one GEMM): SiLU·mul (SwiGLU: Llama, Qwen, Mistral, Phi) and
//! GELU-tanh·mul (GeGLU with the tanh approximation, `gelu_pytorch_tanh`: Gemma 1/2/3).

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

/// The tanh approximation of GELU (PyTorch's `gelu(x, approximate="tanh")`), in f64.
pub fn gelu_tanh(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `out[r, i] = gelu_tanh(gate[r, i]) * up[r, i]`; `out` is `rows × d`, `gate_up` is `rows × 2d`.
pub fn gelu_tanh_mul(gate_up: &[f32], out: &mut [f32], d: usize) -> Result<(), KernelError> {
    check("gelu_tanh_mul", d > 0 && gate_up.len() == out.len() * 2 && out.len().is_multiple_of(d), || {
        format!("gate_up has {} values, out {} values, d = {d}", gate_up.len(), out.len())
    })?;
    out.par_chunks_mut(d).zip(gate_up.par_chunks(2 * d)).for_each(|(o, gu)| {
        let (g, u) = gu.split_at(d);
        for i in 0..d {
            o[i] = (gelu_tanh(g[i] as f64) * u[i] as f64) as f32;
        }
    });
    Ok(())
}

/// gpt-oss's expert activation: rows of `gate_up` are `d` interleaved `[gate, up]` pairs
/// (`gate_up[r, 2i]` is gate `i`); `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
/// `out[r, i] = (u + 1) · g · σ(alpha · g)`. `out` is `rows × d`.
pub fn clamped_swiglu(gate_up: &[f32], out: &mut [f32], d: usize, alpha: f32, limit: f32) -> Result<(), KernelError> {
    check("clamped_swiglu", d > 0 && gate_up.len() == out.len() * 2 && out.len().is_multiple_of(d), || {
        format!("gate_up has {} values, out {} values, d = {d}", gate_up.len(), out.len())
    })?;
    let (a, lim) = (alpha as f64, limit as f64);
    out.par_iter_mut().zip(gate_up.par_chunks(2)).for_each(|(o, gu)| {
        let g = (gu[0] as f64).min(lim);
        let u = (gu[1] as f64).clamp(-lim, lim);
        *o = ((u + 1.0) * g / (1.0 + (-a * g).exp())) as f32;
    });
    Ok(())
}

/// `x = cap · tanh(x / cap)` in place: logit soft-capping (Gemma 2's attention scores and
/// final logits), computed in f64.
pub fn softcap(x: &mut [f32], cap: f32) -> Result<(), KernelError> {
    check("softcap", cap.is_finite() && cap > 0.0, || format!("cap {cap} is not > 0"))?;
    let c = cap as f64;
    x.par_iter_mut().for_each(|v| *v = (c * (*v as f64 / c).tanh()) as f32);
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

    #[test]
    fn gelu_tanh_matches_known_values() {
        // PyTorch: gelu(tensor([-3., -1., 0., 0.5, 1., 3.]), approximate="tanh").
        let want = [-0.003_637_392, -0.158_808_0, 0.0, 0.345_714_2, 0.841_191_9, 2.996_362_6];
        for (x, w) in [-3.0, -1.0, 0.0, 0.5, 1.0, 3.0].iter().zip(want) {
            assert!((gelu_tanh(*x) - w).abs() < 1e-6, "gelu_tanh({x}) = {} want {w}", gelu_tanh(*x));
        }
        let gu = [1.0f32, -2.0, 0.5, 3.0, 4.0, -1.0];
        let mut out = [f32::NAN; 3];
        gelu_tanh_mul(&gu, &mut out, 3).unwrap();
        for i in 0..3 {
            assert!((out[i] as f64 - gelu_tanh(gu[i] as f64) * gu[3 + i] as f64).abs() < 1e-6);
        }
        assert!(gelu_tanh_mul(&gu, &mut [0.0; 2], 3).is_err());
    }

    #[test]
    fn softcap_bends_large_values_and_keeps_small_ones() {
        let mut x = [0.0f32, 0.01, -0.01, 3.0, -100.0];
        softcap(&mut x, 2.0).unwrap();
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 0.01).abs() < 1e-6 && (x[2] + 0.01).abs() < 1e-6, "near-linear at 0");
        assert!((x[3] as f64 - 2.0 * 1.5f64.tanh()).abs() < 1e-6);
        assert!((x[4] + 2.0).abs() < 1e-6, "saturates at -cap");
        assert!(softcap(&mut x, 0.0).is_err());
    }

    #[test]
    fn clamped_swiglu_clamps_and_interleaves() {
        // Pairs (gate, up): (1, 2), (10, -9), (-3, 0.5).
        let gu = [1.0f32, 2.0, 10.0, -9.0, -3.0, 0.5];
        let mut out = [f32::NAN; 3];
        clamped_swiglu(&gu, &mut out, 3, 1.702, 7.0).unwrap();
        let f = |g: f64, u: f64| (u + 1.0) * g / (1.0 + (-(1.702f32 as f64) * g).exp());
        for (o, w) in out.iter().zip([f(1.0, 2.0), f(7.0, -7.0), f(-3.0, 0.5)]) {
            assert!((*o as f64 - w).abs() < 1e-6 * w.abs().max(1.0), "{o} vs {w}");
        }
        assert!(clamped_swiglu(&gu, &mut [0.0; 2], 3, 1.702, 7.0).is_err());
    }
}
