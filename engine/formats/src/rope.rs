//! RoPE parameters a model config carries ([`RopeScaling`], [`RopeParameters`], [`LongRope`])
//! and llama.cpp's per-frequency divisors for Llama 3 scaling ([`llama3_rope_divisors`]).
//! Parsed from both transformers generations in `hf_options.rs`, from GGUF metadata in
//! `gguf::model`; re-exported by `config`.

/// RoPE frequency scaling schemes Baton supports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (`rope_type: linear`).
    Linear {
        /// Position divisor.
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling (`rope_type: llama3`).
    Llama3 {
        /// Scale applied to low frequencies.
        factor: f32,
        /// Wavelength boundary (as a divisor of the original context) for low frequencies.
        low_freq_factor: f32,
        /// Wavelength boundary for high frequencies.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
    /// YaRN (`rope_type: yarn`: gpt-oss, Qwen with long contexts): frequencies blended
    /// between the plain ones and `1 / factor` of them over the `beta_fast`..`beta_slow`
    /// correction range, cos/sin scaled by an attention factor.
    Yarn {
        /// Context extension factor.
        factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
        /// Rotations at the high-frequency end of the ramp (default 32).
        beta_fast: f32,
        /// Rotations at the low-frequency end of the ramp (default 1).
        beta_slow: f32,
        /// Round the ramp's ends outwards to whole dims (default true; gpt-oss: false).
        truncate: bool,
        /// The scale of cos and sin when the config fixes it (`attention_factor`, or the
        /// `mscale` / `mscale_all_dim` ratio); `None`: `0.1 · ln(factor) + 1`.
        attention_factor: Option<f32>,
    },
}

/// Rotary parameters of one kind of layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParameters {
    /// RoPE base.
    pub theta: f32,
    /// Frequency scaling, if any.
    pub scaling: Option<RopeScaling>,
}

/// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini: `rope_type` `longrope`, legacy `su`): every
/// rotary frequency `i` divided by `short_factor[i]` or `long_factor[i]`, and cos/sin scaled
/// by `attention_factor`.
///
/// Which list applies is fixed for a whole engine, not per forward pass: transformers picks
/// per pass (`long_factor` once a pass reaches past `original_max_position_embeddings`),
/// which rotates one sequence's cached keys with both lists once it grows past that length
/// and makes a chunked prefill differ from a whole one. Baton uses `long_factor` iff the
/// served context (`--max-model-len`, [`ModelConfig::with_served_context`]) exceeds
/// `original_max_position_embeddings`: identical to transformers for every sequence that
/// stays on one side of it (all of them when the served context does not cross it).
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    /// Divisors of the frequencies for contexts up to the original length (`rotary_dim / 2`).
    pub short_factor: Vec<f32>,
    /// Divisors for longer contexts (`rotary_dim / 2`).
    pub long_factor: Vec<f32>,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Scale of cos and sin: the config's `attention_factor`, else `sqrt(1 + ln(s) / ln(o))`
    /// with `s = max_position_embeddings / o` (1 when `s <= 1`).
    pub attention_factor: f32,
    /// Whether `long_factor` applies (see the type's doc).
    pub use_long: bool,
}

impl LongRope {
    /// The factor list in use.
    pub fn factors(&self) -> &[f32] {
        if self.use_long { &self.long_factor } else { &self.short_factor }
    }
}

/// llama.cpp's per-frequency RoPE divisors for Llama 3 scaling (`rope_freqs.weight`): the
/// scaled inverse frequency of pair `i` is `theta^(-2i/head_dim) / divisors[i]`. Other
/// scalings give all-ones.
pub fn llama3_rope_divisors(theta: f32, head_dim: usize, scaling: &RopeScaling) -> Vec<f32> {
    let half = head_dim / 2;
    let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } = *scaling
    else {
        return vec![1.0; half];
    };
    let orig = original_max_position_embeddings as f64;
    let (factor, low, high) = (f64::from(factor), f64::from(low_freq_factor), f64::from(high_freq_factor));
    let low_wavelen = orig / low;
    let high_wavelen = orig / high;
    (0..half)
        .map(|i| {
            let freq = f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let divisor = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            divisor as f32
        })
        .collect()
}
