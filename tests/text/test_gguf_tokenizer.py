"""The tokenizer built from a GGUF file's metadata (hotstart/text/gguf_tokenizer.py) gives llama.cpp's ids
for the same file: the fixture holds the ids llama.cpp (llama-cpp-python 0.3.36) gave for the default
model's Q4_1 GGUF (benchmarks/investigations/gguf_token_ids.py wrote it), over texts that exercise the
pre-tokenizer (spaces, newlines, digits, contractions, code, scripts without spaces, emoji, full-width
forms) and special tokens written in the text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "data" / "gguf_ids_llamacpp.json"


@pytest.fixture(scope="module")
def default_gguf():
    """(the default GGUF's tokenizer, the fixture's cases)."""
    from hotstart.boot.default_model import find_gguf
    from hotstart.text.tokenizer import Tokenizer

    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    path = find_gguf()
    if path.name != data["file"] or os.path.getsize(path) != data["size"]:
        pytest.fail(f"{path} is not the file the fixture was made from: {data['file']}, {data['size']} B")
    return Tokenizer.from_gguf(path), data["cases"]


def test_ids_equal_llama_cpps(default_gguf):
    tok, cases = default_gguf
    got = [tok.encode(c["text"]) for c in cases]
    wrong = [(c["text"], ids, c["ids"]) for c, ids in zip(cases, got, strict=True) if ids != c["ids"]]
    assert not wrong, wrong


def test_decoding_llama_cpps_ids_gives_the_text_back(default_gguf):
    tok, cases = default_gguf
    for c in cases:
        assert tok.decode(c["ids"], skip_special_tokens=False) == c["text"], c["text"]
