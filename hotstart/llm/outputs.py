"""vLLM's RequestOutput / CompletionOutput / Logprob, built from a finished Generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotstart.messages import TokenLogprobs

# per position: token id -> Logprob (the sampled token and the top ones), as vLLM's SampleLogprobs
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: Any = field(default=None, repr=False)


def position_logprobs(tokenizer: Any, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
    """One position: the top tokens (rank 1..k) and the chosen one (its rank if in the top, else k+1)."""
    out = {t: Logprob(v, r + 1, tokenizer.decode([t])) for r, (t, v) in enumerate(zip(lp.top_ids,
                                                                                      lp.top_logprobs))}
    if token not in out:
        out = {token: Logprob(lp.logprob, len(lp.top_ids) + 1, tokenizer.decode([token])), **out}
    return out


def sample_logprobs(tokenizer: Any, pairs: list[tuple[int, TokenLogprobs]]) -> tuple[SampleLogprobs, float]:
    """(vLLM's per-token logprobs, the cumulative logprob of the chosen tokens)."""
    return [position_logprobs(tokenizer, t, lp) for t, lp in pairs], sum(lp.logprob for _, lp in pairs)
