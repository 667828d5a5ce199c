//! FP8 weight quantization as checkpoints on the Hub describe it, and as Baton applies it at
//! load (`--quantization fp8`).
//!
//! Two Hub formats are read from `config.json`'s `quantization_config`:
//! - **HF / vLLM `fp8`** (`quant_method: "fp8"`): with `weight_block_size: [bn, bk]` each
//!   linear `W` (`F8_E4M3 [N, K]`) has `W_scale_inv` (`f32 [⌈N/bn⌉, ⌈K/bk⌉]`), without it a
//!   per-tensor `W_scale` (one value). `activation_scheme` must be `dynamic` (a static one
//!   carries input scales Baton does not apply); `modules_to_not_convert` lists modules kept
//!   in bf16 (matched as substrings of the module name, as transformers does).
//! - **compressed-tensors `float-quantized`** (`quant_method: "compressed-tensors"`): one config
//!   group targeting `Linear`, weights `{num_bits: 8, type: float, strategy: channel | tensor |
//!   block}` with `W_scale` `[N, 1]`, one value, or `[⌈N/bn⌉, ⌈K/bk⌉]`; input activations
//!   absent (weights only) or dynamic per token; `ignore` lists module names or `re:` regexes.
//!
//! A stored value is `code × scale` (the `_inv` in HF's name notwithstanding: it is what the
//! code is multiplied by). Invariants: every option is either mapped onto [`Quantization`] or
//! refused with [`FormatError::Unsupported`] naming the key; [`read_fp8_weight`] hands out only
//! scales that are finite, positive and of the right shape, refusing others naming the tensor.

use std::path::Path;

use serde_json::Value;

use crate::error::FormatError;
use crate::tensor::{DType, WeightStore};

/// Where a model's FP8 weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantSource {
    /// HF / vLLM `quant_method: "fp8"` checkpoint.
    HfFp8,
    /// compressed-tensors `float-quantized` checkpoint.
    CompressedTensors,
    /// A bf16/f16/f32 checkpoint quantized at load (`--quantization fp8`).
    AtLoad,
}

/// How one stored FP8 weight's scales are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8ScaleLayout {
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per output row (`[N, 1]`).
    PerChannel,
    /// One scale per `rows × cols` block (`[⌈N/rows⌉, ⌈K/cols⌉]`).
    Block {
        /// Output rows per block.
        rows: usize,
        /// Input columns per block.
        cols: usize,
    },
}

/// How activations entering an FP8 linear are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationQuant {
    /// Not at all: weights-only FP8 (W8A16).
    None,
    /// Dynamically, one scale per token (row): `amax(row) / 448`.
    DynamicPerToken,
}

/// A model's FP8 weight quantization.
#[derive(Debug, Clone)]
pub struct Quantization {
    /// Where it comes from.
    pub source: QuantSource,
    /// The stored weights' scale layout (at load: per channel).
    pub layout: Fp8ScaleLayout,
    /// The activations' quantization.
    pub activations: ActivationQuant,
    /// Modules kept unquantized: exact names (or, for HF, substrings) and regexes.
    ignore: Vec<IgnoreRule>,
}

impl PartialEq for Quantization {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
            && self.layout == other.layout
            && self.activations == other.activations
            && self.ignore.len() == other.ignore.len()
            && self.ignore.iter().zip(&other.ignore).all(|(a, b)| a.text() == b.text())
    }
}

impl Quantization {
    /// The scheme as part of a model fingerprint ([`crate::ModelConfig::fingerprint`]): where
    /// the FP8 weights come from, their scale layout, the activations' quantization and the
    /// modules kept unquantized. Two workers whose weights differ in any of these produce
    /// different KV for the same prompt, so they must not pair up.
    pub fn fingerprint(&self) -> String {
        let source = match self.source {
            QuantSource::HfFp8 => "hf",
            QuantSource::CompressedTensors => "ct",
            QuantSource::AtLoad => "atload",
        };
        let layout = match self.layout {
            Fp8ScaleLayout::PerTensor => "tensor".to_string(),
            Fp8ScaleLayout::PerChannel => "channel".to_string(),
            Fp8ScaleLayout::Block { rows, cols } => format!("block{rows}x{cols}"),
        };
        let acts = match self.activations {
            ActivationQuant::None => "w8a16",
            ActivationQuant::DynamicPerToken => "w8a8dyn",
        };
        let ignore: Vec<&str> = self.ignore.iter().map(IgnoreRule::text).collect();
        format!("fp8-{source}-{layout}-{acts}-ignore{ignore:?}")
    }
}

/// One entry of `ignore` / `modules_to_not_convert`.
#[derive(Debug, Clone)]
enum IgnoreRule {
    /// HF: the module is skipped when its name contains this.
    Substring(String),
    /// compressed-tensors: the module is skipped when its name is this.
    Exact(String),
    /// compressed-tensors `re:`: the module is skipped when the regex matches its name.
    Regex(regex::Regex),
}

impl IgnoreRule {
    fn text(&self) -> &str {
        match self {
            Self::Substring(s) | Self::Exact(s) => s,
            Self::Regex(r) => r.as_str(),
        }
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            Self::Substring(s) => module.contains(s.as_str()),
            Self::Exact(s) => module == s,
            Self::Regex(r) => r.find(module).is_some_and(|m| m.start() == 0 && m.end() == module.len()),
        }
    }
}

impl Quantization {
    /// Quantizing a bf16 checkpoint at load: per-channel weight scales, dynamic per-token
    /// activation scales.
    pub fn at_load() -> Self {
        Self {
            source: QuantSource::AtLoad,
            layout: Fp8ScaleLayout::PerChannel,
            activations: ActivationQuant::DynamicPerToken,
            ignore: Vec::new(),
        }
    }

    /// Parses a `config.json`'s `quantization_config` (see the module docs); `path` names the
    /// file in errors.
    pub fn from_hf(q: &Value, path: &Path) -> Result<Self, FormatError> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
        match method {
            "fp8" => Self::from_hf_fp8(q, path),
            "compressed-tensors" => Self::from_compressed_tensors(q, path),
            _ => Err(FormatError::unsupported(
                path,
                format!("quantization_config.quant_method {method:?} (implemented: \"fp8\", \"compressed-tensors\")"),
            )),
        }
    }

    fn from_hf_fp8(q: &Value, path: &Path) -> Result<Self, FormatError> {
        let unsupported = |m: String| FormatError::unsupported(path, format!("quantization_config.{m}"));
        match q.get("activation_scheme").filter(|a| !a.is_null()) {
            None => {}
            Some(a) if a.as_str() == Some("dynamic") => {}
            Some(a) => return Err(unsupported(format!("activation_scheme {a} (implemented: \"dynamic\")"))),
        }
        if let Some(fmt) = q.get("fmt").filter(|f| !f.is_null() && f.as_str() != Some("e4m3")) {
            return Err(unsupported(format!("fmt {fmt} (implemented: \"e4m3\")")));
        }
        let layout = match q.get("weight_block_size").filter(|b| !b.is_null()) {
            None => Fp8ScaleLayout::PerTensor,
            Some(b) => block_size(b).ok_or_else(|| {
                FormatError::config(path, format!("quantization_config.weight_block_size {b} must be [rows, cols] > 0"))
            })?,
        };
        let ignore = string_list(q.get("modules_to_not_convert"), path, "modules_to_not_convert")?
            .into_iter()
            .map(IgnoreRule::Substring)
            .collect();
        Ok(Self { source: QuantSource::HfFp8, layout, activations: ActivationQuant::DynamicPerToken, ignore })
    }

    fn from_compressed_tensors(q: &Value, path: &Path) -> Result<Self, FormatError> {
        let unsupported = |m: String| FormatError::unsupported(path, format!("quantization_config.{m}"));
        match q.get("format").and_then(Value::as_str) {
            Some("float-quantized") => {}
            _ => {
                let f = q.get("format").cloned().unwrap_or(Value::Null);
                return Err(unsupported(format!("format {f} (implemented: \"float-quantized\")")));
            }
        }
        if let Some(kv) = q.get("kv_cache_scheme").filter(|k| !k.is_null()) {
            return Err(unsupported(format!("kv_cache_scheme {kv} (use --kv-cache-dtype fp8)")));
        }
        let groups = q
            .get("config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| FormatError::config(path, "quantization_config.config_groups must be an object"))?;
        let [(name, group)] = groups.iter().collect::<Vec<_>>()[..] else {
            return Err(unsupported(format!("config_groups with {} groups (implemented: one)", groups.len())));
        };
        let key = |k: &str| format!("config_groups.{name}.{k}");
        let targets = string_list(group.get("targets"), path, &key("targets"))?;
        if targets != ["Linear"] {
            return Err(unsupported(format!("{} {targets:?} (implemented: [\"Linear\"])", key("targets"))));
        }
        let weights = group
            .get("weights")
            .filter(|w| !w.is_null())
            .ok_or_else(|| FormatError::config(path, format!("quantization_config.{} is missing", key("weights"))))?;
        check_float8(weights, path, &key("weights"))?;
        if weights.get("dynamic").and_then(Value::as_bool) == Some(true) {
            return Err(unsupported(format!("{}.dynamic true", key("weights"))));
        }
        let layout = match weights.get("strategy").and_then(Value::as_str) {
            Some("tensor") => Fp8ScaleLayout::PerTensor,
            Some("channel") => Fp8ScaleLayout::PerChannel,
            Some("block") => {
                let b = weights.get("block_structure").cloned().unwrap_or(Value::Null);
                block_size(&b).ok_or_else(|| {
                    FormatError::config(path, format!("quantization_config.{}.block_structure {b}", key("weights")))
                })?
            }
            _ => {
                let s = weights.get("strategy").cloned().unwrap_or(Value::Null);
                return Err(unsupported(format!(
                    "{}.strategy {s} (implemented: \"tensor\", \"channel\", \"block\")",
                    key("weights")
                )));
            }
        };
        let activations = match group.get("input_activations").filter(|a| !a.is_null()) {
            None => ActivationQuant::None,
            Some(a) => {
                check_float8(a, path, &key("input_activations"))?;
                if a.get("dynamic").and_then(Value::as_bool) != Some(true) {
                    return Err(unsupported(format!(
                        "{}.dynamic {} (static input scales are not implemented)",
                        key("input_activations"),
                        a.get("dynamic").cloned().unwrap_or(Value::Null)
                    )));
                }
                if a.get("strategy").and_then(Value::as_str) != Some("token") {
                    let s = a.get("strategy").cloned().unwrap_or(Value::Null);
                    return Err(unsupported(format!(
                        "{}.strategy {s} (implemented: \"token\")",
                        key("input_activations")
                    )));
                }
                ActivationQuant::DynamicPerToken
            }
        };
        if let Some(o) = group.get("output_activations").filter(|o| !o.is_null()) {
            return Err(unsupported(format!("{} {o}", key("output_activations"))));
        }
        let ignore = string_list(q.get("ignore"), path, "ignore")?
            .into_iter()
            .map(|s| match s.strip_prefix("re:") {
                Some(re) => regex::Regex::new(re)
                    .map(IgnoreRule::Regex)
                    .map_err(|e| FormatError::config(path, format!("quantization_config.ignore regex {re:?}: {e}"))),
                None => Ok(IgnoreRule::Exact(s)),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { source: QuantSource::CompressedTensors, layout, activations, ignore })
    }

    /// Whether the module of weight `weight_name` (`….q_proj.weight` → `….q_proj`) stays
    /// unquantized.
    pub fn skips(&self, weight_name: &str) -> bool {
        let module = weight_name.strip_suffix(".weight").unwrap_or(weight_name);
        self.ignore.iter().any(|r| r.matches(module))
    }

    /// The name of the scale tensor of FP8 weight `weight_name`.
    pub fn scale_name(&self, weight_name: &str) -> String {
        let suffix = match (&self.source, self.layout) {
            (QuantSource::HfFp8, Fp8ScaleLayout::Block { .. }) => "_scale_inv",
            _ => "_scale",
        };
        format!("{weight_name}{suffix}")
    }

    /// The scale shape this layout requires for a `rows × cols` weight, and the number of
    /// scale values.
    fn scale_count(&self, rows: usize, cols: usize) -> (usize, usize) {
        match self.layout {
            Fp8ScaleLayout::PerTensor => (1, 1),
            Fp8ScaleLayout::PerChannel => (rows, 1),
            Fp8ScaleLayout::Block { rows: br, cols: bc } => (rows.div_ceil(br), cols.div_ceil(bc)),
        }
    }
}

/// `[rows, cols]`, both positive.
fn block_size(b: &Value) -> Option<Fp8ScaleLayout> {
    let a = b.as_array()?;
    match a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>()?[..] {
        [r, c] if r > 0 && c > 0 => Some(Fp8ScaleLayout::Block { rows: r as usize, cols: c as usize }),
        _ => None,
    }
}

/// A list of strings (null or absent: empty).
fn string_list(v: Option<&Value>, path: &Path, key: &str) -> Result<Vec<String>, FormatError> {
    match v.filter(|v| !v.is_null()) {
        None => Ok(Vec::new()),
        Some(list) => list
            .as_array()
            .and_then(|a| a.iter().map(|s| s.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| FormatError::config(path, format!("quantization_config.{key} must be a list of strings"))),
    }
}

/// A compressed-tensors quantization args object describing 8-bit floats, symmetric.
fn check_float8(args: &Value, path: &Path, key: &str) -> Result<(), FormatError> {
    let bits = args.get("num_bits").and_then(Value::as_u64);
    let kind = args.get("type").and_then(Value::as_str);
    if bits != Some(8) || kind != Some("float") {
        return Err(FormatError::unsupported(
            path,
            format!("quantization_config.{key} num_bits {bits:?} type {kind:?} (implemented: 8-bit float)"),
        ));
    }
    if args.get("symmetric").and_then(Value::as_bool) == Some(false) {
        return Err(FormatError::unsupported(path, format!("quantization_config.{key}.symmetric false")));
    }
    Ok(())
}

/// The value of E4M3 (`e4m3fn`) code `code`: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
/// `S.1111.111` is NaN; no infinities.
pub fn e4m3_value(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0x0F);
    let mant = f32::from(code & 0x07);
    if exp == 0x0F && mant == 7.0 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 { mant / 8.0 * 2f32.powi(-6) } else { (1.0 + mant / 8.0) * 2f32.powi(exp - 7) };
    sign * magnitude
}

/// One FP8 weight as stored: its codes and validated scales.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Weight {
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// `rows × cols` E4M3 codes, row-major.
    pub codes: Vec<u8>,
    /// The scales (see [`Fp8Weight::layout`]): finite and positive.
    pub scales: Vec<f32>,
    /// How `scales` map onto the codes.
    pub layout: Fp8ScaleLayout,
}

impl Fp8Weight {
    /// The scale of element (`row`, `col`).
    pub fn scale_at(&self, row: usize, col: usize) -> f32 {
        match self.layout {
            Fp8ScaleLayout::PerTensor => self.scales[0],
            Fp8ScaleLayout::PerChannel => self.scales[row],
            Fp8ScaleLayout::Block { rows, cols } => self.scales[(row / rows) * self.cols.div_ceil(cols) + col / cols],
        }
    }

    /// The values the codes stand for, `code × scale` in f32 (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.codes.len());
        for (r, row) in self.codes.chunks_exact(self.cols.max(1)).enumerate() {
            out.extend(row.iter().enumerate().map(|(c, &code)| e4m3_value(code) * self.scale_at(r, c)));
        }
        out
    }
}

/// Reads FP8 weight `name` (`F8_E4M3 [rows, cols]`) and its scale tensor as `q` names and
/// shapes it. A scale of the wrong shape, or one that is NaN, infinite, zero or negative, is
/// refused naming the scale tensor; so is a weight that is not F8_E4M3 of that shape.
pub fn read_fp8_weight(
    store: &dyn WeightStore,
    q: &Quantization,
    name: &str,
    rows: usize,
    cols: usize,
    path: &Path,
) -> Result<Fp8Weight, FormatError> {
    let w = store.get(name)?;
    if w.dtype != DType::F8E4M3 || w.shape != [rows, cols] || w.bytes.len() != rows * cols {
        return Err(FormatError::unsupported(
            path,
            format!("tensor {name:?} is {:?} {:?}, expected F8_E4M3 [{rows}, {cols}]", w.dtype, w.shape),
        ));
    }
    let scales = read_fp8_scales(store, q, name, rows, cols, path)?;
    Ok(Fp8Weight { rows, cols, codes: w.bytes.into_owned(), scales, layout: q.layout })
}

/// The validated scales of FP8 weight `name` (`rows × cols`), as [`read_fp8_weight`] checks
/// them, without reading the weight itself (what [`crate::load_model`] checks up front).
pub fn read_fp8_scales(
    store: &dyn WeightStore,
    q: &Quantization,
    name: &str,
    rows: usize,
    cols: usize,
    path: &Path,
) -> Result<Vec<f32>, FormatError> {
    let scale_name = q.scale_name(name);
    let s = store
        .get(&scale_name)
        .map_err(|_| FormatError::MissingTensor { path: path.to_path_buf(), name: scale_name.clone() })?;
    let (sr, sc) = q.scale_count(rows, cols);
    let shape_ok = match q.layout {
        // One value: `[]`, `[1]` or `[1, 1]`.
        Fp8ScaleLayout::PerTensor => s.numel() == 1 && s.shape.len() <= 2,
        // `[N, 1]`, or `[N]` as some exporters write it.
        Fp8ScaleLayout::PerChannel => s.shape == [sr, 1] || s.shape == [sr],
        Fp8ScaleLayout::Block { .. } => s.shape == [sr, sc],
    };
    if !shape_ok || s.dtype == DType::F8E4M3 {
        return Err(FormatError::unsupported(
            path,
            format!(
                "scale tensor {scale_name:?} is {:?} {:?}, expected a float tensor of {sr}×{sc} values ({:?} scales)",
                s.dtype, s.shape, q.layout
            ),
        ));
    }
    let scales = s.to_f32();
    if let Some((i, bad)) = scales.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
        return Err(FormatError::unsupported(
            path,
            format!("scale tensor {scale_name:?} holds {bad} at index {i} (scales must be finite and positive)"),
        ));
    }
    Ok(scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(q: Value) -> Result<Quantization, FormatError> {
        Quantization::from_hf(&q, Path::new("config.json"))
    }

    #[test]
    fn hf_fp8_block_and_per_tensor() {
        let q = parse(json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "mlp.gate"]}))
        .expect("parses");
        assert_eq!(q.layout, Fp8ScaleLayout::Block { rows: 128, cols: 128 });
        assert_eq!(q.scale_name("a.q_proj.weight"), "a.q_proj.weight_scale_inv");
        assert!(q.skips("model.layers.0.mlp.gate.weight") && !q.skips("model.layers.0.mlp.up_proj.weight"));
        let q = parse(json!({"quant_method": "fp8"})).expect("parses");
        assert_eq!((q.layout, q.activations), (Fp8ScaleLayout::PerTensor, ActivationQuant::DynamicPerToken));
        assert_eq!(q.scale_name("a.o_proj.weight"), "a.o_proj.weight_scale");
    }

    #[test]
    fn compressed_tensors_channel_with_regex_ignore() {
        let q = parse(json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
            "ignore": ["lm_head", "re:.*layers\\.1\\..*"]}))
        .expect("parses");
        assert_eq!((q.layout, q.activations), (Fp8ScaleLayout::PerChannel, ActivationQuant::DynamicPerToken));
        assert!(q.skips("lm_head.weight"));
        assert!(q.skips("model.layers.1.self_attn.q_proj.weight"));
        assert!(!q.skips("model.layers.0.self_attn.q_proj.weight"));
        assert_eq!(q.scale_name("x.weight"), "x.weight_scale");
    }

    #[test]
    fn unsupported_options_are_refused_by_name() {
        let ct = |group: Value| json!({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}});
        let w = json!({"num_bits": 8, "type": "float", "strategy": "channel"});
        let cases = [
            (json!({"quant_method": "awq"}), "quant_method \"awq\""),
            (json!({"quant_method": "fp8", "activation_scheme": "static"}), "activation_scheme"),
            (json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}), "format"),
            (
                ct(json!({"targets": ["Linear"], "weights": w, "input_activations":
                    {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false}})),
                "input_activations.dynamic",
            ),
            (
                ct(json!({"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}})),
                "weights num_bits",
            ),
            (
                ct(json!({"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group"}})),
                "weights.strategy",
            ),
            (ct(json!({"targets": ["Attention"], "weights": w})), "targets"),
        ];
        for (q, needle) in cases {
            let err = parse(q.clone()).expect_err("refused").to_string();
            assert!(err.contains(needle), "{q}: {err}");
        }
    }

    #[test]
    fn e4m3_values_match_the_format() {
        assert_eq!(e4m3_value(0x00), 0.0);
        assert_eq!(e4m3_value(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_value(0x38), 1.0);
        assert_eq!(e4m3_value(0x7E), 448.0);
        assert_eq!(e4m3_value(0xFE), -448.0);
        assert!(e4m3_value(0x7F).is_nan() && e4m3_value(0xFF).is_nan());
        assert_eq!(e4m3_value(0x3C), 1.5);
    }
}
