"""Driving an EngineCore in the test process."""

from __future__ import annotations

import time


def greedy_batch(core, logits: list | None = None, max_tokens: tuple[int, ...] = (24, 24, 24, 24),
                 ignore_eos: bool = False) -> dict[str, list[int]]:
    """Greedy requests of different prompt lengths (one per MAX_TOKENS entry, that many tokens each,
    fewer if one samples EOS unless IGNORE_EOS), batched on the EngineCore CORE until done: prefills,
    then decodes of as many sequences as are left. LOGITS, if given, gets the logits of every step (for
    tolerance checks). -> tokens per request index."""
    from hotstart.messages import EngineRequest
    from hotstart.sampling_params import SamplingParams

    tag = time.monotonic_ns()
    for i, n in enumerate(max_tokens):
        core.add_request(EngineRequest(f"{i}-{tag}", list(range(3, 11 + 3 * i)),
                                       SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)))
    out: dict[str, list[int]] = {}
    runner_forward = core.runner.forward

    def keep(batch, want, *rest):
        x = runner_forward(batch, want, *rest)
        if logits is not None and x is not None:
            logits.append(x.clone())
        return x

    core.runner.forward = keep
    try:
        while core.has_work():
            for o in core.step():
                out.setdefault(o.request_id.split("-")[0], []).extend(o.new_token_ids)
    finally:
        core.runner.forward = runner_forward
    return out
