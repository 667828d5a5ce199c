//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loads through the real loader:
//! config, every tensor, tokenizer round trips, chat template. CI fetches the file first;
//! when it is missing this test fails and says how to get it.

use baton_formats::testing::default_model_path;
use baton_formats::{Architecture, ChatMessage, LoadFormat, LoadedModel, load_model};

fn default_model() -> LoadedModel {
    let path = default_model_path();
    assert!(path.is_file(), "default model missing at {}: run scripts/fetch-default-model.sh", path.display());
    load_model(&path, LoadFormat::Auto).expect("default model loads")
}

#[test]
fn default_model_loads_with_tokenizer_and_template() {
    let m = default_model();
    let c = &m.config;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!((c.hidden_size, c.num_hidden_layers), (576, 30));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
    assert_eq!((c.vocab_size, c.intermediate_size), (49152, 1536));
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_bias);
    for (name, shape) in c.expected_tensors() {
        let t = m.weights.get(&name).expect("tensor");
        assert_eq!(t.shape, shape);
        let v = t.to_f32();
        assert!(v.iter().all(|x| x.is_finite()), "{name} has non-finite values");
        let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(rms > 1e-3 && rms < 10.0, "{name}: implausible rms {rms}");
    }

    let tok = m.tokenizer.as_ref().expect("tokenizer");
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert!(tok.is_special(1) && tok.is_special(2));
    for text in [
        "Hello, world! The capital of France is Paris.",
        "numbers 12345 and 3.14, spaces   here\n\nnew paragraph",
        "你好，世界！ こんにちは Привет 😀🚀",
    ] {
        let ids = tok.encode(text, false).expect("encode");
        assert!(ids.len() < text.len(), "BPE merges are applied");
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }
    // The ids Hugging Face's tokenizer gives for SmolLM2's default system turn.
    let system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
    assert_eq!(
        tok.encode(system, false).expect("encode"),
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
            2, 198
        ]
    );
    // SmolLM's pre-tokenizer splits digits one by one.
    let digits = tok.encode("12345", false).expect("encode");
    assert_eq!(digits.len(), 5);

    let ct = m.chat_template.as_ref().expect("chat template");
    let out = ct.render(&[ChatMessage::new("user", "What is 2+2?")], true).expect("render");
    assert!(out.contains("<|im_start|>user\nWhat is 2+2?<|im_end|>"), "{out}");
    assert!(out.ends_with("<|im_start|>assistant\n"), "{out}");
    let eos = tok.token_to_id("<|im_end|>").expect("eos id");
    assert!(
        m.generation.eos_token_ids.contains(&eos)
            || m.config.eos_token_ids.contains(&eos)
            || !m.generation.eos_token_ids.is_empty()
    );
}

/// SmolLM2's decoder is plain byte-level, so streaming decodes by its byte table: over the
/// real 49,152-token vocabulary, every id's bytes must be what `tokenizers` decodes (checked
/// on random id sequences, whose streamed deltas must add up to the full decode).
#[test]
fn default_model_streams_by_bytes_exactly_as_it_decodes() {
    use baton_formats::{IncrementalDetokenizer, load_model_info};
    let info = load_model_info(&default_model_path(), LoadFormat::Auto).expect("header loads");
    let tok = info.tokenizer.expect("tokenizer");
    assert!(tok.decodes_by_bytes());
    let vocab = tok.vocab_size() as u32;
    // Every id once (in a scrambled order), then random runs.
    let mut all: Vec<u32> = (0..vocab).map(|i| (i.wrapping_mul(7919)) % vocab).collect();
    all.dedup();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let runs = all.chunks(97).map(<[u32]>::to_vec).chain((0..300).map(|_| {
        let len = (next() % 40) as usize;
        (0..len).map(|_| (next() % u64::from(vocab)) as u32).collect()
    }));
    for (i, ids) in runs.enumerate() {
        let skip = i % 2 == 0;
        let mut d = IncrementalDetokenizer::new(tok.clone(), &[1, 2, 3], skip);
        let mut text: String = ids.iter().map(|&id| d.push(id).expect("push")).collect();
        text.push_str(&d.flush().expect("flush"));
        assert_eq!(text, tok.decode(&ids, skip).expect("decode"), "{ids:?}");
    }
}
