//! The qkv projection of a decode step with the norm on its loads and RoPE + the KV write in
//! its epilogue ([`NormRopeCall`], gemv.cu's `norm_rope` kernels): one launch where a layer had
//! the norm-input product ([`NormLinearCall`](super::NormLinearCall)) and then
//! [`RopeKvCall`](super::RopeKvCall) with `RopeInput::Fused`.
//!
//! [`RopeOut`] (where the epilogue writes, and its checks) is shared with the FP8-weight product
//! that takes the same epilogue ([`Fp8RopeGemvCall`](super::Fp8RopeGemvCall)).
//!
//! Invariants: the rotated q, and the k and v written to the cache, are bit for bit what the
//! two-launch route stores (the same bf16 rounding of the product, the same f64 angle and
//! rotation formula, the same `kv_put`, and a qkv bias added as `BiasAddCall` adds it to the
//! stored rows); the qkv rows themselves are never stored. Only the plain case is taken: full
//! rotation (no partial rotary), no q/k norm; `head_dim`
//! a multiple of 16 (a CTA holds 8 rotation pairs of one head). Every check is made before
//! anything is enqueued.

use super::gemv::{GEMV_ROWS_PER_CTA, GemvEpilogue, gemv_default};
use super::launch::{Args, cfg, int, need, shape_check};
use super::linear::gemv_function;
use super::norm_linear::{NormInput, gemv_shape_ok};
use super::{CudaDevice, CudaError, CudaSlice, KvGeometry, KvWriteMeta};
use half::bf16;

/// Whether [`NormRopeCall`] takes a head of `head_dim` values: a multiple of 16 up to 256.
pub fn norm_rope_supports(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && (16..=256).contains(&head_dim)
}

/// The layer's cache as [`NormRopeCall`] writes it.
pub enum RopeCache<'a> {
    /// bf16 K and V (`geo.layer_len()` each).
    Bf16 {
        /// The layer's K cache.
        k: &'a mut CudaSlice<bf16>,
        /// The layer's V cache.
        v: &'a mut CudaSlice<bf16>,
    },
    /// E4M3 codes of `(k - k_shift) / k_scale` and `v / v_scale` (one byte an element).
    Fp8 {
        /// The layer's K cache.
        k: &'a mut CudaSlice<u8>,
        /// The layer's V cache.
        v: &'a mut CudaSlice<u8>,
        /// What a key is divided by before rounding (finite, positive).
        k_scale: f32,
        /// What a value is divided by before rounding (finite, positive).
        v_scale: f32,
        /// Subtracted from each key first, `n_kv_heads × head_dim` values (the layer's
        /// smoothing; see `crate::cpu::Fp8KvLayerMut::k_shift`); `None`: none.
        k_shift: Option<&'a CudaSlice<f32>>,
    },
}

/// Where a RoPE epilogue writes, and what it rotates with: the rotated q of each row, and k and
/// v into each row's cache slot (a row whose slot is -1, a graph bucket's padding, writes q only).
pub struct RopeOut<'a> {
    /// Query heads.
    pub n_heads: usize,
    /// `m × n_heads × head_dim` bf16: the rotated q.
    pub q_out: &'a mut CudaSlice<bf16>,
    /// The layer's cache.
    pub cache: RopeCache<'a>,
    /// The step's positions and slots.
    pub meta: &'a KvWriteMeta,
    /// `head_dim / 2` inverse frequencies (scaling applied).
    pub inv_freq: &'a CudaSlice<f64>,
    /// The qkv projection's bias ([`Self::rows`] values, Qwen2's), added to each rounded product
    /// before the rotation; `None`: no bias.
    pub bias: Option<&'a CudaSlice<bf16>>,
    /// YaRN's / LongRoPE's attention factor on cos and sin; `None`: 1.
    pub attention_factor: Option<f32>,
    /// The cache's geometry.
    pub geo: KvGeometry,
}

impl RopeOut<'_> {
    /// The projection's rows, `(n_heads + 2·n_kv_heads)·head_dim`.
    pub fn rows(&self) -> usize {
        (self.n_heads + 2 * self.geo.n_kv_heads) * self.geo.head_dim
    }

    /// Checks everything the epilogue writes or reads for `m` rows (naming `op`), and returns
    /// whether the cache is FP8 (the `_fp8` kernel) with the K and V scales (1 for bf16).
    pub(super) fn check(&self, op: &'static str, m: usize) -> Result<(bool, [f32; 2]), CudaError> {
        let (hd, geo) = (self.geo.head_dim, &self.geo);
        need(op, "q_out", self.q_out, m * self.n_heads * hd)?;
        need(op, "inv_freq", self.inv_freq, hd / 2)?;
        if let Some(b) = self.bias {
            need(op, "bias", b, self.rows())?;
        }
        shape_check(op, norm_rope_supports(hd), || {
            format!("head_dim {hd}: the kernel needs a multiple of 16 up to 256")
        })?;
        shape_check(op, self.meta.rows == m, || format!("{m} rows, metadata for {}", self.meta.rows))?;
        self.meta.check_geometry(op, geo)?;
        let cs_scale = self.attention_factor.unwrap_or(1.0);
        shape_check(op, cs_scale.is_finite() && cs_scale > 0.0, || format!("attention factor {cs_scale}"))?;
        match &self.cache {
            RopeCache::Bf16 { k, v } => {
                need(op, "k_cache", *k, geo.layer_len())?;
                need(op, "v_cache", *v, geo.layer_len())?;
                Ok((false, [1.0, 1.0]))
            }
            RopeCache::Fp8 { k, v, k_scale, v_scale, k_shift } => {
                need(op, "k_cache", *k, geo.layer_len())?;
                need(op, "v_cache", *v, geo.layer_len())?;
                if let Some(s) = k_shift {
                    need(op, "k_shift", *s, geo.n_kv_heads * hd)?;
                }
                shape_check(op, [k_scale, v_scale].iter().all(|s| s.is_finite() && **s > 0.0), || {
                    format!("FP8 KV scales k {k_scale}, v {v_scale}: each must be finite and positive")
                })?;
                Ok((true, [*k_scale, *v_scale]))
            }
        }
    }

    /// The epilogue's arguments after the product's inputs: q_out, the caches, positions, slots,
    /// inv_freq, the bias (a null pointer for none), the head counts, head_dim, the cos/sin
    /// factor, the K and V scales (`scales` from [`Self::check`]) and the key shift (a null
    /// pointer for none, always for a bf16 cache).
    pub(super) fn push<'b>(&'b self, args: Args<'b>, scales: [f32; 2]) -> Result<Args<'b>, CudaError> {
        let args = args.buf(self.q_out);
        let args = match &self.cache {
            RopeCache::Bf16 { k, v } => args.buf(*k).buf(*v),
            RopeCache::Fp8 { k, v, .. } => args.buf(*k).buf(*v),
        };
        let args = args.buf(&self.meta.positions).buf(&self.meta.slots).buf(self.inv_freq);
        let args = match self.bias {
            Some(b) => args.buf(b),
            None => args.u64(0),
        };
        let (nkv, hd) = (self.geo.n_kv_heads, self.geo.head_dim);
        let cs_scale = self.attention_factor.unwrap_or(1.0);
        let args = args.int(self.n_heads)?.int(nkv)?.int(hd)?.f32(cs_scale).f32(scales[0]).f32(scales[1]);
        Ok(match &self.cache {
            RopeCache::Fp8 { k_shift: Some(s), .. } => args.buf(*s),
            _ => args.u64(0),
        })
    }
}

/// `qkv = (rms_norm(residual) · norm) · wᵀ` ([`NormInput`]) for the step's `m` rows, then RoPE on
/// q and k at each row's position, written as [`RopeOut`] says.
pub struct NormRopeCall<'a> {
    /// The normalized activation's source.
    pub input: NormInput<'a>,
    /// Rows: the step's rows (`rope.meta`'s).
    pub m: usize,
    /// The residual's width: the reduction length.
    pub k: usize,
    /// The fused projection `[q; k; v]`: [`RopeOut::rows`] × k bf16.
    pub w: &'a CudaSlice<bf16>,
    /// Where the epilogue writes.
    pub rope: RopeOut<'a>,
    /// Index in [`GEMV_VARIANTS`](super::GEMV_VARIANTS), or `None` for the variant the plain
    /// product of this width picks.
    pub variant: Option<usize>,
}

impl NormRopeCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "norm_rope";
        let Self { input, m, k, w, rope, variant } = self;
        let n = rope.rows();
        input.check(OP, m, k)?;
        need(OP, "w", w, n * k)?;
        let (fp8_cache, scales) = rope.check(OP, m)?;
        if m == 0 {
            return Ok(());
        }
        gemv_shape_ok(OP, m, k)?;
        let epilogue = if fp8_cache { GemvEpilogue::NormRopeFp8 } else { GemvEpilogue::NormRope };
        let variant = variant.unwrap_or_else(|| gemv_default(n, dev.sm_count()));
        let (v, func) = gemv_function(dev, OP, m, variant, epilogue)?;
        let grid = cfg((int(OP, n / GEMV_ROWS_PER_CTA)? as u32, 1, 1), v.warps * 32);
        let pf = v.prefetch_row_bytes(n, k, dev.gemv_l2_prefetch());
        let args = rope.push(input.args(OP, k)?.buf(w), scales)?;
        let args = args.int(m)?.int(n)?.int(k)?.int(pf)?;
        // SAFETY: residual holds m × k, stats m × norm_stat_parts(k), norm k, w n × k, q_out m × n_heads ×
        // head_dim and inv_freq head_dim / 2 (checked above); n is a multiple of 16 (head_dim
        // is), so every CTA's 16 weight rows exist; the metadata has m rows and was validated
        // against this cache's geometry, so each slot the epilogue writes (one per row with a
        // slot, n_kv_heads × head_dim elements) lies in the layer's cache; a key shift holds
        // n_kv_heads × head_dim values (checked).
        unsafe { args.launch(dev, func, grid) }
    }
}
