//! Tokenizer tests: GGUF-built tokenizers give the same ids as `tokenizer.json` for every
//! supported pre-tokenizer on a mixed-script corpus; the incremental detokenizer (by bytes
//! for byte-level decoders, by windows for the others) never splits a UTF-8 character or
//! drops a space and adds up to the full decode; the stop matcher finds stops across deltas.

use baton_formats::testing::{TinySpec, write_gguf, write_hf_folder};
use baton_formats::tokenizer::PreTokenizerKind;
use baton_formats::{GgufType, IncrementalDetokenizer, LoadFormat, StopMatcher, Tokenizer, load_model};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

/// Mixed-script texts: ASCII, code, CJK, emoji, whitespace runs, digits, specials.
const TEXTS: &[&str] = &[
    "Hello world! The quick brown fox.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "numbers 1234567890 3.14159 1,000,000 and 2024-11-21",
    "你好，世界！今天天气很好。",
    "こんにちは世界 안녕하세요",
    "Привет, мир! Café naïve résumé",
    "emoji 😀🚀🎉 👍🏽 ❤️ family 👨‍👩‍👧",
    "fn main() { println!(\"hi\"); }    // comment",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's YOU'RE and we've I'D",
    "",
    " ",
    "a",
];

/// Random strings from a mixed alphabet, so the comparison is not limited to fixed texts.
fn random_texts(seed: u64, n: usize) -> Vec<String> {
    let alphabet: Vec<char> = "ab cdeXYZ019 \n\t.,!?'你好世界😀🚀éжы   ".chars().collect();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(0..40);
            (0..len).map(|_| *alphabet.choose(&mut rng).unwrap_or(&'a')).collect()
        })
        .collect()
}

fn hf_and_gguf(spec: &TinySpec) -> (Tokenizer, Tokenizer, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = write_hf_folder(&tmp.path().join("hf"), spec).expect("hf");
    let gguf = write_gguf(&tmp.path().join("m.gguf"), spec, GgufType::Q8_0).expect("gguf");
    let hf = Tokenizer::from_hf_folder(&dir).expect("tokenizer.json");
    let gg = load_model(&gguf, LoadFormat::Gguf).expect("gguf loads").tokenizer.expect("gguf tokenizer");
    (hf, gg, tmp)
}

#[test]
fn gguf_tokenizer_matches_tokenizer_json_for_every_pre_tokenizer() {
    let kinds = [
        PreTokenizerKind::Gpt2,
        PreTokenizerKind::Smollm,
        PreTokenizerKind::Llama3,
        PreTokenizerKind::Qwen2,
        PreTokenizerKind::Gpt4o,
    ];
    for (i, pre) in kinds.into_iter().enumerate() {
        let spec = TinySpec { pre_tokenizer: pre, ..TinySpec::llama() };
        let (hf, gg, _tmp) = hf_and_gguf(&spec);
        assert_eq!(hf.vocab_size(), gg.vocab_size());
        let mut texts: Vec<String> = TEXTS.iter().map(|s| s.to_string()).collect();
        texts.extend(random_texts(100 + i as u64, 50));
        let mut merged_any = false;
        for t in &texts {
            let a = hf.encode(t, true).expect("encode");
            let b = gg.encode(t, true).expect("encode");
            assert_eq!(a, b, "{pre:?}: {t:?}");
            assert_eq!(hf.decode(&a, false).expect("decode"), *t, "{pre:?}: round trip");
            merged_any |= a.iter().any(|&id| id >= 259);
        }
        assert!(merged_any, "{pre:?}: the learned merges are never used");
        assert_eq!(gg.eos_token(), Some("<|im_end|>"));
        assert_eq!(gg.bos_token(), Some("<|endoftext|>"));
    }
}

/// The pieces `pre`'s pre-tokenizer splits `text` into (byte-level mapped: a space is 'Ġ', a
/// newline 'Ċ').
fn pre_splits(pre: PreTokenizerKind, text: &str) -> Vec<String> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let spec = TinySpec { pre_tokenizer: pre, ..TinySpec::llama() };
    let tok = spec.tokenizer_spec().expect("bpe").build("t").expect("build");
    let mut s = PreTokenizedString::from(text);
    tok.get_pre_tokenizer().expect("pre").pre_tokenize(&mut s).expect("split");
    s.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(p, _, _)| p.to_string()).collect()
}

#[test]
fn pre_tokenizers_differ_where_their_regexes_do() {
    // Digits: GPT-2 keeps runs together, SmolLM and Qwen2 split every digit, Llama 3 and o200k
    // group by three.
    let pieces = |pre| pre_splits(pre, "1234567").len();
    assert_eq!(pieces(PreTokenizerKind::Gpt2), 1);
    assert_eq!(pieces(PreTokenizerKind::Smollm), 7);
    assert_eq!(pieces(PreTokenizerKind::Qwen2), 7);
    assert_eq!(pieces(PreTokenizerKind::Llama3), 3);
    assert_eq!(pieces(PreTokenizerKind::Gpt4o), 3);
}

#[test]
fn o200k_splits_words_by_case_and_keeps_contractions() {
    // gpt-oss's o200k regex (`gpt-4o`) against Llama 3's on one string: o200k starts a word at
    // each capital run and keeps a contraction on its word; Llama 3 splits on letters alone.
    let text = "HelloWorld's 1234567 a/b\n";
    assert_eq!(
        pre_splits(PreTokenizerKind::Gpt4o, text),
        ["Hello", "World's", "Ġ", "123", "456", "7", "Ġa", "/b", "Ċ"]
    );
    assert_eq!(
        pre_splits(PreTokenizerKind::Llama3, text),
        ["HelloWorld", "'s", "Ġ", "123", "456", "7", "Ġa", "/b", "Ċ"]
    );
}

#[test]
fn special_tokens_are_recognized_and_skippable() {
    let tok = hf_and_gguf(&TinySpec::llama()).1;
    let ids = tok.encode("<|im_start|>user hi<|im_end|>", false).expect("encode");
    assert_eq!(ids[0], 1);
    assert_eq!(*ids.last().expect("ids"), 2);
    assert!(tok.is_special(1) && tok.is_special(2) && tok.is_special(0));
    assert!(!tok.is_special(ids[1]));
    assert_eq!(tok.decode(&ids, true).expect("decode"), "user hi");
    assert_eq!(tok.token_to_string(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.token_to_string(10_000), None);
    let err = tok.decode(&[5, 10_000], false).expect_err("out of range id");
    assert!(err.to_string().contains("10000"), "{err}");
}

#[test]
fn add_bos_follows_the_gguf_flag() {
    let spec = TinySpec::llama();
    let mut bpe = spec.tokenizer_spec().expect("bpe");
    bpe.add_bos = true;
    let tok = Tokenizer::from_inner(bpe.build("t").expect("build"), None, None, "t");
    let ids = tok.encode("hello", true).expect("encode");
    assert_eq!(ids[0], 0);
    assert_eq!(tok.encode("hello", false).expect("encode"), ids[1..]);
}

/// Feeds ids one at a time and returns every delta plus the flushed rest.
fn stream(tok: &Tokenizer, prompt: &[u32], ids: &[u32]) -> Vec<String> {
    stream_skip(tok, prompt, ids, false)
}

fn stream_skip(tok: &Tokenizer, prompt: &[u32], ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut d = IncrementalDetokenizer::new(tok.clone(), prompt, skip_special);
    let mut out: Vec<String> = ids.iter().map(|&id| d.push(id).expect("push")).collect();
    out.push(d.flush().expect("flush"));
    assert_eq!(d.generated_len(), ids.len());
    out
}

/// The same vocabulary with its decoder wrapped in a one-element `Sequence`: it decodes the
/// same text, but is not a plain byte-level decoder, so streaming goes by windows of ids.
fn window_decoded(spec: &TinySpec) -> Tokenizer {
    let mut json = spec.tokenizer_spec().expect("bpe").to_json();
    let decoder = json["decoder"].take();
    json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [decoder]});
    let inner = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).expect("json")).expect("tokenizer");
    Tokenizer::from_inner(inner, None, None, "window")
}

/// The byte-level tokenizer (streams by bytes) and the same vocabulary streaming by windows.
fn both_modes(spec: &TinySpec) -> [Tokenizer; 2] {
    let bytes = hf_and_gguf(spec).1;
    let window = window_decoded(spec);
    assert!(bytes.decodes_by_bytes() && !window.decodes_by_bytes());
    [bytes, window]
}

#[test]
fn incremental_detokenizer_holds_back_split_utf8_and_keeps_spaces() {
    for tok in both_modes(&TinySpec::llama()) {
        holds_back_split_utf8_and_keeps_spaces(&tok);
    }
}

fn holds_back_split_utf8_and_keeps_spaces(tok: &Tokenizer) {
    let text = " 你好 world 😀🚀 ok  two  spaces é";
    let ids = tok.encode(text, false).expect("encode");
    // Byte-level BPE splits the rarely-seen emoji into single-byte tokens.
    let emoji_ids = tok.encode("🚀", false).expect("encode");
    assert!(emoji_ids.len() > 1, "test needs a multi-token character");
    let deltas = stream(tok, &[], &ids);
    assert_eq!(deltas.concat(), text);
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    // Some pushes returned nothing: a character was pending.
    assert!(deltas.iter().any(String::is_empty));
    // With a prompt as context, the output continues it without a stray or missing space.
    let prompt = tok.encode("Say:", false).expect("encode");
    let cont = tok.encode(" hello there", false).expect("encode");
    assert_eq!(stream(tok, &prompt, &cont).concat(), " hello there");
}

#[test]
fn incremental_detokenizer_matches_full_decode_on_random_texts() {
    for tok in both_modes(&TinySpec::qwen2()) {
        for t in random_texts(7, 40).into_iter().chain(TEXTS.iter().map(|t| t.to_string())) {
            let ids = tok.encode(&t, false).expect("encode");
            assert_eq!(stream(&tok, &[], &ids).concat(), t, "{t:?}");
        }
    }
}

#[test]
fn byte_streaming_equals_the_full_decode_of_any_ids() {
    // Random ids, specials and lone byte tokens included: whatever the ids, the deltas add
    // up to exactly what `decode` gives, with and without skipping special tokens.
    let tok = hf_and_gguf(&TinySpec::llama()).1;
    assert!(tok.decodes_by_bytes());
    let vocab = tok.vocab_size() as u32;
    let mut rng = StdRng::seed_from_u64(11);
    for round in 0..400 {
        let len = rng.random_range(0..24);
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        let skip = round % 2 == 1;
        let deltas = stream_skip(&tok, &[], &ids, skip);
        assert_eq!(deltas.concat(), tok.decode(&ids, skip).expect("decode"), "{ids:?} skip={skip}");
    }
}

#[test]
fn byte_streaming_emits_text_as_soon_as_it_is_whole() {
    let tok = hf_and_gguf(&TinySpec::llama()).1;
    let rocket = tok.encode("🚀", false).expect("encode");
    assert!(rocket.len() > 1, "test needs a multi-token character");
    let mut d = IncrementalDetokenizer::new(tok.clone(), &[], true);
    for &id in &rocket[..rocket.len() - 1] {
        assert_eq!(d.push(id).expect("push"), "");
    }
    // A skipped special token in the middle of a character does not break it.
    assert_eq!(d.push(2).expect("special"), "");
    assert_eq!(d.push(rocket[rocket.len() - 1]).expect("push"), "🚀");
    let a = tok.encode("a", false).expect("encode");
    assert_eq!(d.push(a[0]).expect("push"), "a");
    assert_eq!(d.flush().expect("flush"), "");
}

#[test]
fn incremental_detokenizer_flushes_an_incomplete_character() {
    for tok in both_modes(&TinySpec::llama()) {
        let ids = tok.encode("🚀", false).expect("encode");
        let mut d = IncrementalDetokenizer::new(tok.clone(), &[], false);
        assert_eq!(d.push(ids[0]).expect("push"), "");
        assert_eq!(d.flush().expect("flush"), "\u{FFFD}");
    }
}

fn run_stops(stops: &[&str], include: bool, deltas: &[&str]) -> (String, bool) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let mut m = StopMatcher::new(&stops, include).expect("matcher");
    let mut out = String::new();
    for d in deltas {
        let o = m.push(d);
        out.push_str(&o.text);
        if o.stopped {
            return (out, true);
        }
    }
    out.push_str(&m.flush());
    (out, false)
}

#[test]
fn stop_matcher_finds_stops_across_deltas() {
    assert_eq!(run_stops(&["END"], false, &["hello E", "N", "D more"]), ("hello ".into(), true));
    assert_eq!(run_stops(&["END"], true, &["hello E", "N", "D more"]), ("hello END".into(), true));
    // A partial match that fails is released intact.
    assert_eq!(run_stops(&["END"], false, &["a E", "N", "x"]), ("a ENx".into(), false));
    // Held back at the end of the stream is flushed.
    assert_eq!(run_stops(&["END"], false, &["a E", "N"]), ("a EN".into(), false));
    // Earliest match wins across several stops; multi-byte stops.
    assert_eq!(run_stops(&["xyz", "好"], false, &["你", "好xyz"]), ("你".into(), true));
    assert_eq!(run_stops(&["\n\n"], false, &["line\n", "\nnext"]), ("line".into(), true));
}

#[test]
fn stop_matcher_emits_only_what_cannot_start_a_stop() {
    let stops = vec!["<stop>".to_string()];
    let mut m = StopMatcher::new(&stops, false).expect("matcher");
    let o = m.push("abc<st");
    assert_eq!((o.text.as_str(), o.stopped), ("abc", false));
    let o = m.push("op");
    assert_eq!((o.text.as_str(), o.stopped), ("", false));
    let o = m.push(">tail");
    assert_eq!((o.text.as_str(), o.stopped, o.matched), ("", true, Some(0)));
    assert!(m.push("more").text.is_empty());
}

#[test]
fn stop_matcher_random_streams_match_a_direct_search() {
    let mut rng = StdRng::seed_from_u64(5);
    let stops = ["ab", "bba", "好a"];
    let alphabet: Vec<char> = "ab好 c".chars().collect();
    for _ in 0..500 {
        let len = rng.random_range(0..20);
        let text: String = (0..len).map(|_| *alphabet.choose(&mut rng).unwrap_or(&'a')).collect();
        // Split into random deltas at char boundaries.
        let chars: Vec<char> = text.chars().collect();
        let mut deltas = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let n = rng.random_range(1..=3).min(chars.len() - i);
            deltas.push(chars[i..i + n].iter().collect::<String>());
            i += n;
        }
        let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
        let (out, stopped) = run_stops(&stops, false, &refs);
        let first = stops.iter().filter_map(|s| text.find(s)).min();
        match first {
            Some(p) => assert_eq!((out.as_str(), stopped), (&text[..p], true), "{text:?} {deltas:?}"),
            None => assert_eq!((out.as_str(), stopped), (text.as_str(), false), "{text:?}"),
        }
    }
}

#[test]
fn empty_stop_string_is_rejected() {
    let err = StopMatcher::new(&["ok".to_string(), String::new()], false).expect_err("empty stop");
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn invalid_tokenizer_json_is_a_clear_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("tokenizer.json");
    std::fs::write(&p, r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a", "zz"]]}}"#).expect("write");
    let err = Tokenizer::from_file(&p).expect_err("invalid");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    let err = Tokenizer::from_file(&tmp.path().join("missing.json")).expect_err("missing");
    assert!(err.to_string().contains("missing.json"), "{err}");
}

#[test]
fn incremental_detokenizer_rejects_bad_ids_and_keeps_going() {
    for tok in both_modes(&TinySpec::llama()) {
        rejects_bad_ids_and_keeps_going(&tok);
    }
}

fn rejects_bad_ids_and_keeps_going(tok: &Tokenizer) {
    let ids = tok.encode("hello world", false).expect("encode");
    let mut d = IncrementalDetokenizer::new(tok.clone(), &[], false);
    let mut out = d.push(ids[0]).expect("push");
    assert!(d.push(1_000_000).is_err());
    for &id in &ids[1..] {
        out.push_str(&d.push(id).expect("push"));
    }
    out.push_str(&d.flush().expect("flush"));
    assert_eq!(out, "hello world");
}
