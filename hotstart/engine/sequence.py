"""Per-request state inside the engine, as counters (num_computed_tokens vs num_tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotstart.messages import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_sent: int = 0  # generated tokens already reported to the API process
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
