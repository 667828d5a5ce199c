//! Rotary position embeddings in the Hugging Face "rotate half" layout: within a
//! head, element `i` pairs with element `i + head_dim/2`. The frequency table is
//! computed once per model with the configured scaling (none, linear, Llama 3, YaRN), or
//! from per-frequency factors (LongRoPE's `short_factor` / `long_factor`, see
//! [`RopeTable::with_factors`]). Angles are computed in f64 so that long positions stay
//! accurate.
//!
//! YaRN and LongRoPE also scale cos and sin by an *attention factor* (transformers'
//! `attention_scaling`). [`RopeTable::apply`] / [`RopeTable::apply_partial`] and the GPU
//! kernel (`RopeExtras::attention_factor`) apply it there, as transformers does: with a
//! partial rotation only the rotated dims scale, so folding it into the softmax scale instead
//! would be wrong.

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
    /// YaRN (gpt-oss, Qwen with `rope_type: "yarn"`): frequencies blended between the plain
    /// ones (high frequencies) and `1 / factor` of them (low frequencies) by a linear ramp over
    /// the correction range of `beta_fast` / `beta_slow` rotations; attention factor
    /// `0.1 · ln(factor) + 1` unless given.
    Yarn {
        /// Context extension factor.
        factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
        /// Rotations at the high-frequency end of the ramp (transformers' default 32).
        beta_fast: f32,
        /// Rotations at the low-frequency end of the ramp (default 1).
        beta_slow: f32,
        /// Round the ramp's ends outwards to whole dimensions (transformers' default true;
        /// gpt-oss sets false).
        truncate: bool,
        /// The config's `attention_factor`, when it gives one.
        attention_factor: Option<f32>,
    },
}

/// Inverse frequencies of one model's rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    inv_freq: Vec<f64>,
    head_dim: usize,
    attention_factor: f32,
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
        let mut attention_factor = 1.0;
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
            RopeScalingKind::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor: given,
            } => {
                check("rope", factor > 0.0 && beta_fast > 0.0 && beta_slow > 0.0, || {
                    format!("yarn needs factor, beta_fast and beta_slow > 0 (got {factor}, {beta_fast}, {beta_slow})")
                })?;
                check("rope", original_max_position_embeddings > 0, || {
                    "yarn needs original_max_position_embeddings".into()
                })?;
                let (dim, base) = (head_dim as f64, theta as f64);
                let orig = original_max_position_embeddings as f64;
                // The dimension whose wavelength makes `rotations` turns over the original context.
                let correction_dim =
                    |rotations: f64| dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (correction_dim(beta_fast as f64), correction_dim(beta_slow as f64));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001; // transformers' guard against a zero-width ramp
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    // ramp 0: extrapolate (keep the frequency); 1: interpolate (divide by factor).
                    *f = *f / factor as f64 * ramp + *f * (1.0 - ramp);
                }
                attention_factor = given.unwrap_or(if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 });
            }
        }
        Ok(Self { inv_freq, head_dim, attention_factor })
    }

    /// A table whose frequency `i` is divided by `factors[i]` (`head_dim / 2` of them):
    /// LongRoPE (Phi-3/3.5/4-mini) with its `short_factor` or `long_factor` list, and the
    /// attention factor the model uses with it ([`RopeTable::longrope_attention_factor`]).
    /// Which list applies is the model's choice (transformers switches to `long_factor` for a
    /// forward pass longer than `original_max_position_embeddings`).
    pub fn with_factors(
        head_dim: usize,
        theta: f32,
        factors: &[f32],
        attention_factor: f32,
    ) -> Result<Self, KernelError> {
        let mut t = Self::new(head_dim, theta, RopeScalingKind::None)?;
        check("rope", factors.len() == head_dim / 2 && factors.iter().all(|f| f.is_finite() && *f > 0.0), || {
            format!("{} rope factors for head_dim {head_dim} (want {}, all > 0)", factors.len(), head_dim / 2)
        })?;
        check("rope", attention_factor.is_finite() && attention_factor > 0.0, || {
            format!("attention factor {attention_factor}")
        })?;
        t.inv_freq.iter_mut().zip(factors).for_each(|(f, &s)| *f /= s as f64);
        t.attention_factor = attention_factor;
        Ok(t)
    }

    /// LongRoPE's default attention factor: `sqrt(1 + ln(factor) / ln(original))` with
    /// `factor = max_position_embeddings / original_max_position_embeddings`, 1 when the
    /// context is not extended.
    pub fn longrope_attention_factor(max_position_embeddings: usize, original_max_position_embeddings: usize) -> f32 {
        let factor = max_position_embeddings as f64 / original_max_position_embeddings.max(1) as f64;
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original_max_position_embeddings as f64).ln()).sqrt() as f32
        }
    }

    /// The factor YaRN and LongRoPE put on cos and sin (1 otherwise). [`RopeTable::apply`]
    /// and [`RopeTable::apply_partial`] multiply by it, as transformers does, so only the
    /// rotated dims of q and k scale (with a partial rotation the others do not).
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// The `head_dim / 2` inverse frequencies, scaling applied (what the GPU kernels upload).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Head dimension the table was built for (the rotary dims, for a partial rotation).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotates `x` (`positions.len() × n_heads × head_dim`) in place; row `t` is at `positions[t]`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[usize]) -> Result<(), KernelError> {
        self.apply_partial(x, n_heads, self.head_dim, positions)
    }

    /// Partial rotary embeddings (Phi-4-mini's `partial_rotary_factor`): heads of `head_dim`
    /// values of which the first [`RopeTable::head_dim`] (the table's, the rotary dims) rotate
    /// as in [`RopeTable::apply`] and the rest pass through.
    pub fn apply_partial(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        positions: &[usize],
    ) -> Result<(), KernelError> {
        let rot = self.head_dim;
        check("rope", head_dim >= rot && x.len() == positions.len() * n_heads * head_dim, || {
            format!(
                "x has {} values, want {} tokens × {n_heads} heads × {head_dim} (rotary dims {rot})",
                x.len(),
                positions.len()
            )
        })?;
        let half = rot / 2;
        // YaRN's / LongRoPE's attention factor scales cos and sin: the rotated dims only.
        let af = f64::from(self.attention_factor);
        x.par_chunks_mut(n_heads * head_dim).zip(positions.par_iter()).for_each(|(row, &pos)| {
            let (sin, cos): (Vec<f64>, Vec<f64>) =
                self.inv_freq.iter().map(|f| (pos as f64 * f).sin_cos()).map(|(s, c)| (s * af, c * af)).unzip();
            for head in row.chunks_mut(head_dim) {
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
    fn partial_rotation_rotates_the_first_dims_only() {
        // head_dim 8, rotary dims 4 (partial_rotary_factor 0.5).
        let t = RopeTable::new(4, 10000.0, RopeScalingKind::None).unwrap();
        let x0: Vec<f32> = (0..16).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut x = x0.clone();
        t.apply_partial(&mut x, 2, 8, &[9]).unwrap();
        for head in 0..2 {
            let (h0, h) = (&x0[head * 8..head * 8 + 8], &x[head * 8..head * 8 + 8]);
            let mut want = h0[..4].to_vec();
            t.apply(&mut want, 1, &[9]).unwrap();
            assert_eq!(&h[..4], &want[..], "head {head}: the rotary dims rotate as a 4-dim head");
            assert_eq!(&h[4..], &h0[4..], "head {head}: the rest passes through");
        }
        assert!(t.apply_partial(&mut x, 2, 3, &[9]).is_err());
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
        assert_eq!(plain.attention_factor(), 1.0);
    }

    /// Against transformers 5.23's `_compute_yarn_parameters` (float32) for gpt-oss's rope
    /// (head_dim 64, theta 150,000, factor 32, original 4,096, beta 32/1), with and without
    /// truncation.
    #[test]
    fn yarn_matches_transformers() {
        let yarn = |truncate| RopeScalingKind::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate,
            attention_factor: None,
        };
        let idx = [0usize, 5, 10, 15, 20, 25, 31];
        let want_false = [
            1.0,
            0.155_322_983_860_969_54,
            0.019_334_999_844_431_877,
            0.001_052_602_194_249_63,
            1.818_833_698_052_913e-5,
            2.825_066_758_305_183_6e-6,
            3.023_511_396_804_679e-7,
        ];
        let want_true = [
            1.0,
            0.155_322_983_860_969_54,
            0.019_450_966_268_777_847,
            0.001_206_130_953_505_635_3,
            1.818_833_698_052_913e-5,
            2.825_066_758_305_183_6e-6,
            3.023_511_396_804_679e-7,
        ];
        for (truncate, want) in [(false, want_false), (true, want_true)] {
            let t = RopeTable::new(64, 150_000.0, yarn(truncate)).unwrap();
            for (&i, w) in idx.iter().zip(want) {
                let rel = (t.inv_freq[i] - w).abs() / w;
                assert!(rel < 1e-5, "truncate {truncate} freq {i}: {} vs {w}", t.inv_freq[i]);
            }
            assert!((t.attention_factor() as f64 - 1.346_573_590_279_972_7).abs() < 1e-6);
        }
        let given = RopeScalingKind::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32_768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: Some(0.5),
        };
        assert_eq!(RopeTable::new(128, 1e6, given).unwrap().attention_factor(), 0.5);
    }

    /// Against transformers' `_compute_longrope_parameters` (Phi-3 config: head_dim 16, theta
    /// 10,000, max 144 / original 36, long factors 2..9).
    #[test]
    fn longrope_factors_match_transformers() {
        let long: Vec<f32> = (0..8).map(|i| 2.0 + i as f32).collect();
        let att = RopeTable::longrope_attention_factor(144, 36);
        assert!((att as f64 - 1.177_647_148_866_986_2).abs() < 1e-6);
        let t = RopeTable::with_factors(16, 10_000.0, &long, att).unwrap();
        let want = [
            0.5,
            0.105_409_249_663_352_97,
            0.025_000_000_372_529_03,
            0.006_324_555_724_859_238,
            0.001_666_666_707_023_978_2,
            0.000_451_753_963_716_328_14,
            0.000_125_000_005_937_181_4,
            3.513_641_786_412_336e-5,
        ];
        for (i, w) in want.iter().enumerate() {
            assert!((t.inv_freq[i] - w).abs() / w < 1e-6, "freq {i}: {} vs {w}", t.inv_freq[i]);
        }
        assert_eq!(t.attention_factor(), att);
        assert!(RopeTable::with_factors(16, 10_000.0, &long[..7], att).is_err());
        assert_eq!(RopeTable::longrope_attention_factor(4096, 4096), 1.0);
    }
}
