//! SentencePiece vocabularies in GGUF (`tokenizer.ggml.model` "llama", as llama.cpp writes
//! Llama 2, Mistral, Mixtral and Gemma files): a model the real `sentencepiece` library trained
//! (byte fallback on; `scripts/golden/make_spm.py`), written into GGUF metadata, encodes every
//! test string to the ids sentencepiece gave and decodes them back to its text, whole and token
//! by token through the incremental detokenizer.

use std::path::PathBuf;

use baton_formats::gguf::{GgufFile, GgufType, GgufValue};
use baton_formats::testing::{TinySpec, gguf_writer};
use baton_formats::tokenizer::{SpmVocab, tokenizer_from_gguf};
use baton_formats::{IncrementalDetokenizer, Tokenizer};

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(serde::Deserialize)]
struct Fixture {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    bos_id: u32,
    eos_id: u32,
    cases: Vec<Case>,
}

fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spm/spm.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("fixture json")
}

/// The fixture's vocabulary in a GGUF file (a tiny Llama's weights beside it), read back.
fn gguf_tokenizer(f: &Fixture, add_space_prefix: bool) -> (Tokenizer, tempfile::TempDir) {
    let vocab = SpmVocab {
        pieces: f.pieces.clone(),
        scores: f.scores.clone(),
        types: f.types.clone(),
        bos: Some(f.bos_id),
        add_bos: true,
        add_space_prefix,
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("spm.gguf");
    let mut w = gguf_writer(&TinySpec::llama(), GgufType::F32).expect("writer");
    for (k, v) in vocab.to_gguf_metadata(Some(f.eos_id)) {
        w.add_meta(&k, v);
    }
    w.write(&path).expect("write");
    let file = GgufFile::open(&path).expect("open");
    assert_eq!(file.get("tokenizer.ggml.model").and_then(GgufValue::as_str), Some("llama"));
    (tokenizer_from_gguf(&file).expect("SentencePiece tokenizer"), tmp)
}

#[test]
fn sentencepiece_gguf_vocabulary_encodes_and_decodes_as_sentencepiece() {
    let f = fixture();
    let (tok, _tmp) = gguf_tokenizer(&f, true);
    for case in &f.cases {
        let ids = tok.encode(&case.text, false).expect("encode");
        assert_eq!(ids, case.ids, "encoding {:?}", case.text);
        assert_eq!(tok.decode(&case.ids, true).expect("decode"), case.decoded, "decoding {:?}", case.text);
        // Token by token, the deltas add up to the whole decode.
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], true);
        let streamed: String = case.ids.iter().map(|&id| detok.push(id).expect("push")).collect();
        assert_eq!(streamed, case.decoded, "streaming {:?}", case.text);
    }
    // With special tokens: BOS first, as llama.cpp's add_bos_token says; `</s>` in the text is
    // the control token, and decoding skips it.
    let ids = tok.encode("Phileas Fogg</s>", true).expect("encode");
    assert_eq!(ids[0], f.bos_id);
    assert_eq!(*ids.last().expect("ids"), f.eos_id);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "Phileas Fogg");
}

#[test]
fn sentencepiece_gguf_without_space_prefix_prepends_nothing() {
    // Gemma's files say `tokenizer.ggml.add_space_prefix` false: no `▁` before the text.
    let f = fixture();
    let (tok, _tmp) = gguf_tokenizer(&f, false);
    let with_prefix = gguf_tokenizer(&f, true).0.encode("Phileas", false).expect("encode");
    let without = tok.encode("Phileas", false).expect("encode");
    assert_ne!(with_prefix, without);
    assert_eq!(tok.decode(&without, true).expect("decode"), "Phileas");
    assert_eq!(tok.encode(" Phileas", false).expect("encode"), with_prefix, "an explicit space is the prefix");
}

#[test]
fn sentencepiece_gguf_metadata_that_disagrees_is_refused() {
    let f = fixture();
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("bad.gguf");
    let mut w = gguf_writer(&TinySpec::llama(), GgufType::F32).expect("writer");
    let vocab = SpmVocab {
        pieces: f.pieces.clone(),
        scores: f.scores[..10].to_vec(),
        types: f.types.clone(),
        bos: Some(f.bos_id),
        add_bos: true,
        add_space_prefix: true,
    };
    for (k, v) in vocab.to_gguf_metadata(None) {
        w.add_meta(&k, v);
    }
    w.write(&path).expect("write");
    let err = tokenizer_from_gguf(&GgufFile::open(&path).expect("open")).expect_err("scores short");
    assert!(err.to_string().contains("10 scores"), "{err}");
}

#[test]
fn direct_build_equals_the_tokenizer_json_build() {
    // `SpmVocab::build` makes the BPE model directly; `build_from_json` goes through the
    // `tokenizer.json` document. The fixture's vocabulary with one piece made user-defined (an
    // added, normalized token) gives the same ids, offsets-free decodes and special-token
    // handling both ways, on the fixture's texts and on texts full of control, user-defined
    // and out-of-vocabulary characters.
    let f = fixture();
    let mut types = f.types.clone();
    let user = types.iter().rposition(|&t| t == 1).expect("a normal piece");
    types[user] = 4;
    for add_space_prefix in [true, false] {
        let vocab = SpmVocab {
            pieces: f.pieces.clone(),
            scores: f.scores.clone(),
            types: types.clone(),
            bos: Some(f.bos_id),
            add_bos: true,
            add_space_prefix,
        };
        let direct = vocab.build("direct").expect("direct build");
        let json = vocab.build_from_json("json").expect("json build");
        let mut texts: Vec<String> = f.cases.iter().map(|c| c.text.clone()).collect();
        let piece = f.pieces[user].replace('▁', " ");
        texts.push(format!("</s>Phileas{piece}Fogg <s> naïve 漢字 🚂{piece}"));
        texts.push(String::new());
        for text in &texts {
            for special in [false, true] {
                let a = direct.encode(text.as_str(), special).expect("encode").get_ids().to_vec();
                let b = json.encode(text.as_str(), special).expect("encode").get_ids().to_vec();
                assert_eq!(a, b, "{text:?} (special tokens {special}, space prefix {add_space_prefix})");
                let skip = !special;
                assert_eq!(direct.decode(&a, skip).expect("decode"), json.decode(&b, skip).expect("decode"));
            }
        }
        assert_eq!(direct.get_vocab_size(true), json.get_vocab_size(true));
        assert_eq!(direct.token_to_id(&f.pieces[user]), Some(user as u32));
    }
}
