"""Random prompts of an exact token count, built from the model's tokenizer (`vllm bench serve
--dataset-name random` shape: synthetic text, no shared prefix, fixed input and output lengths).

A prompt is random non-special token ids decoded to text; since a decoded run of ids can re-encode to
a different count, it is re-encoded and cut or extended until the text encodes to exactly the target
(the special tokens the tokenizer adds itself, e.g. a BOS, are subtracted first, as vLLM does, so the
server sees N tokens in all). Seeded: the same (seed, round, length, index) gives the same prompt, so
every target of a round gets the same prompts and rounds never repeat one (no prefix-cache hits).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hotstart.errors import HotstartError
from hotstart.text.tokenizer import Tokenizer

MAX_FIXES = 32  # re-encode rounds before giving up on an exact count (then the real count is used)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # what the server should count (the tokenizer's own special tokens included)


class RandomPrompts:
    """Prompt factory for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.tok, self.seed = tokenizer, seed
        self.num_special = len(tokenizer.encode("", add_special_tokens=True))
        special = set(tokenizer.all_special_ids)
        self.allowed = [i for i in range(tokenizer.vocab_size) if i not in special]
        if not self.allowed:
            raise HotstartError("bench serve: the tokenizer has no non-special tokens to build prompts from")

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def one(self, length: int, key: tuple) -> Prompt:
        """A prompt of LENGTH tokens (as the server counts them); KEY seeds it with self.seed."""
        want = max(1, length - self.num_special)
        rng = random.Random(repr((self.seed, *key)))
        ids = [rng.choice(self.allowed) for _ in range(want)]
        text = self.tok.decode(ids)
        for _ in range(MAX_FIXES):
            got = self._encode(text)
            if len(got) == want:
                break
            if len(got) > want:
                ids = got[:want]
            else:
                ids = got + [rng.choice(self.allowed) for _ in range(want - len(got))]
            text = self.tok.decode(ids)
        return Prompt(text, len(self._encode(text)) + self.num_special)

    def batch(self, length: int, count: int, key: tuple) -> list[Prompt]:
        return [self.one(length, (*key, i)) for i in range(count)]
