"""Request admission: why a request can never run on this engine (checked before it is queued)."""

from __future__ import annotations

from hotstart.config import EngineConfig, ModelConfig
from hotstart.engine.block_manager import BlockManager, blocks_for
from hotstart.messages import EngineRequest

MAX_LOGPROBS = 20


def request_error(req: EngineRequest, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                  blocks: BlockManager, duplicate: bool) -> str | None:
    """Why REQ can never run, or None. DUPLICATE: a live request has its id."""
    p, n_prompt, vocab = req.params, len(req.prompt_token_ids), model_cfg.vocab_size
    total = n_prompt + p.max_tokens
    if duplicate:
        return f"duplicate request id {req.request_id}"
    if n_prompt == 0:
        return "the prompt is empty"
    if total > max_model_len:
        return (
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{total} ({n_prompt} in the prompt + {p.max_tokens} to generate)"
        )
    if blocks_for(total, blocks.block_size) > blocks.num_blocks:
        held = blocks.num_blocks * blocks.block_size
        return f"the request needs {total} tokens of KV cache, the engine holds {held}"
    if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
        return f"prompt token ids must be in [0, {vocab})"
    if not 1 <= p.n <= cfg.max_num_seqs:
        return f"n must be in [1, {cfg.max_num_seqs}] (the engine's max_num_seqs), got {p.n}"
    if any(t < 0 or t >= vocab for t in p.logit_bias):
        return f"logit_bias token ids must be in [0, {vocab})"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
    return None
