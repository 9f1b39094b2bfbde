"""Our engine against Hugging Face transformers (the oracle), in float32: the last prompt position's
logits of one prefill, greedy tokens on both sides."""

from __future__ import annotations

import torch

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.sequence import Sequence
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams

LOGIT_ATOL = 1e-3  # float32 on both sides; differences come from op order only


def float32_engine(model_dir, max_model_len: int = 1024, **kw) -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(str(p) for p in weight_files(model_dir)),
                       device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=max_model_len,
                       **kw)
    return EngineCore.build(cfg)


def prefill_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """[V]: the logits after one prefill of IDS."""
    seq = Sequence("logits", list(ids), len(ids), SamplingParams(max_tokens=1))
    core.blocks.allocate(seq, len(ids))
    try:
        return core.runner.forward([(seq, len(ids))], [True])[0]
    finally:
        core.blocks.free(seq)


def greedy(core: EngineCore, ids: list[int], n: int, ignore_eos: bool = True) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)
    core.add_request(EngineRequest("g", list(ids), params))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            out += o.new_token_ids
    return out


def reference_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_greedy(ref, ids: list[int], n: int, eos=None) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()
