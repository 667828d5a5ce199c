//! Memory-mapped safetensors weights, single file or sharded (`model.safetensors.index.json`).
//! Headers are parsed once at open (the `safetensors` crate validates offsets and that the
//! file is exactly as long as its header says, which catches truncation); `get` then
//! borrows straight from the map.
//!
//! MXFP4 pairs (`W_blocks` + `W_scales`, both `u8`, with no `W` beside them) are served as
//! the bf16 tensor `W` they dequantize to ([`crate::mxfp4`]), computed when `W` is read; the
//! pair's own names are not listed.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::config::{ModelConfig, read_json};
use crate::error::FormatError;
use crate::tensor::{DType, TensorView, WeightStore};

/// Where one tensor lives.
#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: Result<DType, Dtype>,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// Weights served from one or more memory-mapped safetensors files.
#[derive(Debug)]
pub struct SafetensorsStore {
    maps: Vec<Mmap>,
    files: Vec<PathBuf>,
    entries: HashMap<String, Entry>,
    /// MXFP4 tensors: the name served → its dequantized shape.
    mxfp4: HashMap<String, Vec<usize>>,
}

impl SafetensorsStore {
    /// Opens every shard of the model in `dir`: the files listed by
    /// `model.safetensors.index.json` when present, else every `*.safetensors` file.
    pub fn open_dir(dir: &Path) -> Result<Self, FormatError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.is_file() {
            let v = read_json(&index)?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| FormatError::Json { path: index.clone(), message: "no \"weight_map\" object".into() })?;
            let mut set = BTreeSet::new();
            for f in map.values() {
                let f = f.as_str().ok_or_else(|| FormatError::Json {
                    path: index.clone(),
                    message: "weight_map values must be file names".into(),
                })?;
                set.insert(dir.join(f));
            }
            set.into_iter().collect()
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| FormatError::io(dir, e))?;
            let mut v = Vec::new();
            for e in rd {
                let p = e.map_err(|e| FormatError::io(dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") {
                    v.push(p);
                }
            }
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(FormatError::Safetensors {
                path: dir.to_path_buf(),
                message: "no *.safetensors files in the model folder".into(),
            });
        }
        Self::open_files(&files)
    }

    /// Opens the given shard files.
    pub fn open_files(files: &[PathBuf]) -> Result<Self, FormatError> {
        let mut maps = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for (shard, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
            // SAFETY: the map is read-only and the model files are not modified while
            // the server runs; a concurrent truncation by another process is outside
            // what any loader can defend against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| FormatError::Safetensors {
                path: path.clone(),
                message: format!("{e} (file is {} bytes; truncated or corrupt?)", map.len()),
            })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let dtype = match info.dtype {
                    Dtype::F32 => Ok(DType::F32),
                    Dtype::F16 => Ok(DType::F16),
                    Dtype::BF16 => Ok(DType::BF16),
                    Dtype::F8_E4M3 => Ok(DType::F8E4M3),
                    other => Err(other),
                };
                let entry = Entry {
                    shard,
                    dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(FormatError::Safetensors {
                        path: path.clone(),
                        message: format!("tensor {name:?} appears in more than one shard"),
                    });
                }
            }
            maps.push(map);
        }
        let mxfp4 = mxfp4_pairs(&entries).map_err(|message| FormatError::Safetensors {
            path: files.first().cloned().unwrap_or_default(),
            message,
        })?;
        Ok(Self { maps, files: files.to_vec(), entries, mxfp4 })
    }

    /// The bytes of an entry.
    fn bytes(&self, e: &Entry) -> &[u8] {
        &self.maps[e.shard][e.start..e.end]
    }

    /// Fails if a tensor `config` needs has a dtype other than F32/F16/BF16 (or F8_E4M3, which
    /// [`crate::check_fp8_weights`] checks against the config's quantization).
    pub fn check_dtypes(&self, config: &ModelConfig) -> Result<(), FormatError> {
        for (name, _) in config.expected_tensors() {
            if let Some(Entry { dtype: Err(d), shard, .. }) = self.entries.get(&name) {
                return Err(FormatError::unsupported(
                    &self.files[*shard],
                    format!("tensor {name:?} has dtype {d:?} (supported: F32, F16, BF16, F8_E4M3)"),
                ));
            }
        }
        Ok(())
    }

    fn entry(&self, name: &str) -> Result<&Entry, FormatError> {
        self.entries.get(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.files.first().cloned().unwrap_or_default(),
            name: name.to_string(),
        })
    }
}

/// The MXFP4 tensors among `entries`: each `W_blocks` of type u8 with a `W_scales` of type u8
/// and no `W`, mapped to `W`'s dequantized shape.
fn mxfp4_pairs(entries: &HashMap<String, Entry>) -> Result<HashMap<String, Vec<usize>>, String> {
    let mut pairs = HashMap::new();
    for (name, blocks) in entries {
        let Some(base) = name.strip_suffix("_blocks") else { continue };
        let Some(scales) = entries.get(&format!("{base}_scales")) else { continue };
        if blocks.dtype != Err(Dtype::U8) || scales.dtype != Err(Dtype::U8) || entries.contains_key(base) {
            continue;
        }
        let shape = crate::mxfp4::dequantized_shape(&blocks.shape, &scales.shape)
            .map_err(|m| format!("tensor {base:?}: {m}"))?;
        pairs.insert(base.to_owned(), shape);
    }
    Ok(pairs)
}

impl WeightStore for SafetensorsStore {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        if let Some(shape) = self.mxfp4.get(name) {
            let (blocks, scales) = (self.entry(&format!("{name}_blocks"))?, self.entry(&format!("{name}_scales"))?);
            let bytes = crate::mxfp4::dequantize_bf16(
                &self.files[blocks.shard],
                name,
                self.bytes(blocks),
                &blocks.shape,
                self.bytes(scales),
                &scales.shape,
            )?;
            return Ok(TensorView {
                name: name.to_string(),
                shape: shape.clone(),
                dtype: DType::BF16,
                bytes: std::borrow::Cow::Owned(bytes),
            });
        }
        let e = self.entry(name)?;
        let dtype = e
            .dtype
            .map_err(|d| FormatError::unsupported(&self.files[e.shard], format!("tensor {name:?} has dtype {d:?}")))?;
        Ok(TensorView {
            name: name.to_string(),
            shape: e.shape.clone(),
            dtype,
            bytes: std::borrow::Cow::Borrowed(self.bytes(e)),
        })
    }

    fn names(&self) -> Vec<String> {
        let pair_part = |n: &str| {
            [n.strip_suffix("_blocks"), n.strip_suffix("_scales")]
                .into_iter()
                .flatten()
                .any(|b| self.mxfp4.contains_key(b))
        };
        let mut v: Vec<String> =
            self.entries.keys().filter(|n| !pair_part(n)).chain(self.mxfp4.keys()).cloned().collect();
        v.sort();
        v
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        match self.mxfp4.get(name) {
            Some(shape) => Ok(shape.clone()),
            None => Ok(self.entry(name)?.shape.clone()),
        }
    }
}
