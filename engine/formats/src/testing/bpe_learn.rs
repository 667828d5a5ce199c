//! A tiny deterministic byte-level BPE merge learner for test tokenizers. It pre-tokenizes
//! an embedded mixed-script corpus with the real pre-tokenizer (through a merge-free
//! tokenizer), then repeatedly merges the most frequent adjacent pair (ties broken by the
//! pair's text), so the same vocabulary size always yields the same vocabulary.

use std::collections::BTreeMap;

use crate::error::FormatError;
use crate::tokenizer::gguf_vocab::AddedTokenSpec;
use crate::tokenizer::{ByteLevelBpe, PreTokenizerKind};

/// Special tokens of every test tokenizer, at ids 0, 1, 2.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Text the merges are learned from: English prose and code, digits, whitespace runs,
/// accented Latin, Cyrillic, CJK, emoji.
pub const CORPUS: &str = "\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs \
into the forest. Hello world! Hello there, how are you today? I am fine, thank you. \
Once upon a time there was a little model that wanted to generate text. It learned the \
words of the world one token at a time, and then it started to talk.\n\n\
def main():\n    for i in range(10):\n        print(\"hello\", i)\n    return 0\n\n\
fn add(a: u32, b: u32) -> u32 { a + b }\n\
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000 and 12345678.\n\
The weather in the city is nice: 21 degrees, light wind, and the sky is clear.\n\
Café, naïve, façade, résumé — déjà vu.\n\
Привет, мир! Как дела? Всё хорошо.\n\
你好，世界！今天天气很好。我们一起去公园吧。\n\
こんにちは世界。今日はいい天気ですね。\n\
안녕하세요 세계\n\
Emoji: 😀 😃 🚀 🎉 👍 ❤️ 🤖\n\
    indented    with   spaces\tand\ttabs\n\
the the the and and and of of of to to to in in in is is is that that that it it it \
for for for on on on with with with as as as was was was at at at by by by \
token tokens tokenizer tokenization model models language languages inference server \
request requests response responses stream streaming batch batching cache caching \
";

/// Learns a byte-level BPE vocabulary of exactly `vocab_size` tokens (3 specials, 256
/// bytes, then merges) under the given pre-tokenizer.
pub fn learn_bpe(vocab_size: usize, pre: PreTokenizerKind) -> Result<ByteLevelBpe, FormatError> {
    let base = SPECIAL_TOKENS.len() + 256;
    if vocab_size < base {
        return Err(FormatError::InvalidArgument(format!(
            "test vocab_size must be at least {base} (specials + bytes), got {vocab_size}"
        )));
    }
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    tokens.extend((0..=255u8).map(byte_char).map(String::from));
    let added: Vec<AddedTokenSpec> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, s)| AddedTokenSpec { id: i as u32, content: s.to_string(), special: true })
        .collect();
    let mut bpe = ByteLevelBpe { tokens, merges: Vec::new(), added, pre, bos: Some(0), add_bos: false };
    let words = pre_tokenized_words(&bpe)?;
    let mut words: Vec<(Vec<String>, usize)> = words.into_iter().collect();
    let mut known: std::collections::HashSet<String> = bpe.tokens.iter().cloned().collect();
    while bpe.tokens.len() < vocab_size {
        let mut pairs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for (w, c) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0].as_str(), p[1].as_str())).or_default() += c;
            }
        }
        // Highest count; among equals the first pair in text order (BTreeMap iterates sorted).
        let best = pairs
            .iter()
            .fold(None::<((&str, &str), usize)>, |acc, (p, &c)| match acc {
                Some((_, bc)) if bc >= c => acc,
                _ => Some((*p, c)),
            })
            .map(|((a, b), _)| (a.to_string(), b.to_string()));
        let Some((a, b)) = best else {
            return Err(FormatError::InvalidArgument(format!(
                "the test corpus supports at most {} tokens, asked for {vocab_size}",
                bpe.tokens.len()
            )));
        };
        let merged = format!("{a}{b}");
        for (w, _) in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = merged.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        if known.insert(merged.clone()) {
            bpe.tokens.push(merged);
        }
        bpe.merges.push((a, b));
    }
    Ok(bpe)
}

/// Corpus words (as byte-level symbol sequences) with their counts, split by the real
/// pre-tokenizer (which, being byte-level, also maps bytes to the BPE alphabet).
fn pre_tokenized_words(bpe: &ByteLevelBpe) -> Result<BTreeMap<Vec<String>, usize>, FormatError> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let err = |e: tokenizers::Error| FormatError::Tokenizer { context: "test corpus".into(), message: e.to_string() };
    let tok = bpe.build("test tokenizer (merge-free)")?;
    let pre = tok.get_pre_tokenizer().ok_or_else(|| FormatError::Tokenizer {
        context: "test corpus".into(),
        message: "tokenizer has no pre-tokenizer".into(),
    })?;
    let mut s = PreTokenizedString::from(CORPUS);
    pre.pre_tokenize(&mut s).map_err(err)?;
    let mut words: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for (piece, _, _) in s.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        let symbols: Vec<String> = piece.chars().map(String::from).collect();
        if !symbols.is_empty() {
            *words.entry(symbols).or_default() += 1;
        }
    }
    Ok(words)
}

/// GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies.
pub fn byte_char(b: u8) -> char {
    let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable {
        char::from(b)
    } else {
        // Non-printable bytes map, in order, to U+0100 and up.
        let rank = (0..b)
            .filter(|&x| !((b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x)))
            .count() as u32;
        char::from_u32(256 + rank).unwrap_or('?')
    }
}
