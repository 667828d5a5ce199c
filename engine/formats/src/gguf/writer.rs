//! A minimal GGUF writer (v3 by default, v2 on request), used to build test models. It lays
//! the file out as llama.cpp does: header, metadata, tensor infos, then tensor data with
//! each tensor aligned to `general.alignment` (32).

use std::io::Write;
use std::path::Path;

use super::quant::quantize;
use super::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufType, GgufValue};
use crate::error::FormatError;

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, GgufType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata key (order is kept).
    pub fn add_meta(&mut self, key: &str, value: GgufValue) {
        self.metadata.push((key.to_string(), value));
    }

    /// Adds a tensor given in HF (row-major) shape, encoding `values` as `ty`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        hf_shape: &[usize],
        ty: GgufType,
        values: &[f32],
    ) -> Result<(), FormatError> {
        let numel: usize = hf_shape.iter().product();
        let row = hf_shape.last().copied().unwrap_or(1);
        if numel != values.len() || row % ty.block_elems() != 0 {
            return Err(FormatError::InvalidArgument(format!(
                "tensor {name:?}: shape {hf_shape:?} does not fit {} values of {ty:?}",
                values.len()
            )));
        }
        let dims = hf_shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name.to_string(), dims, ty, quantize(ty, values)));
        Ok(())
    }

    /// Adds a tensor as stored bytes of `ty` with ggml-order `dims` (copying a file's tensor).
    pub fn add_raw_tensor(&mut self, name: &str, dims: &[u64], ty: GgufType, bytes: Vec<u8>) {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, bytes));
    }

    /// Writes a GGUF v3 file.
    pub fn write(&self, path: &Path) -> Result<(), FormatError> {
        self.write_version(path, 3)
    }

    /// Writes the file with the given version number in the header (2 and 3 share a layout).
    pub fn write_version(&self, path: &Path, version: u32) -> Result<(), FormatError> {
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut out, v);
        }
        let align = DEFAULT_ALIGNMENT as usize;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            put_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        let mut f = std::fs::File::create(path).map_err(|e| FormatError::io(path, e))?;
        f.write_all(&out).map_err(|e| FormatError::io(path, e))
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_string(out, s),
        GgufValue::Array(a) => {
            let elem = a.first().map_or(8, GgufValue::type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for x in a {
                put_value(out, x);
            }
        }
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}
