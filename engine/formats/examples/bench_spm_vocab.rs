//! How long a GGUF SentencePiece vocabulary takes to become a tokenizer at start-up
//! (`SpmVocab::build`), at the sizes real files carry (Llama 2 / Mistral 32k, Gemma 256k).
//!
//! The vocabularies are synthetic but shaped like trained ones: 256 byte pieces, then every
//! string over a 12-character alphabet, shortest first, scored in that order, so that a piece
//! splits into in-vocabulary halves at most positions (a Gemma-size vocabulary then ranks
//! about a million merges).
//!
//! Usage: `bench_spm_vocab OUT.json [SIZES]` (default `32000,256000`); writes one JSON with the
//! pieces, merges and build seconds for each size, `SpmVocab::build` (the BPE model built
//! directly) beside `SpmVocab::build_from_json` (through the `tokenizer.json` document) in the
//! same run (a benchmark program, not a test).

use std::time::Instant;

use baton_formats::tokenizer::SpmVocab;

fn vocab(size: usize) -> SpmVocab {
    let mut pieces: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    let mut types = vec![6i64; 256];
    // Every string over a small alphabet, shortest first: a trained vocabulary's short pieces
    // are (nearly) all present, so a longer piece splits into in-vocabulary halves at most of
    // its positions, which is what makes the merge list several times the vocabulary.
    let alphabet: Vec<char> = "▁etaoinsrhlu".chars().collect();
    let mut level: Vec<String> = vec![String::new()];
    'grow: loop {
        let mut next_level = Vec::new();
        for p in &level {
            for c in &alphabet {
                if pieces.len() == size {
                    break 'grow;
                }
                let piece = format!("{p}{c}");
                pieces.push(piece.clone());
                types.push(1);
                next_level.push(piece);
            }
        }
        level = next_level;
    }
    let scores = (0..pieces.len()).map(|i| -(i as f32)).collect();
    SpmVocab { pieces, scores, types, bos: None, add_bos: false, add_space_prefix: true }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let out = args.get(1).cloned().unwrap_or_else(|| "bench_spm_vocab.json".into());
    let sizes: Vec<usize> =
        args.get(2).map_or("32000,256000", String::as_str).split(',').map(str::parse).collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    for size in sizes {
        let v = vocab(size);
        let t0 = Instant::now();
        let merges = v.merges().len();
        let merges_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let tok = v.build("bench")?;
        let build_s = t1.elapsed().as_secs_f64();
        let ids = tok.encode("▁the▁quick▁brown▁fox", false).map_err(|e| e.to_string())?;
        // The same tokenizer through its `tokenizer.json` document (the route before session 20).
        let t2 = Instant::now();
        let json_tok = v.build_from_json("bench")?;
        let json_s = t2.elapsed().as_secs_f64();
        let same =
            json_tok.encode("▁the▁quick▁brown▁fox", false).map_err(|e| e.to_string())?.get_ids() == ids.get_ids();
        println!(
            "{size:>7} pieces: {merges:>9} merges ({merges_s:.2} s to rank); tokenizer built in {build_s:.2} s, through tokenizer.json {json_s:.2} s (same ids: {same})"
        );
        rows.push(format!(
            "{{\"pieces\":{size},\"merges\":{merges},\"rank_merges_s\":{merges_s:.3},\"build_s\":{build_s:.3},\"json_build_s\":{json_s:.3},\"same_ids\":{same}}}"
        ));
    }
    std::fs::write(&out, format!("{{\"benchmark\":\"spm-vocab-build\",\"results\":[{}]}}\n", rows.join(",")))?;
    Ok(())
}
