"""Per-request state inside the engine, as counters (num_computed_tokens vs num_tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hotstart.messages import TokenLogprobs
from hotstart.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None
    index: int = 0  # the choice of the request (0..n-1)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_sent: int = 0  # generated tokens already reported to the API process
    finish_reason: str | None = None
    forks_pending: int = 0  # choices 1..n-1 not yet forked from this one (at its first sample)
    # prefix cache: hash chain of its full blocks (grows with the tokens), and how many are registered
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    skip_prefix_cache: bool = False  # prompt logprobs need every prompt position computed
    max_chunk: int | None = None  # cap on tokens computed per step (prompt logprobs: bounded logits)
    prompt_logprobs: list[TokenLogprobs] | None = None  # collected while prefilling, sent once
    sampling: Any = None  # the sampler's per-sequence state (penalties, biases, ...); None: plain
    # speculative decoding (engine/spec_decode.py): tokens drafted for this step (computed after its last
    # token, not yet in token_ids), and the speculator's state of it (None: never drafted)
    draft: list[int] = field(default_factory=list)
    spec: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_slots(self) -> int:
        """Sequences it will count as in a batch (its pending choices included)."""
        return 1 + self.forks_pending
