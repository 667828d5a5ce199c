//! What constrained decoding costs on this machine for the default model's tokenizer
//! (SmolLM2, 49,152 ids): building the compiler, compiling grammars of several sizes, and
//! the per-token mask (µs/token) walking real documents.
//!
//! `cargo run -p baton-grammar --example mask_cost [--release]`

use std::time::Instant;

use baton_core::structured::GrammarSpec;
use baton_formats::testing::default_model_path;
use baton_formats::{LoadFormat, load_model_info};
use baton_grammar::GrammarCompiler;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let info = load_model_info(&default_model_path(), LoadFormat::Auto)?;
    let tok = info.tokenizer.ok_or("the default model has no tokenizer")?;
    let t0 = Instant::now();
    let compiler = GrammarCompiler::new(&tok, &info.generation.eos_token_ids, info.config.vocab_size)?;
    println!("compiler (trie of {} ids): {:.1} ms", info.config.vocab_size, t0.elapsed().as_secs_f64() * 1e3);

    let person = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}
        },
        "required": ["name", "age", "email", "tags", "address"]
    });
    let doc = r#"{"name":"Ada Lovelace, Countess of Lovelace","age":36,"email":"ada@example.com","tags":["mathematician","writer","first programmer"],"address":{"street":"12 St James's Square, London","zip":"12345"}}"#;
    let cases = [
        ("json_schema (person)", GrammarSpec::JsonSchema(person.to_string()), doc.to_string()),
        ("json_object", GrammarSpec::JsonObject, doc.to_string()),
        (
            "regex (date list)",
            GrammarSpec::Regex(r"(\d{4}-\d{2}-\d{2}, )*\d{4}-\d{2}-\d{2}".into()),
            "2024-01-02, 2025-12-31, 1999-07-04".into(),
        ),
        (
            "lark (arithmetic)",
            GrammarSpec::Lark(
                "start: expr\nexpr: term ((\"+\"|\"-\") term)*\nterm: NUM | \"(\" expr \")\"\nNUM: /[0-9]+/".into(),
            ),
            "(12+(3-4))+567-(8+9)".into(),
        ),
    ];
    for (name, spec, text) in cases {
        let t0 = Instant::now();
        let g = compiler.compile(&spec)?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let ids = tok.encode(&text, false)?;
        let mut m = g.matcher();
        let (mut mask_us, mut consume_us) = (0.0, 0.0);
        for &id in &ids {
            let t = Instant::now();
            let mask = m.mask()?;
            mask_us += t.elapsed().as_secs_f64() * 1e6;
            assert!(mask.allows(id), "{name}: token {id} refused");
            let t = Instant::now();
            m.consume(id)?;
            consume_us += t.elapsed().as_secs_f64() * 1e6;
        }
        let n = ids.len() as f64;
        println!(
            "{name:24} compile {compile_ms:7.2} ms  mask {:7.1} µs/token  consume {:5.1} µs/token  ({} tokens)",
            mask_us / n,
            consume_us / n,
            ids.len()
        );
    }
    for n in [100, 1000, 3000] {
        let props: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|i| {
                (format!("field_{i}"), serde_json::json!({"type": "string", "pattern": format!("^x{i}[a-f]{{4,12}}$")}))
            })
            .collect();
        let spec = GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "properties": props}).to_string());
        let t0 = Instant::now();
        let ok = compiler.compile(&spec).is_ok();
        println!(
            "json_schema of {n} patterned properties: compile {:.1} ms (ok: {ok})",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}
