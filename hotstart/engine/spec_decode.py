"""Prompt-lookup ("ngram") speculative decoding: drafts without a draft model, verified in one forward.

Each step, before scheduling, every decoding sequence may get a draft (Sequence.draft): the last n tokens
of its context (prompt + generated, n from prompt_lookup_max down to prompt_lookup_min) are looked up in
the rest of its context, most recent occurrence first, and the up to K tokens that followed become the
draft. The scheduler then computes 1 + k tokens of that sequence (its last token and the draft) in the
step's forward, which yields logits at each of them (EngineCore._verify):

  position j = 0..k samples token t_j from row j, exactly as a plain decode step would (penalties, the
  grammar mask, min_tokens, logprobs: the sequence's state advances token by token); the draft d_j is
  accepted when t_j == d_j, and verification goes on to j + 1 unless t_j ended the sequence. The first
  t_j != d_j (the corrected token) or t_k (the bonus token) ends it.

That is rejection sampling for a point-mass draft: d_j is accepted with probability p(d_j) and, rejected,
the token comes from p with d_j removed and renormalised, so the output distribution is unchanged and
greedy output is identical. A grammar only ever consumes sampled tokens, so there is nothing to roll
back; the KV written for rejected drafts lies past num_computed_tokens (rolled back) and is overwritten;
blocks past the sequence's end are freed (BlockManager.trim).

Back-off: a draft with nothing accepted doubles the sequence's pause (decode steps without drafting, up
to MAX_BACKOFF); any accepted token resets it. Text that does not repeat itself is not slowed down by
drafts that never land. Draft length: after a draft with a tokens of k accepted (a < k) the next draft
is at most a + 1 tokens; a fully accepted one doubles the limit, up to K. A verify step of 1 + k tokens
costs more than a decode step, and the more so on CPU, where steps of up to 3 tokens run the small-batch
GEMV (model/cpu_kernels.py) and longer ones oneDNN: a short draft keeps verification cheap where text
repeats itself only in short runs, a long one pays where it copies.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from hotstart.engine.sequence import Sequence
from hotstart.spec_config import SpecConfig

MAX_BACKOFF = 64  # decode steps a sequence pauses drafting at most


@dataclass
class SpecState:
    """One sequence's lookup buffer and back-off."""

    context: bytearray = field(default_factory=bytearray)  # its token ids as int32 bytes (searched in C)
    pause: int = 0  # decode steps left without drafting
    backoff: int = 0  # the pause the next fruitless draft sets (doubles)
    limit: int = 0  # the most tokens the next draft may have (0: num_speculative_tokens)


def _find(context: bytes | bytearray, needle: bytes | bytearray, end: int) -> int:
    """The last token-aligned start of NEEDLE in CONTEXT[:END] (bytes), or -1."""
    while True:
        at = context.rfind(needle, 0, end)
        if at < 0 or at % 4 == 0:
            return at
        end = at + len(needle) - 1  # a match across token boundaries: look further back


def propose(context: bytes | bytearray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to K tokens that followed an earlier occurrence of the longest suffix n-gram of CONTEXT (int32
    token ids as bytes), n from N_MAX down to N_MIN: the latest one with K followers, else the latest
    with fewer (in a run of one token, the latest occurrence has one follower); [] if none occurs."""
    total = len(context) // 4
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        needle = context[-4 * n :]
        at = _find(context, needle, 4 * (total - k)) if total - k >= n else -1
        if at < 0:  # an occurrence that ends before the last token: it has at least one follower
            at = _find(context, needle, 4 * (total - 1))
        if at >= 0:
            start = at // 4 + n
            return array("i", context[4 * start : 4 * min(start + k, total)]).tolist()
    return []


class NgramSpeculator:
    """Drafts for the running sequences, back-off, and the acceptance counters (vLLM's metrics)."""

    def __init__(self, cfg: SpecConfig, max_model_len: int):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.num_drafts = 0  # drafts verified
        self.num_draft_tokens = 0  # tokens in them
        self.num_accepted_tokens = 0  # of which accepted

    def draft(self, seqs: list[Sequence]) -> None:
        """Set the draft of each decoding sequence of SEQS ([] for the others)."""
        cfg = self.cfg
        for seq in seqs:
            seq.draft = []
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.forks_pending or seq.finished:
                continue  # prefilling, or about to fork
            st = seq.spec
            if st is None:
                st = seq.spec = SpecState()
            if st.pause:
                st.pause -= 1
                continue
            # never more tokens than max_tokens / max_model_len leave: the bonus token comes on top
            k = min(
                st.limit or cfg.num_speculative_tokens,
                seq.params.max_tokens - seq.num_generated - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if k <= 0:
                continue
            have = len(st.context) // 4
            if have > seq.num_tokens:  # recomputed after preemption: same tokens, but be safe
                st.context.clear()
                have = 0
            st.context += array("i", seq.token_ids[have:]).tobytes()
            seq.draft = propose(st.context, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)

    def stats(self) -> dict[str, int]:
        """EngineStats' fields (vLLM's metric names)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """SEQ's draft of DRAFTED tokens got ACCEPTED of them: counters and back-off."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        st = seq.spec
        k = self.cfg.num_speculative_tokens
        st.limit = min(k, 2 * drafted) if accepted == drafted else accepted + 1
        if accepted:
            st.backoff = 0
        else:
            st.backoff = min(MAX_BACKOFF, max(1, 2 * st.backoff))
            st.pause = st.backoff
