"""Token ids llama.cpp gives for a GGUF file's tokenizer, written as the fixture
tests/text/test_gguf_tokenizer.py compares hotstart's ids with (llama.cpp is not in the test extras: it
builds from source for minutes).

    LLAMA_PY gguf_token_ids.py FILE.gguf OUT.json      # LLAMA_PY: a Python with llama-cpp-python

Each text is tokenized as a server tokenizes a prompt: the model's own BOS / EOS rule
(`add_special`) and special tokens written in the text parsed as such (`parse_special`)."""

from __future__ import annotations

import json
import os
import sys

TEXTS = [
    "Hello world", " leading space", "trailing space ", "  two  spaces   and three",
    "\n\nnew\nlines\t\ttabs", "What is the capital of France?", "don't I'll WE'RE they've",
    "3.14159 1234567 0x1F 1,000,000", "def f(x):\n    return x**2  # squared\n",
    "Ünïcödé café naïve Ærøskøbing", "中文字符 日本語のテキスト 한국어", "emoji 🙂👍🏽🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "Hello<|im_end|>world<|endoftext|>",
    "https://example.com/a?b=c&d=e#f", "ＡＢＣ full width, non\u00a0breaking",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "   ", "x",
]


def main() -> None:
    import llama_cpp

    path, out = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=True, special=True)} for t in TEXTS]
    data = {"file": os.path.basename(path), "size": os.path.getsize(path),
            "llama_cpp_python": llama_cpp.__version__, "cases": cases}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
