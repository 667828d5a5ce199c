//! RoPE and the KV-cache write (rope_kv.cu): [`RopeKvCall`] rotates q and k at each row's
//! position and writes k and v into the row's cache slot, from three split buffers or from
//! the rows of a fused QKV projection ([`RopeInput`]).
//!
//! Invariants: positions and slots come from the step's [`KvWriteMeta`], validated when it
//! was set; a row with slot -1 (a graph bucket's padding) writes nothing; one CTA per row,
//! its threads a multiple of `head_dim / 2` (one rotation pair each).

use super::launch::{Args, MAX_GRID_YZ, cfg, int, need, shape_check};
use super::{CudaDevice, CudaError, CudaSlice, KvGeometry, KvWriteMeta};
use half::bf16;

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

/// RoPE on q and k at each row's position, then the rotated k and v into layer's cache slots.
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
        let (rows, hd, nkv) = (self.meta.rows, self.geo.head_dim, self.geo.n_kv_heads);
        let (op, func, lead) = match self.input {
            RopeInput::Split { q, k, v } => {
                const OP: &str = "rope_write_kv";
                need(OP, "q", q, rows * self.n_heads * hd)?;
                need(OP, "k", k, rows * nkv * hd)?;
                need(OP, "v", v, rows * nkv * hd)?;
                (OP, &dev.kernels.rope_write_kv, Args::new(OP).buf(q).buf(k).buf(v))
            }
            RopeInput::Fused { qkv, q_out } => {
                const OP: &str = "rope_qkv_write_kv";
                need(OP, "qkv", qkv, rows * (self.n_heads + 2 * nkv) * hd)?;
                need(OP, "q_out", q_out, rows * self.n_heads * hd)?;
                (OP, &dev.kernels.rope_qkv_write_kv, Args::new(OP).buf(qkv).buf(q_out))
            }
        };
        shape_check(op, hd >= 2 && hd.is_multiple_of(2) && hd <= 256, || format!("head_dim {hd} unsupported"))?;
        self.meta.check_geometry(op, &self.geo)?;
        need(op, "k_cache", self.k_cache, self.geo.layer_len())?;
        need(op, "v_cache", self.v_cache, self.geo.layer_len())?;
        need(op, "inv_freq", self.inv_freq, hd / 2)?;
        if rows == 0 {
            return Ok(());
        }
        // One CTA per (row, head): query heads, key heads, then value heads (see rope_kv.cu).
        let heads = int(op, self.n_heads + 2 * nkv)? as u32;
        shape_check(op, heads as usize <= MAX_GRID_YZ, || format!("{heads} heads exceed the grid"))?;
        let grid = cfg((int(op, rows)? as u32, heads, 1), (hd / 2) as u32);
        let args = lead
            .buf(self.k_cache)
            .buf(self.v_cache)
            .buf(&self.meta.positions)
            .buf(&self.meta.slots)
            .buf(self.inv_freq)
            .int(self.n_heads)?
            .int(nkv)?
            .int(hd)?;
        // SAFETY: each CTA reads and writes one head of its own row of the inputs (checked against `rows`
        // and the head counts above), writes one slot validated by the metadata against this
        // cache's geometry (or none for slot -1), and reads `head_dim / 2` frequencies.
        unsafe { args.launch(dev, func, grid) }
    }
}
