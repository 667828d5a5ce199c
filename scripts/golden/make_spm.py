#!/usr/bin/env python3
"""Writes engine/formats/tests/fixtures/spm/spm.json: a small SentencePiece BPE model (byte
fallback on, as Llama 2, Mistral, Mixtral and Gemma ship theirs), trained by the real
`sentencepiece` library on the public-domain text the repo ships, with what that library
makes of a set of test strings. The Rust test puts the pieces, scores and types into GGUF
metadata as llama.cpp's converter does (`tokenizer.ggml.model` "llama") and checks that
Baton's GGUF tokenizer encodes and decodes every string as sentencepiece does.

Usage: pip install sentencepiece && python3 scripts/golden/make_spm.py
"""

import json
import os
import tempfile

import sentencepiece as spm

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TEXT = os.path.join(ROOT, "bench", "data", "eighty-days-ch1-2.txt")
OUT = os.path.join(ROOT, "engine", "formats", "tests", "fixtures", "spm", "spm.json")

# Plain text, runs of spaces, leading/trailing spaces, newlines and tabs, digits, punctuation,
# accents and scripts outside the training text (byte fallback), an emoji.
STRINGS = [
    "Phileas Fogg was a gentleman.",
    "  two leading spaces and   three inside",
    "trailing space ",
    "line one\nline two\n\ttabbed",
    "numbers 1234567890 and 3.14159",
    "Punctuation: (a, b); [c] {d}? !!",
    "Café déjà vu naïve",
    "Ελληνικά και русский текст",
    "日本語のテキスト",
    "emoji 🙂 here",
    "",
    " ",
    "x",
]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "m")
        spm.SentencePieceTrainer.train(
            input=TEXT,
            model_prefix=prefix,
            model_type="bpe",
            vocab_size=600,
            byte_fallback=True,
            character_coverage=1.0,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            add_dummy_prefix=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        pieces, scores, types = [], [], []
        for i in range(sp.get_piece_size()):
            pieces.append(sp.id_to_piece(i))
            scores.append(sp.get_score(i))
            # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
            if sp.is_unknown(i):
                types.append(2)
            elif sp.is_control(i):
                types.append(3)
            elif sp.is_byte(i):
                types.append(6)
            else:
                types.append(1)
        cases = [{"text": s, "ids": sp.encode(s), "decoded": sp.decode(sp.encode(s))} for s in STRINGS]
    doc = {
        "about": "sentencepiece " + spm.__version__ + " BPE, byte fallback, trained on bench/data/eighty-days-ch1-2.txt",
        "pieces": pieces,
        "scores": scores,
        "types": types,
        "bos_id": 1,
        "eos_id": 2,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
    print(f"wrote {OUT}: {len(pieces)} pieces, {len(cases)} cases")


if __name__ == "__main__":
    main()
