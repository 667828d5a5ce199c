//! Rotary position embeddings in the Hugging Face "rotate half" layout: within a
//! head, element `i` pairs with element `i + head_dim/2`. The frequency table is
//! computed once per model with the configured scaling (none, linear, Llama 3).
//! Angles are computed in f64 so that long positions stay accurate.

use super::{KernelError, check};
use rayon::prelude::*;

/// How RoPE frequencies are rescaled for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScalingKind {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Interpolation factor.
        factor: f32,
    },
    /// Llama 3.1's piecewise scaling of low frequencies.
    Llama3 {
        /// Scale applied to the lowest frequencies.
        factor: f32,
        /// Wavelength band edges, as fractions of the original context.
        low_freq_factor: f32,
        /// See `low_freq_factor`.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

/// Inverse frequencies of one model's rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    inv_freq: Vec<f64>,
    head_dim: usize,
}

impl RopeTable {
    /// Builds the table for `head_dim` (even) and base `theta`.
    pub fn new(head_dim: usize, theta: f32, scaling: RopeScalingKind) -> Result<Self, KernelError> {
        check("rope", head_dim >= 2 && head_dim.is_multiple_of(2) && theta > 0.0, || {
            format!("head_dim {head_dim} must be even and theta {theta} positive")
        })?;
        let half = head_dim / 2;
        let mut inv_freq: Vec<f64> =
            (0..half).map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64)).collect();
        match scaling {
            RopeScalingKind::None => {}
            RopeScalingKind::Linear { factor } => {
                check("rope", factor > 0.0, || format!("linear factor {factor} must be positive"))?;
                inv_freq.iter_mut().for_each(|f| *f /= factor as f64);
            }
            RopeScalingKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                check("rope", factor > 0.0 && high_freq_factor > low_freq_factor, || {
                    format!(
                        "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor (got {factor}, {low_freq_factor}, {high_freq_factor})"
                    )
                })?;
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor as f64;
                let high_wavelen = old / high_freq_factor as f64;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen < high_wavelen {
                        continue;
                    }
                    if wavelen > low_wavelen {
                        *f /= factor as f64;
                    } else {
                        let smooth = (old / wavelen - low_freq_factor as f64)
                            / (high_freq_factor as f64 - low_freq_factor as f64);
                        *f = (1.0 - smooth) * *f / factor as f64 + smooth * *f;
                    }
                }
            }
        }
        Ok(Self { inv_freq, head_dim })
    }

    /// The `head_dim / 2` inverse frequencies, scaling applied (what the GPU kernels upload).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Head dimension the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotates `x` (`positions.len() × n_heads × head_dim`) in place; row `t` is at `positions[t]`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[usize]) -> Result<(), KernelError> {
        let hd = self.head_dim;
        check("rope", x.len() == positions.len() * n_heads * hd, || {
            format!("x has {} values, want {} tokens × {n_heads} heads × {hd}", x.len(), positions.len())
        })?;
        let half = hd / 2;
        x.par_chunks_mut(n_heads * hd).zip(positions.par_iter()).for_each(|(row, &pos)| {
            let (sin, cos): (Vec<f64>, Vec<f64>) = self.inv_freq.iter().map(|f| (pos as f64 * f).sin_cos()).unzip();
            for head in row.chunks_mut(hd) {
                for i in 0..half {
                    let a = head[i] as f64;
                    let b = head[i + half] as f64;
                    head[i] = (a * cos[i] - b * sin[i]) as f32;
                    head[i + half] = (b * cos[i] + a * sin[i]) as f32;
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_relative_position() {
        let t = RopeTable::new(8, 10000.0, RopeScalingKind::None).unwrap();
        let q0: Vec<f32> = (0..8).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
        let k0: Vec<f32> = (0..8).map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.2).collect();
        let dot_at = |pq: usize, pk: usize| {
            let mut q = q0.clone();
            let mut k = k0.clone();
            t.apply(&mut q, 1, &[pq]).unwrap();
            t.apply(&mut k, 1, &[pk]).unwrap();
            q.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>()
        };
        // q·k depends only on the distance.
        assert!((dot_at(5, 2) - dot_at(103, 100)).abs() < 1e-4);
        let mut q = q0.clone();
        t.apply(&mut q, 1, &[37]).unwrap();
        let n0: f32 = q0.iter().map(|v| v * v).sum();
        let n1: f32 = q.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5);
        assert!(q != q0);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = RopeTable::new(128, 500000.0, RopeScalingKind::None).unwrap();
        let s = RopeTable::new(
            128,
            500000.0,
            RopeScalingKind::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        )
        .unwrap();
        assert_eq!(plain.inv_freq[0], s.inv_freq[0]);
        assert!((plain.inv_freq[63] / 8.0 - s.inv_freq[63]).abs() < 1e-15);
        let lin = RopeTable::new(128, 10000.0, RopeScalingKind::Linear { factor: 4.0 }).unwrap();
        let p2 = RopeTable::new(128, 10000.0, RopeScalingKind::None).unwrap();
        assert!((p2.inv_freq[10] / 4.0 - lin.inv_freq[10]).abs() < 1e-15);
        assert!(RopeTable::new(7, 10000.0, RopeScalingKind::None).is_err());
    }
}
