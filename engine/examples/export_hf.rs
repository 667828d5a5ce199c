//! Exports any model Baton loads (GGUF, HF safetensors folder, dummy) as a Hugging Face
//! folder that `transformers.AutoModelForCausalLM.from_pretrained` reads, with exactly the
//! weights Baton's loader serves (GGUF tensors dequantized, Q/K rows in HF order). Used to
//! compare Baton with transformers on the default Q4_1 GGUF model, which transformers
//! cannot read without the `gguf` package (see `scripts/golden/smollm2-gpu.sh`).
//!
//! Usage:
//!   export_hf MODEL_PATH OUT_DIR [--dtype f32|bf16] [--force] [--load-format auto|gguf|safetensors|dummy]
//!
//! OUT_DIR must be missing or empty unless `--force` (see `baton_formats::export`).

use std::path::PathBuf;

use baton_formats::{ExportDType, ExportOptions, LoadFormat, export_hf, load_model};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const USAGE: &str =
    "usage: export_hf MODEL_PATH OUT_DIR [--dtype f32|bf16] [--force] [--load-format auto|gguf|safetensors|dummy]";

fn main() {
    if let Err(e) = real_main() {
        eprintln!("export_hf: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Res<()> {
    let mut positional = Vec::new();
    let mut opts = ExportOptions::default();
    let mut format = LoadFormat::Auto;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dtype" => opts.dtype = args.next().ok_or("--dtype needs a value")?.parse::<ExportDType>()?,
            "--load-format" => format = args.next().ok_or("--load-format needs a value")?.parse::<LoadFormat>()?,
            "--force" => opts.force = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            f if f.starts_with("--") => return Err(format!("unknown flag {f}\n{USAGE}").into()),
            _ => positional.push(PathBuf::from(a)),
        }
    }
    let [model_path, out_dir] = positional.as_slice() else {
        return Err(USAGE.into());
    };
    let t0 = std::time::Instant::now();
    let model = load_model(model_path, format)?;
    let summary = export_hf(&model, out_dir, &opts)?;
    let c = &model.config;
    println!(
        "{} -> {}: {} tensors, {:.1} MB {}, {} layers, hidden {}, vocab {}, tokenizer {}, {:.1} s",
        model_path.display(),
        out_dir.display(),
        summary.tensors,
        summary.tensor_bytes as f64 / 1e6,
        opts.dtype.torch_name(),
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        if summary.tokenizer { "yes" } else { "no" },
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
