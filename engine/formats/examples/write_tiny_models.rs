//! Writes the golden tiny models as HF folders:
//! `cargo run -p baton-formats --example write_tiny_models -- OUT_DIR` creates
//! OUT_DIR/{llama,qwen2,tied}/ (see `TinySpec::golden_set`). The committed fixtures under
//! engine/formats/tests/fixtures/golden/ are this output plus scripts/golden's JSON.

use std::path::PathBuf;

use baton_formats::testing::{TinySpec, write_hf_folder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out: PathBuf = std::env::args_os().nth(1).ok_or("usage: write_tiny_models OUT_DIR")?.into();
    for (name, spec) in TinySpec::golden_set() {
        let dir = write_hf_folder(&out.join(name), &spec)?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}
