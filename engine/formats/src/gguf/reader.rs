//! A from-scratch GGUF (v2/v3) parser over a memory map: header, metadata key/values and
//! tensor infos. Every read is bounds-checked, so a truncated or corrupt file yields a
//! [`FormatError::Gguf`] naming the file and the offset, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::FormatError;

/// `GGUF` read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml tensor element types this crate reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    /// f32.
    F32,
    /// f16.
    F16,
    /// bf16.
    BF16,
    /// 32-element blocks: f16 scale + 32 × i8.
    Q8_0,
    /// 32-element blocks: f16 scale + 32 × 4-bit (offset 8).
    Q4_0,
    /// 32-element blocks: f16 scale, f16 min + 32 × 4-bit.
    Q4_1,
    /// 32-element blocks: e8m0 scale byte + 32 × 4-bit e2m1 (OCP MXFP4; gpt-oss experts).
    MXFP4,
}

impl GgufType {
    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
            Self::MXFP4 => 39,
        }
    }

    /// The type for a ggml type id, if supported.
    pub fn from_id(id: u32) -> Option<Self> {
        match id {
            0 => Some(Self::F32),
            1 => Some(Self::F16),
            2 => Some(Self::Q4_0),
            3 => Some(Self::Q4_1),
            8 => Some(Self::Q8_0),
            30 => Some(Self::BF16),
            39 => Some(Self::MXFP4),
            _ => None,
        }
    }

    /// Elements per block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::MXFP4 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::MXFP4 => 17,
        }
    }

    /// Whether the type is a block quantization.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }
}

/// Name of a ggml type id, for error messages.
pub fn ggml_type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        30 => "BF16",
        39 => "MXFP4",
        _ => return format!("ggml type {id}"),
    };
    name.to_string()
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Homogeneous array.
    Array(Vec<GgufValue>),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float (any float or integer type).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => 0,
            Self::I8(_) => 1,
            Self::U16(_) => 2,
            Self::I16(_) => 3,
            Self::U32(_) => 4,
            Self::I32(_) => 5,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::String(_) => 8,
            Self::Array(_) => 9,
            Self::U64(_) => 10,
            Self::I64(_) => 11,
            Self::F64(_) => 12,
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// GGUF tensor name (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in ggml order (`dims[0]` varies fastest).
    pub dims: Vec<u64>,
    /// ggml type id (see [`GgufType::from_id`]).
    pub ggml_type: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (`None` if the dimensions overflow, i.e. the header is corrupt).
    pub fn numel(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Shape in row-major (HF) order: ggml dims reversed.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed, memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    /// The file.
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key/values.
    pub metadata: HashMap<String, GgufValue>,
    /// Tensor infos, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    data_start: usize,
    map: Mmap,
}

/// Bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], FormatError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            FormatError::gguf(
                self.path,
                format!("truncated: needs {n} bytes for {what} at offset {}, file has {}", self.pos, self.buf.len()),
            )
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], FormatError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn len(&mut self, what: &str) -> Result<usize, FormatError> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| FormatError::gguf(self.path, format!("{what}: length {n} too large")))
    }

    fn string(&mut self, what: &str) -> Result<String, FormatError> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| FormatError::gguf(self.path, format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<GgufValue, FormatError> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => GgufValue::Bool(self.array::<1>(what)?[0] != 0),
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(FormatError::gguf(self.path, format!("{what}: arrays nested too deep")));
                }
                let elem = self.u32(what)?;
                let n = self.len(what)?;
                // Every element takes at least one byte, so a count beyond the remaining
                // bytes is corrupt; checking first avoids a huge allocation.
                if n > self.buf.len() - self.pos {
                    return Err(FormatError::gguf(
                        self.path,
                        format!("{what}: array of {n} elements exceeds the file size (truncated?)"),
                    ));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem, what, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(FormatError::gguf(self.path, format!("{what}: unknown metadata value type {other}")));
            }
        })
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: read-only map of a model file that is not modified while in use.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        let mut c = Cursor { buf: &map, pos: 0, path };
        let magic = c.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(FormatError::gguf(
                path,
                format!("bad magic {magic:#010x} (expected \"GGUF\"); not a GGUF file"),
            ));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => return Err(FormatError::gguf(path, "GGUF version 1 is not supported (only 2 and 3)")),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(FormatError::gguf(path, "big-endian GGUF files are not supported"));
            }
            v => return Err(FormatError::gguf(path, format!("unsupported GGUF version {v} (only 2 and 3)"))),
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        if n_tensors > map.len() {
            return Err(FormatError::gguf(path, format!("tensor count {n_tensors} exceeds the file size")));
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(FormatError::gguf(path, format!("tensor {name:?} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ggml_type = c.u32(&name)?;
            let offset = c.u64(&name)?;
            tensors.push(GgufTensorInfo { name, dims, ggml_type, offset });
        }
        let alignment = metadata.get("general.alignment").and_then(GgufValue::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(FormatError::gguf(path, format!("general.alignment {alignment} is not a power of two")));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let gguf = Self { path: path.to_path_buf(), version, metadata, tensors, data_start: data_start as usize, map };
        for t in &gguf.tensors {
            // Validates sizes and bounds of every tensor up front.
            if let Some(ty) = GgufType::from_id(t.ggml_type) {
                gguf.tensor_bytes(t, ty)?;
            }
        }
        Ok(gguf)
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The tensor info named `name`.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor of type `ty`, bounds-checked against the file.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo, ty: GgufType) -> Result<&[u8], FormatError> {
        let numel = t.numel().ok_or_else(|| {
            FormatError::gguf(&self.path, format!("tensor {:?}: dimensions {:?} overflow", t.name, t.dims))
        })?;
        let be = ty.block_elems() as u64;
        if !t.dims[0].is_multiple_of(be) {
            return Err(FormatError::gguf(
                &self.path,
                format!("tensor {:?}: row length {} is not a multiple of the block size {be}", t.name, t.dims[0]),
            ));
        }
        let size = (numel / be).checked_mul(ty.block_bytes() as u64);
        let start = (self.data_start as u64).checked_add(t.offset);
        let end = match (start, size) {
            (Some(s), Some(n)) => s.checked_add(n),
            _ => None,
        };
        match (start, end) {
            (Some(s), Some(e)) if e <= self.map.len() as u64 => Ok(&self.map[s as usize..e as usize]),
            _ => Err(FormatError::gguf(
                &self.path,
                format!(
                    "tensor {:?} (offset {}, {} elements) extends past the end of the file ({} bytes); truncated?",
                    t.name,
                    t.offset,
                    numel,
                    self.map.len()
                ),
            )),
        }
    }
}
