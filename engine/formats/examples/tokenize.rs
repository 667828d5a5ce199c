//! Prints the token ids of each argument under a model's tokenizer:
//! `cargo run -p baton-formats --example tokenize -- MODEL TEXT...` (MODEL: .gguf or HF folder).

use std::path::PathBuf;

use baton_formats::{LoadFormat, load_model_info};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model: PathBuf = args.next().ok_or("usage: tokenize MODEL TEXT...")?.into();
    let info = load_model_info(&model, LoadFormat::Auto)?;
    let tok = info.tokenizer.ok_or("the model has no tokenizer")?;
    for text in args {
        let ids = tok.encode(&text, false)?;
        let pieces: Vec<String> = ids.iter().filter_map(|&i| tok.id_to_token(i)).collect();
        println!("{text:?}\n  ids: {ids:?}\n  pieces: {pieces:?}");
    }
    Ok(())
}
