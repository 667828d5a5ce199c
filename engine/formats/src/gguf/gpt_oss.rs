//! gpt-oss GGUF files (`general.architecture` `gpt-oss`) as llama.cpp's converter writes them,
//! mapped onto the HF layout the gpt-oss architecture loads.
//!
//! The converter (`GptOssModel` in `convert_hf_to_gguf.py`) renames and reshapes:
//! - `self_attn.sinks` → `attn_sinks.weight`, `post_attention_layernorm` → `post_attention_norm`,
//!   the router `mlp.router` → `ffn_gate_inp` (weight and bias);
//! - the experts' fused `gate_up_proj` (`[E, hidden, 2·inter]`, gate and up interleaved by
//!   column) → `ffn_gate_exps` and `ffn_up_exps` (`[E, inter, hidden]` each, HF order), or with
//!   `--fuse-gate-up-exps` one `ffn_gate_up_exps` (`[E, 2·inter, hidden]`, gate rows then up
//!   rows); their bias likewise (`[E, inter]` each, or `[E, 2·inter]`);
//! - `down_proj` (`[E, inter, hidden]`) → `ffn_down_exps` (`[E, hidden, inter]`), its bias kept;
//! - MXFP4 checkpoints keep their codes (the type MXFP4, nibbles reordered into ggml's block
//!   layout); unquantized ones are written as floats.
//!
//! The renames are in `model.rs`'s per-family table (`layer_renames`). This module undoes the
//! reshapes: the interleave and the transposes are pure moves of elements, so
//! float tensors keep their dtype and values bit for bit; MXFP4 experts dequantize exactly to
//! bf16 (every MXFP4 value is a bf16 value), other block types to f32.
//!
//! Invariants: every expert tensor's shape is checked against the config before any element
//! moves; an MXFP4 block whose scale is e8m0's NaN (255) is refused, naming the tensor.

use rayon::prelude::*;

use super::model::{Stored, tensor_type};
use super::quant::{dequantize, mxfp4_nan_scale};
use super::reader::{GgufFile, GgufTensorInfo, GgufType};
use crate::config::ModelConfig;
use crate::error::FormatError;
use crate::tensor::{DType, TensorView, f32_to_bytes};
use half::bf16;
use std::borrow::Cow;

/// An HF expert tensor built from one or two GGUF tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertJob {
    /// `mlp.experts.gate_up_proj` `[E, hidden, 2·inter]`, gate and up interleaved by column.
    GateUp(usize),
    /// `mlp.experts.gate_up_proj_bias` `[E, 2·inter]`, interleaved likewise.
    GateUpBias(usize),
    /// `mlp.experts.down_proj` `[E, inter, hidden]`.
    Down(usize),
}

/// The expert job a GGUF tensor starts, if any: the gate tensor (or the fused one) starts the
/// gate/up job and the up tensor belongs to it; the down weight starts its own.
pub(super) fn expert_job(name: &str, layers: usize) -> Option<ExpertJob> {
    let (layer, tail) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|&l| l < layers)?;
    match tail {
        "ffn_gate_exps.weight" | "ffn_gate_up_exps.weight" => Some(ExpertJob::GateUp(layer)),
        "ffn_gate_exps.bias" | "ffn_gate_up_exps.bias" => Some(ExpertJob::GateUpBias(layer)),
        "ffn_down_exps.weight" => Some(ExpertJob::Down(layer)),
        _ => None,
    }
}

/// A tensor's elements in one dtype: floats as stored (borrowed from the map), MXFP4 as
/// (exact) bf16, other blocks as f32.
struct Elements<'a> {
    dtype: DType,
    bytes: Cow<'a, [u8]>,
}

impl<'a> Elements<'a> {
    fn read(file: &'a GgufFile, t: &GgufTensorInfo) -> Result<Self, FormatError> {
        let ty = tensor_type(file, t)?;
        let raw = file.tensor_bytes(t, ty)?;
        let plain = |dtype| Ok(Self { dtype, bytes: Cow::Borrowed(raw) });
        match ty {
            GgufType::F32 => plain(DType::F32),
            GgufType::F16 => plain(DType::F16),
            GgufType::BF16 => plain(DType::BF16),
            GgufType::MXFP4 => {
                if let Some(block) = mxfp4_nan_scale(raw) {
                    return Err(FormatError::gguf(
                        &file.path,
                        format!("tensor {:?}: MXFP4 block {block} has the NaN scale 255", t.name),
                    ));
                }
                let bytes = dequantize(ty, raw).iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
                Ok(Self { dtype: DType::BF16, bytes: Cow::Owned(bytes) })
            }
            _ => Ok(Self { dtype: DType::F32, bytes: Cow::Owned(f32_to_bytes(&dequantize(ty, raw))) }),
        }
    }

    /// Both tensors in one dtype (f32 when they differ).
    fn unify(a: Self, b: Self) -> (Self, Self) {
        if a.dtype == b.dtype {
            return (a, b);
        }
        let f32 = |e: Self| {
            let view = TensorView { name: String::new(), shape: Vec::new(), dtype: e.dtype, bytes: e.bytes };
            Self { dtype: DType::F32, bytes: Cow::Owned(f32_to_bytes(&view.to_f32())) }
        };
        (f32(a), f32(b))
    }
}

/// Builds the HF tensor of `job` under `config` (whose `moe` is set: the caller's check).
pub(super) fn build_expert(
    file: &GgufFile,
    config: &ModelConfig,
    job: ExpertJob,
) -> Result<(String, (Vec<usize>, Stored)), FormatError> {
    let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    let inter = config.moe.as_ref().map_or(0, |m| m.intermediate_size);
    let hidden = config.hidden_size;
    let path = &file.path;
    let tensor =
        |name: String| file.tensor(&name).ok_or_else(|| FormatError::gguf(path, format!("missing tensor {name:?}")));
    let shaped = |t: &GgufTensorInfo, want: &[usize]| -> Result<(), FormatError> {
        let shape = t.hf_shape();
        if shape == want {
            Ok(())
        } else {
            Err(FormatError::gguf(path, format!("tensor {:?}: shape {shape:?}, expected {want:?}", t.name)))
        }
    };
    let prefix = |layer: usize| format!("model.layers.{layer}.mlp.experts");
    match job {
        ExpertJob::Down(layer) => {
            let t = tensor(format!("blk.{layer}.ffn_down_exps.weight"))?;
            shaped(t, &[experts, hidden, inter])?;
            let e = Elements::read(file, t)?;
            let bytes = transpose_each(&e.bytes, e.dtype.size(), experts, hidden, inter);
            Ok((format!("{}.down_proj", prefix(layer)), (vec![experts, inter, hidden], Stored::Owned(e.dtype, bytes))))
        }
        ExpertJob::GateUp(layer) | ExpertJob::GateUpBias(layer) => {
            let bias = matches!(job, ExpertJob::GateUpBias(_));
            let suffix = if bias { "bias" } else { "weight" };
            // Rows a GGUF tensor holds per expert (inter × hidden for weights, inter for biases).
            let per_row = if bias { 1 } else { hidden };
            let (gate, up) = match file.tensor(&format!("blk.{layer}.ffn_gate_up_exps.{suffix}")) {
                Some(fused) => {
                    shaped(fused, &if bias { vec![experts, 2 * inter] } else { vec![experts, 2 * inter, hidden] })?;
                    let e = Elements::read(file, fused)?;
                    let (g, u) = split_halves(&e.bytes, experts);
                    (
                        Elements { dtype: e.dtype, bytes: Cow::Owned(g) },
                        Elements { dtype: e.dtype, bytes: Cow::Owned(u) },
                    )
                }
                None => {
                    let want = if bias { vec![experts, inter] } else { vec![experts, inter, hidden] };
                    let g = tensor(format!("blk.{layer}.ffn_gate_exps.{suffix}"))?;
                    let u = tensor(format!("blk.{layer}.ffn_up_exps.{suffix}"))?;
                    shaped(g, &want)?;
                    shaped(u, &want)?;
                    Elements::unify(Elements::read(file, g)?, Elements::read(file, u)?)
                }
            };
            let size = gate.dtype.size();
            let bytes = interleave(&gate.bytes, &up.bytes, size, experts, inter, per_row);
            let (name, shape) = if bias {
                (format!("{}.gate_up_proj_bias", prefix(layer)), vec![experts, 2 * inter])
            } else {
                (format!("{}.gate_up_proj", prefix(layer)), vec![experts, hidden, 2 * inter])
            };
            Ok((name, (shape, Stored::Owned(gate.dtype, bytes))))
        }
    }
}

/// `[E, rows, cols]` elements of `size` bytes → `[E, cols, rows]`.
fn transpose_each(bytes: &[u8], size: usize, experts: usize, rows: usize, cols: usize) -> Vec<u8> {
    let per = rows * cols * size;
    let mut out = vec![0u8; bytes.len()];
    out.par_chunks_mut(per.max(1)).zip(bytes.par_chunks(per.max(1))).take(experts).for_each(|(o, x)| {
        for r in 0..rows {
            for c in 0..cols {
                let (src, dst) = ((r * cols + c) * size, (c * rows + r) * size);
                o[dst..dst + size].copy_from_slice(&x[src..src + size]);
            }
        }
    });
    out
}

/// Each expert's first and second halves of `bytes` (`[E, 2·n, ...]` → two `[E, n, ...]`).
fn split_halves(bytes: &[u8], experts: usize) -> (Vec<u8>, Vec<u8>) {
    let per = bytes.len() / experts.max(1);
    let (mut a, mut b) = (Vec::with_capacity(bytes.len() / 2), Vec::with_capacity(bytes.len() / 2));
    for x in bytes.chunks_exact(per.max(1)) {
        a.extend_from_slice(&x[..per / 2]);
        b.extend_from_slice(&x[per / 2..]);
    }
    (a, b)
}

/// Gate and up, each `[E, inter, per_row]` elements of `size` bytes, → HF's
/// `[E, per_row, 2·inter]` with gate at even and up at odd columns (`per_row` 1: a bias,
/// `[E, 2·inter]`).
fn interleave(gate: &[u8], up: &[u8], size: usize, experts: usize, inter: usize, per_row: usize) -> Vec<u8> {
    let per = inter * per_row * size;
    let mut out = vec![0u8; 2 * gate.len()];
    out.par_chunks_mut((2 * per).max(1))
        .zip(gate.par_chunks(per.max(1)).zip(up.par_chunks(per.max(1))))
        .take(experts)
        .for_each(|(o, (g, u))| {
            for i in 0..inter {
                for h in 0..per_row {
                    let src = (i * per_row + h) * size;
                    for (s, from) in [g, u].into_iter().enumerate() {
                        let dst = (h * 2 * inter + 2 * i + s) * size;
                        o[dst..dst + size].copy_from_slice(&from[src..src + size]);
                    }
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_puts_gate_on_even_and_up_on_odd_columns() {
        // One expert, inter 2, hidden 3, one-byte elements: gate[i][h] = 10i + h, up = 100 + that.
        let gate: Vec<u8> = (0..2).flat_map(|i| (0..3).map(move |h| 10 * i + h)).collect();
        let up: Vec<u8> = gate.iter().map(|g| 100 + g).collect();
        let out = interleave(&gate, &up, 1, 1, 2, 3);
        // Row h of [hidden, 2·inter]: gate[0][h], up[0][h], gate[1][h], up[1][h].
        assert_eq!(out, vec![0, 100, 10, 110, 1, 101, 11, 111, 2, 102, 12, 112]);
        // A bias (per_row 1), two experts.
        assert_eq!(interleave(&[1, 2, 3, 4], &[5, 6, 7, 8], 1, 2, 2, 1), vec![1, 5, 2, 6, 3, 7, 4, 8]);
    }

    #[test]
    fn transpose_and_split_move_whole_elements() {
        // Two experts of [2, 3] two-byte elements.
        let x: Vec<u8> = (0..24).collect();
        let t = transpose_each(&x, 2, 2, 2, 3);
        assert_eq!(&t[..12], &[0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(&t[12..], &[12, 13, 18, 19, 14, 15, 20, 21, 16, 17, 22, 23]);
        let (a, b) = split_halves(&x, 2);
        assert_eq!((a[..6].to_vec(), b[..6].to_vec()), ((0..6).collect(), (6..12).collect()));
        assert_eq!((a[6..].to_vec(), b[6..].to_vec()), ((12..18).collect(), (18..24).collect()));
    }

    #[test]
    fn names_round_trip() {
        use crate::config::Architecture;
        use crate::gguf::model::{gguf_to_hf_name_for, hf_to_gguf_name_for};
        for g in ["blk.3.post_attention_norm.weight", "blk.0.attn_sinks.weight", "blk.1.ffn_gate_inp.bias"] {
            let hf = gguf_to_hf_name_for(g, Architecture::GptOss).expect("mapped");
            assert_eq!(hf_to_gguf_name_for(&hf, Architecture::GptOss).as_deref(), Some(g));
        }
        assert_eq!(expert_job("blk.1.ffn_gate_up_exps.weight", 2), Some(ExpertJob::GateUp(1)));
        assert_eq!(expert_job("blk.1.ffn_up_exps.weight", 2), None);
        assert_eq!(expert_job("blk.2.ffn_down_exps.weight", 2), None);
    }
}
