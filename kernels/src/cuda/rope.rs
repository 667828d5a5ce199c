//! RoPE and the KV-cache write (rope_kv.cu): [`RopeKvCall`] rotates q and k at each row's
//! position and writes k and v into the row's cache slot, from three split buffers or from
//! the rows of a fused QKV projection ([`RopeInput`]). [`RopeKvCall::launch_with`] adds
//! ([`RopeExtras`]) the per-head q/k RMSNorm of Qwen3 and Gemma 3 ([`QkNorm`]), fused in
//! front of the rotation, and partial rotary embeddings (Phi-4-mini: only the first
//! `rotary_dim` dims of a head rotate). [`RopeKvFp8Call`] writes an FP8 cache;
//! [`RopeKvAmaxCall`] is FP8 KV scale calibration's read-only pass over the same rows.
//!
//! Invariants: positions and slots come from the step's [`KvWriteMeta`], validated when it
//! was set; a row with slot -1 (a graph bucket's padding) writes nothing; one CTA per (row,
//! head), one thread per rotation pair (`head_dim / 2`, rounded up to a multiple of 32 with the
//! q/k norm, whose sum of squares is a block reduction).

use super::launch::{Args, Elem, MAX_GRID_YZ, cfg, int, need, shape_check};
use super::{CudaDevice, CudaError, CudaSlice, KvGeometry, KvWriteMeta};
use crate::cpu::NormWeight;
use half::bf16;

/// The per-head RMSNorm of q and k that Qwen3 and Gemma 3 apply before RoPE (reference:
/// [`crate::cpu::head_rms_norm`] on each head, then [`crate::cpu::RopeTable::apply`]).
#[derive(Clone)]
pub struct QkNorm<'a> {
    /// `head_dim` weights of the query heads' norm (`self_attn.q_norm.weight`).
    pub q_weight: &'a CudaSlice<bf16>,
    /// `head_dim` weights of the key heads' norm (`self_attn.k_norm.weight`).
    pub k_weight: &'a CudaSlice<bf16>,
    /// The norm's epsilon (`rms_norm_eps`).
    pub eps: f32,
    /// `w` (Qwen3) or `1 + w` (Gemma 3).
    pub weight: NormWeight,
}

/// Where the rows' q, k and v come from.
pub enum RopeInput<'a> {
    /// Three buffers: q (`rows × n_heads × head_dim`) and k (`rows × n_kv_heads × head_dim`)
    /// are rotated in place, v (as k) is only read.
    Split {
        /// Rotated in place.
        q: &'a mut CudaSlice<bf16>,
        /// Rotated in place, then written to the cache.
        k: &'a mut CudaSlice<bf16>,
        /// Written to the cache.
        v: &'a CudaSlice<bf16>,
    },
    /// Rows `[q | k | v]` of the QKV projection (`rows × (n_heads + 2·n_kv_heads) × head_dim`):
    /// the rotated q goes to `q_out` (`rows × n_heads × head_dim`), the rotated k and v only
    /// to the cache. Saves the three column copies of a split and their launches.
    Fused {
        /// The projection's rows, only read.
        qkv: &'a CudaSlice<bf16>,
        /// The rotated q.
        q_out: &'a mut CudaSlice<bf16>,
    },
}

impl RopeInput<'_> {
    /// The same input borrowed again, for one launch (a calibration pass and the write that
    /// follows it read the same rows).
    pub fn reborrow(&mut self) -> RopeInput<'_> {
        match self {
            RopeInput::Split { q, k, v } => RopeInput::Split { q, k, v },
            RopeInput::Fused { qkv, q_out } => RopeInput::Fused { qkv, q_out },
        }
    }
}

/// What some architectures add to the rotation ([`RopeKvCall::launch_with`]); the default adds
/// nothing.
#[derive(Default, Clone)]
pub struct RopeExtras<'a> {
    /// RMS-normalize every query and key head before the rotation (Qwen3, Gemma 3).
    pub qk_norm: Option<QkNorm<'a>>,
    /// Rotate only the first `rotary_dim` dims of each head, in pairs `(i, i + rotary_dim / 2)`
    /// (transformers' `partial_rotary_factor · head_dim`; even, at most head_dim); the table's
    /// `inv_freq` then has `rotary_dim / 2` entries ([`crate::cpu::RopeTable::new`] at
    /// `rotary_dim`). Reference: [`crate::cpu::RopeTable::apply_partial`]. `None`: all of it.
    pub rotary_dim: Option<usize>,
    /// Multiply cos and sin by this (YaRN's and LongRoPE's attention factor,
    /// [`crate::cpu::RopeTable::attention_factor`]): the rotated dims of q and k scale by it,
    /// pass-through dims do not, as in transformers. `None`: 1.
    pub attention_factor: Option<f32>,
}

/// RoPE on q and k at each row's position, then the rotated k and v into layer's cache slots.
///
/// [`launch`](Self::launch) runs it as is; [`launch_with`](Self::launch_with) adds
/// [`RopeExtras`]: the q/k norm, in the same kernel so that the normalized heads never
/// round-trip through memory, and partial rotation. (The extras are an argument of the
/// launch rather than fields so that existing call sites stay as they are.)
pub struct RopeKvCall<'a> {
    /// The rows' q, k and v.
    pub input: RopeInput<'a>,
    /// The layer's K cache (`geo.layer_len()` bf16).
    pub k_cache: &'a mut CudaSlice<bf16>,
    /// The layer's V cache.
    pub v_cache: &'a mut CudaSlice<bf16>,
    /// The step's positions and slots.
    pub meta: &'a KvWriteMeta,
    /// `head_dim / 2` inverse frequencies (scaling applied).
    pub inv_freq: &'a CudaSlice<f64>,
    /// Query heads.
    pub n_heads: usize,
    /// The cache's geometry.
    pub geo: KvGeometry,
}

impl RopeKvCall<'_> {
    /// Checks the sizes and enqueues `rope_write_kv_bf16` or `rope_qkv_write_kv_bf16`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        self.launch_with(dev, RopeExtras::default())
    }

    /// As [`launch`](Self::launch), with the extras: with `qk_norm`, each query head is
    /// RMS-normalized by `q_weight` and each key head by `k_weight` before the rotation
    /// (`rope_qknorm_write_kv_bf16` or `rope_qkv_qknorm_write_kv_bf16`; the cached k is the
    /// normalized, rotated one, v is not normalized); with `rotary_dim`, the dims past it
    /// pass through unrotated (normalized when `qk_norm` is given).
    pub fn launch_with(self, dev: &CudaDevice, extras: RopeExtras<'_>) -> Result<(), CudaError> {
        let cache = Dest::Cache { k: &*self.k_cache, v: &*self.v_cache, fp8: None };
        let call = RopeParts {
            input: self.input,
            cache,
            meta: self.meta,
            inv_freq: self.inv_freq,
            n_heads: self.n_heads,
            geo: self.geo,
        };
        launch_rope(dev, call, extras)
    }
}

/// [`RopeKvCall`] into an FP8 (E4M3) cache: the same rotation (and extras), then each k
/// written as `e4m3((k - k_shift) / k_scale)` and each v as `e4m3(v / v_scale)`, one byte an element
/// (reference: [`crate::cpu::write_kv_fp8`] on the bf16-rounded rotated k and v). Kernels
/// `rope*_write_kv_fp8` (rope_kv.cu).
pub struct RopeKvFp8Call<'a> {
    /// The rows' q, k and v.
    pub input: RopeInput<'a>,
    /// The layer's K cache (`geo.layer_len()` bytes).
    pub k_cache: &'a mut CudaSlice<u8>,
    /// The layer's V cache.
    pub v_cache: &'a mut CudaSlice<u8>,
    /// What a key is divided by before rounding (finite, positive).
    pub k_scale: f32,
    /// What a value is divided by before rounding (finite, positive).
    pub v_scale: f32,
    /// Subtracted from each (rotated, normed, bf16-rounded) key first, `n_kv_heads × head_dim`
    /// values (the layer's smoothing; see [`crate::cpu::Fp8KvLayerMut::k_shift`]); `None`: none.
    pub k_shift: Option<&'a CudaSlice<f32>>,
    /// The step's positions and slots.
    pub meta: &'a KvWriteMeta,
    /// `rotary_dim / 2` inverse frequencies (scaling applied).
    pub inv_freq: &'a CudaSlice<f64>,
    /// Query heads.
    pub n_heads: usize,
    /// The cache's geometry.
    pub geo: KvGeometry,
}

impl RopeKvFp8Call<'_> {
    /// Checks the sizes and scales and enqueues the `_fp8` kernel for the input form and
    /// extras (see [`RopeKvCall::launch_with`]).
    pub fn launch_with(self, dev: &CudaDevice, extras: RopeExtras<'_>) -> Result<(), CudaError> {
        let fp8 = Fp8Coding { k_scale: self.k_scale, v_scale: self.v_scale, k_shift: self.k_shift };
        let cache = Dest::Cache { k: &*self.k_cache, v: &*self.v_cache, fp8: Some(fp8) };
        let call = RopeParts {
            input: self.input,
            cache,
            meta: self.meta,
            inv_freq: self.inv_freq,
            n_heads: self.n_heads,
            geo: self.geo,
        };
        launch_rope(dev, call, extras)
    }
}

/// FP8 KV scale calibration's pass over a step (`rope*_write_kv_amax`): the rotation (and
/// extras) of [`RopeKvFp8Call`] on the same input, but nothing is written except `amax`, which
/// gets the largest |k| as the cache would store it (rotated, normed, rounded to bf16) and the
/// largest |v|, over the rows with a slot; a NaN anywhere comes out NaN. The caller zeroes
/// `amax` first (maxima are raised into it). Reference: [`crate::cpu::abs_max`] over the CPU
/// backend's rotated k and v. q and k are not modified (in the split form either).
pub struct RopeKvAmaxCall<'a> {
    /// The rows' q, k and v, as the write that follows will get them.
    pub input: RopeInput<'a>,
    /// `[max |k|, max |v|]`, zeroed by the caller.
    pub amax: &'a mut CudaSlice<f32>,
    /// The step's positions and slots.
    pub meta: &'a KvWriteMeta,
    /// `rotary_dim / 2` inverse frequencies (scaling applied).
    pub inv_freq: &'a CudaSlice<f64>,
    /// Query heads.
    pub n_heads: usize,
    /// The cache's geometry.
    pub geo: KvGeometry,
}

impl RopeKvAmaxCall<'_> {
    /// Checks the sizes and enqueues the `_amax` kernel for the input form and extras.
    pub fn launch_with(self, dev: &CudaDevice, extras: RopeExtras<'_>) -> Result<(), CudaError> {
        let call = RopeParts::<u8> {
            input: self.input,
            cache: Dest::Amax(&*self.amax),
            meta: self.meta,
            inv_freq: self.inv_freq,
            n_heads: self.n_heads,
            geo: self.geo,
        };
        launch_rope(dev, call, extras)
    }
}

/// Where the rotated k and v go: a layer's K and V caches (with the FP8 scales and key shift
/// when they are E4M3 codes), or a calibration pass's two maxima.
enum Dest<'a, T> {
    Cache { k: &'a CudaSlice<T>, v: &'a CudaSlice<T>, fp8: Option<Fp8Coding<'a>> },
    Amax(&'a CudaSlice<f32>),
}

/// How an FP8 cache's codes are written: [`RopeKvFp8Call`]'s scales and key shift.
#[derive(Clone, Copy)]
struct Fp8Coding<'a> {
    k_scale: f32,
    v_scale: f32,
    k_shift: Option<&'a CudaSlice<f32>>,
}

/// The fields of [`RopeKvCall`], [`RopeKvFp8Call`] or [`RopeKvAmaxCall`].
struct RopeParts<'a, T> {
    input: RopeInput<'a>,
    cache: Dest<'a, T>,
    meta: &'a KvWriteMeta,
    inv_freq: &'a CudaSlice<f64>,
    n_heads: usize,
    geo: KvGeometry,
}

/// The launch behind [`RopeKvCall`] and [`RopeKvFp8Call`]: bf16 or FP8 caches of
/// `geo.layer_len()` elements each.
fn launch_rope<T: Elem>(dev: &CudaDevice, call: RopeParts<'_, T>, extras: RopeExtras<'_>) -> Result<(), CudaError> {
    let RopeParts { input, cache, meta, inv_freq, n_heads, geo } = call;
    let (rows, hd, nkv) = (meta.rows, geo.head_dim, geo.n_kv_heads);
    let norm = extras.qk_norm;
    let rot = extras.rotary_dim.unwrap_or(hd);
    let normed = norm.is_some();
    // 0: bf16 cache, 1: FP8 cache, 2: calibration pass.
    let mode = match &cache {
        Dest::Cache { fp8: None, .. } => 0,
        Dest::Cache { fp8: Some(_), .. } => 1,
        Dest::Amax(_) => 2,
    };
    let kt = &dev.kernels;
    let (op, func, lead) = match input {
        RopeInput::Split { q, k, v } => {
            let (op, func) = match (normed, mode) {
                (true, 0) => ("rope_qknorm_write_kv", &kt.rope_qknorm_write_kv),
                (false, 0) => ("rope_write_kv", &kt.rope_write_kv),
                (true, 1) => ("rope_qknorm_write_kv_fp8", &kt.rope_write_kv_fp8[2]),
                (false, 1) => ("rope_write_kv_fp8", &kt.rope_write_kv_fp8[0]),
                (true, _) => ("rope_qknorm_write_kv_amax", &kt.rope_write_kv_amax[2]),
                (false, _) => ("rope_write_kv_amax", &kt.rope_write_kv_amax[0]),
            };
            need(op, "q", q, rows * n_heads * hd)?;
            need(op, "k", k, rows * nkv * hd)?;
            need(op, "v", v, rows * nkv * hd)?;
            (op, func, Args::new(op).buf(q).buf(k).buf(v))
        }
        RopeInput::Fused { qkv, q_out } => {
            let (op, func) = match (normed, mode) {
                (true, 0) => ("rope_qkv_qknorm_write_kv", &kt.rope_qkv_qknorm_write_kv),
                (false, 0) => ("rope_qkv_write_kv", &kt.rope_qkv_write_kv),
                (true, 1) => ("rope_qkv_qknorm_write_kv_fp8", &kt.rope_write_kv_fp8[3]),
                (false, 1) => ("rope_qkv_write_kv_fp8", &kt.rope_write_kv_fp8[1]),
                (true, _) => ("rope_qkv_qknorm_write_kv_amax", &kt.rope_write_kv_amax[3]),
                (false, _) => ("rope_qkv_write_kv_amax", &kt.rope_write_kv_amax[1]),
            };
            need(op, "qkv", qkv, rows * (n_heads + 2 * nkv) * hd)?;
            need(op, "q_out", q_out, rows * n_heads * hd)?;
            (op, func, Args::new(op).buf(qkv).buf(q_out))
        }
    };
    shape_check(op, hd >= 2 && hd.is_multiple_of(2) && hd <= 256, || format!("head_dim {hd} unsupported"))?;
    meta.check_geometry(op, &geo)?;
    let mut coding = None;
    match &cache {
        Dest::Cache { k, v, fp8 } => {
            need(op, "k_cache", *k, geo.layer_len())?;
            need(op, "v_cache", *v, geo.layer_len())?;
            if let Some(c) = fp8 {
                let (k, v) = (c.k_scale, c.v_scale);
                shape_check(op, [k, v].iter().all(|s| s.is_finite() && *s > 0.0), || {
                    format!("FP8 KV scales k {k}, v {v}: each must be finite and positive")
                })?;
                if let Some(s) = c.k_shift {
                    need(op, "k_shift", s, nkv * hd)?;
                }
            }
            coding = *fp8;
        }
        Dest::Amax(a) => need(op, "amax", *a, 2)?,
    }
    shape_check(op, rot >= 2 && rot.is_multiple_of(2) && rot <= hd, || {
        format!("rotary_dim {rot} must be even, between 2 and head_dim {hd}")
    })?;
    need(op, "inv_freq", inv_freq, rot / 2)?;
    let cs_scale = extras.attention_factor.unwrap_or(1.0);
    shape_check(op, cs_scale.is_finite() && cs_scale > 0.0, || format!("attention factor {cs_scale}"))?;
    if let Some(n) = &norm {
        need(op, "q_norm weight", n.q_weight, hd)?;
        need(op, "k_norm weight", n.k_weight, hd)?;
        shape_check(op, n.eps.is_finite() && n.eps >= 0.0, || format!("norm eps {} is not >= 0", n.eps))?;
    }
    if rows == 0 {
        return Ok(());
    }
    // One CTA per (row, head) (query heads, key heads, then value heads; see rope_kv.cu), or
    // for a prefill chunk one per row and group of heads.
    let heads = n_heads + 2 * nkv;
    shape_check(op, heads <= MAX_GRID_YZ, || format!("{heads} heads exceed the grid"))?;
    let head_groups = rope_head_groups(rows, heads, dev.rope_grouped_min_rows());
    // With the norm, whole warps: the head's sum of squares is a block reduction.
    let threads = if normed { (hd / 2).next_multiple_of(32) } else { hd / 2 };
    let grid = cfg((int(op, rows)? as u32, int(op, head_groups)? as u32, 1), threads as u32);
    let lead = match cache {
        Dest::Cache { k, v, .. } => lead.buf(k).buf(v),
        Dest::Amax(a) => lead.buf(a),
    };
    let mut args = lead
        .buf(&meta.positions)
        .buf(&meta.slots)
        .buf(inv_freq)
        .int(n_heads)?
        .int(nkv)?
        .int(hd)?
        .int(rot / 2)?
        .f32(cs_scale);
    if let Some(n) = norm {
        args = args.buf(n.q_weight).buf(n.k_weight).f32(n.eps).f32(n.weight.offset());
    }
    if let Some(c) = coding {
        args = args.f32(c.k_scale).f32(c.v_scale);
        args = match c.k_shift {
            Some(s) => args.buf(s),
            None => args.u64(0),
        };
    }
    // SAFETY: each CTA reads and writes heads of its own row of the inputs (checked against `rows`
    // and the head counts above), writes one slot validated by the metadata against this
    // cache's geometry (or none for slot -1; a calibration pass writes only the two floats of
    // `amax`, checked above), and reads `rotary_dim / 2` frequencies (and, with
    // the norm, `head_dim` weights of each norm, checked above; threads past `head_dim / 2`
    // touch nothing); a key shift is read at `n_kv_heads × head_dim` elements at most (checked).
    unsafe { args.launch(dev, func, grid) }
}

/// Rows from which a RoPE launch gives each CTA [`ROPE_HEADS_PER_CTA`] heads of a row rather
/// than one: prefill chunks and the largest decode batches. Smaller decode steps keep one head a
/// CTA: eight heads a CTA made the attention kernel after it 3.7 ms a step slower at b=32 ctx 8k
/// under programmatic dependent launch (rope_kv.cu). At 256 rows grouping took this kernel from
/// 622 to 312 µs a step and the step 2 % faster, the attention after it unchanged (bf16 and FP8
/// caches, H100, f591c03; BENCHMARKS.md).
pub(crate) const ROPE_GROUPED_MIN_ROWS: usize = 129;

/// Heads a CTA takes at [`ROPE_GROUPED_MIN_ROWS`] rows and more: its row's angles (an f64
/// sincos a rotated pair) are computed once for them all. With one head a CTA, a 2,048-token
/// Llama-3.1-8B prefill spent 122 µs a layer here (3.9 ms of a 53.5 ms TTFT; H100, session 16)
/// for ~50 MB moved.
pub(crate) const ROPE_HEADS_PER_CTA: usize = 8;

/// The grid's y: CTAs per row, each taking heads y, y + groups, ... (`heads` in all); grouped
/// from `grouped_min_rows` rows (the device's [`super::CudaDevice::rope_grouped_min_rows`]).
pub(crate) fn rope_head_groups(rows: usize, heads: usize, grouped_min_rows: usize) -> usize {
    if rows >= grouped_min_rows { heads.div_ceil(ROPE_HEADS_PER_CTA).max(1) } else { heads }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_chunks_and_large_batches_group_heads_and_small_decode_keeps_one_a_cta() {
        // Llama-3.1-8B: 32 + 2 × 8 heads.
        assert_eq!(rope_head_groups(1, 48, ROPE_GROUPED_MIN_ROWS), 48);
        assert_eq!(rope_head_groups(128, 48, ROPE_GROUPED_MIN_ROWS), 48);
        assert_eq!(rope_head_groups(256, 48, ROPE_GROUPED_MIN_ROWS), 6);
        assert_eq!(rope_head_groups(2048, 48, ROPE_GROUPED_MIN_ROWS), 6);
        assert_eq!(rope_head_groups(2048, 3, ROPE_GROUPED_MIN_ROWS), 1);
    }
}
