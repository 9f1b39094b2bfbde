"""One request never takes the engine down: a step's work (`Scheduled`) and the guard that runs it.

`guarded(core, s)` runs EngineCore's execute + update on S. Should they raise (a kernel that fails on one
shape, a grammar library error, an allocation that fails, a `--debug-fault`), only the requests the
failure can be traced to end, with an error output ("error" finish reason: a 500 or an SSE error event
for that request alone), and the engine steps on:

- before the step's tokens are committed (block copies done, in the forward, or sampling: core.stage is
  "forward" or "sampling"), the sequences' counters, prompt logprobs and forked choices are put back as
  they were, and the sequences run again one per forward: those that fail alone fail; the others go on
  (a seeded one may then sample other tokens than it would have: its generator moved);
- after the commit ("token bookkeeping": counts and grammar matchers advanced, tokens appended; a failure
  in one sequence's own bookkeeping fails its request alone), or in the block copies, what was done
  cannot be undone: every request of the step fails, and the engine serves the rest;
- with tensor parallelism the ranks run every step together: the failure is raised (the group leaves,
  the engine is replaced, engine/worker.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotstart.errors import describe
from hotstart.messages import TokenOutput

if TYPE_CHECKING:
    from hotstart.engine.core import EngineCore
    from hotstart.engine.sequence import Sequence

log = logging.getLogger("hotstart.engine")
UNDOABLE = ("forward", "sampling")  # core.stage values at which a failed step can be put back


@dataclass
class Scheduled:
    """One step's work, as schedule() leaves it for execute() and update()."""

    batch: list[tuple[Sequence, int]]  # [B] (sequence, new tokens this step)
    sampling: list[bool]  # [B] all its tokens computed after this step: it samples
    prompt_positions: list[range] | None  # [B] prompt tokens whose logprobs it yields; None: none asked
    drafts: list[int] | None = None  # [B] draft tokens verified (after its last token); None: no drafts

    @property
    def want_logits(self) -> list[bool]:
        """[B] the entry's logits at its last token (sampling without a draft)."""
        if self.drafts is None:
            return self.sampling
        return [w and not d for w, d in zip(self.sampling, self.drafts, strict=True)]

    @property
    def all_logits(self) -> list[bool] | None:
        """[B] the entry's logits at every new token (prompt logprobs, or a draft to verify)."""
        if not self.prompt_positions and self.drafts is None:
            return None
        prompt = self.prompt_positions or [range(0)] * len(self.batch)
        drafts = self.drafts or [0] * len(self.batch)
        return [bool(p) or d > 0 for p, d in zip(prompt, drafts, strict=True)]

    def only(self, i: int) -> Scheduled:
        """Entry I alone."""
        pick = lambda xs: None if xs is None else [xs[i]]  # noqa: E731
        return Scheduled([self.batch[i]], [self.sampling[i]], pick(self.prompt_positions), pick(self.drafts))


class Snapshot:
    """What update() changes on the sequences of S and that a failure before the commit puts back."""

    def __init__(self, core: EngineCore, s: Scheduled) -> None:
        self.core, self.prompt_tokens = core, core.prompt_tokens_computed
        self.seqs = [(seq, seq.num_computed_tokens, len(seq.token_ids), seq.forks_pending, list(seq.draft),
                      None if seq.prompt_logprobs is None else len(seq.prompt_logprobs),
                      len(core.requests.get(seq.request_id, ()))) for seq, _ in s.batch]

    def restore(self) -> None:
        core = self.core
        core.prompt_tokens_computed = self.prompt_tokens
        for seq, computed, tokens, forks, draft, logprobs, choices in self.seqs:
            for child in core.requests.get(seq.request_id, [])[choices:]:
                core._drop(child)  # choices forked by the failed step
            seq.num_computed_tokens, seq.forks_pending, seq.draft = computed, forks, draft
            del seq.token_ids[tokens:]
            seq.finish_reason = None
            if logprobs is not None and seq.prompt_logprobs is not None:
                del seq.prompt_logprobs[logprobs:]


def fail(core: EngineCore, request_id: str, error: BaseException, where: str) -> TokenOutput:
    """End every choice of REQUEST_ID with an error output naming ERROR (the client's own request: its
    message is its to read; the log gets the type and the place only, never request data)."""
    log.error("hotstart: engine: request %s failed %s (%s); the engine serves on", request_id, where,
              describe(error))
    core.abort([request_id])
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return TokenOutput(request_id, [], "error", f"failed {where}: {type(error).__name__}: {text}")


def guarded(core: EngineCore, s: Scheduled) -> list[TokenOutput]:
    """core._update(s, core._execute(s)), a failure failing only the requests it is traced to."""
    if core.executor.world_size > 1:
        return core._update(s, core._execute(s))
    snapshot = Snapshot(core, s)
    try:
        return core._update(s, core._execute(s))
    except Exception as e:  # noqa: BLE001 - traced to its requests below; the engine steps on
        where = f"in the {core.stage}"
        if core.stage not in UNDOABLE:  # state moved on: the step's requests end
            rids = dict.fromkeys(seq.request_id for seq, _ in s.batch)
            return [fail(core, rid, e, where) for rid in rids]
        snapshot.restore()
        if len(s.batch) == 1:
            return [fail(core, s.batch[0][0].request_id, e, where)]
        log.warning("hotstart: engine: a step of %d sequences failed %s (%s): running them one at a time",
                    len(s.batch), where, describe(e))
    return _one_at_a_time(core, s)


def _one_at_a_time(core: EngineCore, s: Scheduled) -> list[TokenOutput]:
    outputs, failed = [], set()
    for i, (seq, _) in enumerate(s.batch):
        if seq.request_id in failed or seq.request_id not in core.requests:
            continue
        one = s.only(i)
        snapshot = Snapshot(core, one)
        try:
            outputs += core._update(one, core._execute(one))
        except Exception as e:  # noqa: BLE001 - this request alone
            if core.stage in UNDOABLE:
                snapshot.restore()
            failed.add(seq.request_id)
            outputs.append(fail(core, seq.request_id, e, f"in the {core.stage}"))
    return [o for o in outputs if o.request_id not in failed or o.finish_reason == "error"]
