//! Prints a GGUF file's metadata (long arrays abbreviated) and tensor table:
//! `cargo run -p baton-formats --example inspect_gguf -- FILE.gguf`.

use std::path::PathBuf;

use baton_formats::gguf::reader::ggml_type_name;
use baton_formats::gguf::{GgufFile, GgufValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = std::env::args_os().nth(1).ok_or("usage: inspect_gguf FILE.gguf")?.into();
    let g = GgufFile::open(&path)?;
    println!("version {}, {} tensors", g.version, g.tensors.len());
    let mut keys: Vec<_> = g.metadata.keys().collect();
    keys.sort();
    for k in keys {
        match &g.metadata[k] {
            GgufValue::Array(a) => println!("{k} = [{} items] first: {:?}", a.len(), &a[..a.len().min(8)]),
            GgufValue::String(s) if s.len() > 200 => println!("{k} = {:?}...", &s[..200]),
            v => println!("{k} = {v:?}"),
        }
    }
    for t in g.tensors.iter().take(20) {
        println!("{} {:?} {}", t.name, t.dims, ggml_type_name(t.ggml_type));
    }
    Ok(())
}
