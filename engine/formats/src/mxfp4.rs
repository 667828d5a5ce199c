//! MXFP4 weights (OCP Microscaling: e2m1 elements sharing one e8m0 power-of-two scale per 32),
//! as gpt-oss checkpoints store their expert matrices, dequantized at load.
//!
//! The checkpoint layout (openai/gpt-oss-*, read by transformers' `convert_moe_packed_tensors`):
//! a weight `W` is stored as `W_blocks`, `u8 [E, out, in/32, 16]` (two 4-bit codes per byte, the
//! even element in the low nibble), and `W_scales`, `u8 [E, out, in/32]` (the scale is
//! `2^(s - 127)`). The dequantized tensor is the transpose `[E, in, out]`, the layout the same
//! model's unquantized checkpoint stores (`mlp.experts.gate_up_proj` `[E, hidden, 2·inter]`), so
//! an architecture reads one layout whichever way the checkpoint was published.
//!
//! Invariants: every stored value is `±{0, .5, 1, 1.5, 2, 3, 4, 6} · 2^k`, exactly representable in
//! bfloat16 (two mantissa bits) whenever it is finite, so the bf16 output is exact; a scale byte
//! of 255 (e8m0's NaN) or a product that overflows is refused, naming the tensor.

use crate::error::FormatError;
use std::path::Path;

/// Elements that share one scale.
pub const GROUP: usize = 32;

/// The magnitudes of the eight e2m1 codes (bit 3 is the sign).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The value of e2m1 `code` (its low four bits).
pub fn e2m1(code: u8) -> f32 {
    let m = E2M1[usize::from(code & 7)];
    if code & 8 != 0 { -m } else { m }
}

/// The shape `W_blocks`/`W_scales` dequantize to (`[E, in, out]`), or why they do not fit.
pub fn dequantized_shape(blocks: &[usize], scales: &[usize]) -> Result<Vec<usize>, String> {
    match (blocks, scales) {
        ([e, out, groups, half], [se, sout, sgroups])
            if *half == GROUP / 2 && [e, out, groups] == [se, sout, sgroups] =>
        {
            Ok(vec![*e, groups * GROUP, *out])
        }
        _ => Err(format!(
            "MXFP4 blocks {blocks:?} and scales {scales:?} do not fit: expected [E, out, in/32, 16] and [E, out, in/32]"
        )),
    }
}

/// Dequantizes `name`'s blocks and scales (shapes as [`dequantized_shape`] checks) into
/// little-endian bf16 bytes of shape `[E, in, out]`. `path` names the file in errors.
pub fn dequantize_bf16(
    path: &Path,
    name: &str,
    blocks: &[u8],
    blocks_shape: &[usize],
    scales: &[u8],
    scales_shape: &[usize],
) -> Result<Vec<u8>, FormatError> {
    let bad = |message: String| FormatError::Safetensors { path: path.to_path_buf(), message };
    let shape = dequantized_shape(blocks_shape, scales_shape).map_err(|m| bad(format!("tensor {name:?}: {m}")))?;
    let (experts, inputs, outputs) = (shape[0], shape[1], shape[2]);
    let groups = inputs / GROUP;
    if blocks.len() != experts * outputs * groups * (GROUP / 2) || scales.len() != experts * outputs * groups {
        return Err(bad(format!("tensor {name:?}: MXFP4 data lengths do not match their shapes")));
    }
    let mut out = vec![0u8; experts * inputs * outputs * 2];
    // One expert per task: a 20B gpt-oss layer holds 0.5 G values per matrix.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(experts.max(1));
    let per_thread = experts.div_ceil(threads).max(1);
    let expert_bytes = inputs * outputs * 2;
    std::thread::scope(|scope| {
        let tasks: Vec<_> = out
            .chunks_mut((per_thread * expert_bytes).max(1))
            .enumerate()
            .map(|(t, chunk)| {
                scope.spawn(move || {
                    for (k, dst) in chunk.chunks_mut(expert_bytes.max(1)).enumerate() {
                        let e = t * per_thread + k;
                        let rows = e * outputs * groups..(e + 1) * outputs * groups;
                        dequantize_expert(
                            &blocks[rows.start * (GROUP / 2)..rows.end * (GROUP / 2)],
                            &scales[rows],
                            outputs,
                            dst,
                        )
                        .map_err(|(o, s)| (e, o, s))?;
                    }
                    Ok(())
                })
            })
            .collect();
        for task in tasks {
            match task.join() {
                Ok(Ok(())) => {}
                Ok(Err((e, o, 0xFF))) => {
                    return Err(bad(format!(
                        "tensor {:?}: scale byte 255 is e8m0's NaN (expert {e}, row {o})",
                        format!("{name}_scales")
                    )));
                }
                Ok(Err((e, o, s))) => {
                    return Err(bad(format!(
                        "tensor {name:?}: scale 2^{} overflows (expert {e}, row {o})",
                        i32::from(s) - 127
                    )));
                }
                Err(_) => return Err(bad(format!("tensor {name:?}: dequantization panicked"))),
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// One expert: `blocks`/`scales` its `outputs × groups` rows, `dst` its `[in, out]` bf16 bytes.
/// Errors give the output row and the scale byte that is NaN or overflows.
fn dequantize_expert(blocks: &[u8], scales: &[u8], outputs: usize, dst: &mut [u8]) -> Result<(), (usize, u8)> {
    let groups = scales.len() / outputs;
    for o in 0..outputs {
        for g in 0..groups {
            let row = o * groups + g;
            let s = scales[row];
            if s == 0xFF {
                return Err((o, s));
            }
            let scale = (f32::from(s) - 127.0).exp2();
            for (j, &b) in blocks[row * (GROUP / 2)..(row + 1) * (GROUP / 2)].iter().enumerate() {
                for (k, code) in [b & 0x0F, b >> 4].into_iter().enumerate() {
                    let v = e2m1(code) * scale;
                    if !v.is_finite() {
                        return Err((o, s));
                    }
                    // Exact: the value has at most two mantissa bits (module invariant).
                    let bf = (v.to_bits() >> 16) as u16;
                    let at = ((g * GROUP + 2 * j + k) * outputs + o) * 2;
                    dst[at..at + 2].copy_from_slice(&bf.to_le_bytes());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_decode_to_the_e2m1_table() {
        let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for (code, w) in want.iter().enumerate() {
            assert_eq!(e2m1(code as u8).to_bits(), f32::to_bits(*w), "code {code}");
        }
    }

    #[test]
    fn one_group_dequantizes_transposed_with_its_scale() {
        // E = 1, out = 2, in = 32: row 0 has codes 0..15 then 15..0 at scale 2^1; row 1 all +6 at 2^-3.
        let code = |i: usize| if i < 16 { i as u8 } else { 31 - i as u8 };
        let mut blocks = vec![0x77u8; 2 * 16];
        for (j, b) in blocks.iter_mut().take(16).enumerate() {
            *b = code(2 * j) | (code(2 * j + 1) << 4);
        }
        let scales = [128u8, 124];
        let bytes = dequantize_bf16(Path::new("m"), "w", &blocks, &[1, 2, 1, 16], &scales, &[1, 2, 1]).expect("ok");
        let vals: Vec<f32> =
            bytes.chunks(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect();
        assert_eq!(vals.len(), 64);
        for i in 0..32 {
            assert_eq!(vals[i * 2], e2m1(code(i)) * 2.0, "row 0 input {i}");
            assert_eq!(vals[i * 2 + 1], 6.0 / 8.0, "row 1 input {i}");
        }
    }

    #[test]
    fn nan_scales_and_misfit_shapes_are_refused_by_name() {
        let err = dequantize_bf16(Path::new("m"), "w", &[0; 16], &[1, 1, 1, 16], &[255], &[1, 1, 1]).unwrap_err();
        assert!(err.to_string().contains("\"w_scales\"") && err.to_string().contains("NaN"), "{err}");
        let err = dequantize_bf16(Path::new("m"), "w", &[0; 16], &[1, 1, 1, 16], &[1], &[1, 2, 1]).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        let err = dequantize_bf16(Path::new("m"), "w", &[0; 8], &[1, 1, 1, 8], &[1], &[1, 1, 1]).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        let err = dequantize_bf16(Path::new("m"), "w", &[0x77; 16], &[1, 1, 1, 16], &[254], &[1, 1, 1]).unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
    }
}
