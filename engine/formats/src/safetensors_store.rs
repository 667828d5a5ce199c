//! Memory-mapped safetensors weights, single file or sharded (`model.safetensors.index.json`).
//! Headers are parsed once at open (the `safetensors` crate validates offsets and that the
//! file is exactly as long as its header says, which catches truncation); `get` then
//! borrows straight from the map.

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
        Ok(Self { maps, files: files.to_vec(), entries })
    }

    /// Fails if a tensor `config` needs has a dtype other than F32/F16/BF16.
    pub fn check_dtypes(&self, config: &ModelConfig) -> Result<(), FormatError> {
        for (name, _) in config.expected_tensors() {
            if let Some(Entry { dtype: Err(d), shard, .. }) = self.entries.get(&name) {
                return Err(FormatError::unsupported(
                    &self.files[*shard],
                    format!("tensor {name:?} has dtype {d:?} (supported: F32, F16, BF16)"),
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

impl WeightStore for SafetensorsStore {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let e = self.entry(name)?;
        let dtype = e
            .dtype
            .map_err(|d| FormatError::unsupported(&self.files[e.shard], format!("tensor {name:?} has dtype {d:?}")))?;
        Ok(TensorView {
            name: name.to_string(),
            shape: e.shape.clone(),
            dtype,
            bytes: std::borrow::Cow::Borrowed(&self.maps[e.shard][e.start..e.end]),
        })
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.entries.keys().cloned().collect();
        v.sort();
        v
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        Ok(self.entry(name)?.shape.clone())
    }
}
