"""The KV cache is allocated uninitialised (instant) and zeroed block by block before first use: whatever
the allocator hands out (reused memory may hold NaN bit patterns), masked slots never reach the output."""

from __future__ import annotations

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams


def _run(model_dir, poison: bool) -> dict[tuple[str, int], list[int]]:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    core = EngineCore.build(cfg)
    if poison:  # what uninitialised memory may hold, in every block but the null block
        core.runner.kv_cache[:, :, core.runner.block_size:] = float("nan")
    prompt = list(range(3, 24))  # 21 tokens: the last block is partly filled
    core.add_request(
        EngineRequest("one", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    )
    core.add_request(
        EngineRequest(
            "two", prompt[:19], SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=3, ignore_eos=True)
        )
    )  # copy-on-write
    out: dict[tuple[str, int], list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return out


def test_never_written_kv_slots_do_not_reach_the_output(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2")
    assert _run(model_dir, poison=True) == _run(model_dir, poison=False)
