"""KV blocks behind every layer's sliding window are released as a sequence grows (issue 23): a long
greedy generation on a tiny Mistral (window 16 on every layer) holds O(window) blocks, and its tokens
equal those of the run that keeps every block and transformers' (float32); with prefix caching and
forked choices too. A model with a global layer (Gemma 2, 3) releases nothing."""

from __future__ import annotations

import pytest
import torch

from hotstart.config import EngineConfig
from hotstart.engine.block_manager import BlockManager, freeable_window
from hotstart.engine.core import EngineCore
from hotstart.engine.sequence import Sequence
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams

BS = 4
PROMPT = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(3)).tolist()


def _core(folder, window_release: bool = True) -> EngineCore:
    cfg = EngineConfig(model_path=str(folder), weight_files=tuple(map(str, weight_files(folder))),
                       device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=256,
                       block_size=BS)
    core = EngineCore.build(cfg)
    if not window_release:
        core.blocks.window = None
    return core


def _generate(core: EngineCore, n: int = 1, tokens: int = 40) -> tuple[list[list[int]], int]:
    """Greedy choices of PROMPT; and the most blocks the request held at once."""
    core.add_request(EngineRequest("r", list(PROMPT), SamplingParams(max_tokens=tokens, temperature=0,
                                                                     ignore_eos=True, n=n)))
    out: dict[int, list[int]] = {}
    most = 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
        held = {b for seq in core.scheduler.running for b in seq.block_table if b}
        most = max(most, len(held))
    return [out[i] for i in sorted(out)], most


def test_a_long_mistral_generation_holds_a_window_of_blocks(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint("mistral")
    core = _core(folder)
    assert core.blocks.window == core.model_cfg.sliding_window == 16
    ours, most = _generate(core)
    kept, most_kept = _generate(_core(folder, window_release=False))
    assert ours == kept
    assert most_kept == -(-(len(PROMPT) + 40) // BS)  # every block
    assert most <= 16 // BS + 2  # the window's blocks, the one being filled, one partly behind
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == [theirs]
    assert core.blocks.num_used == 0  # every block back once the request finished


def test_released_blocks_with_prefix_caching_and_forks(tiny_checkpoint):
    """Two choices share the prompt's blocks and release them as both slide past; a second request for
    the same prompt starts from the prefix cache (blocks released behind the window kept their hashes
    or were handed out again: either way the tokens are those of a cold run)."""
    folder = tiny_checkpoint("mistral")
    core = _core(folder)
    (first, second), _ = _generate(core, n=2, tokens=30)
    assert first == second
    hits = core.blocks.cache_hits
    (again,), most = _generate(core, tokens=30)
    assert core.blocks.cache_hits > hits  # the prompt's full blocks came from the cache
    assert again == first
    assert most <= 16 // BS + 2
    cold, _ = _generate(_core(folder, window_release=False), tokens=30)
    assert cold == [first]


@pytest.mark.parametrize("windows, expected", [([16, 16], 16), ([8, None, 8], None), ([], None),
                                               ([4096, 4096, 8], 4096)])
def test_only_models_windowed_on_every_layer_release_blocks(windows, expected):
    assert freeable_window(windows) == expected


def test_release_is_counted_before_allocating():
    """A sequence whose next block replaces one it releases needs no free block."""
    blocks = BlockManager(5, BS, window=8)
    seq = Sequence("s", list(range(20)), 20, SamplingParams(max_tokens=1))
    blocks.allocate(seq, 20)
    assert blocks.num_free == 0 and seq.block_table == [1, 2, 3, 4, 5]
    seq.num_computed_tokens = 20  # the next query at 20 sees keys 13 .. 20: blocks 0 - 2 are behind
    assert blocks.can_allocate(seq, 21)
    blocks.allocate(seq, 21)
    assert seq.block_table[:3] == [0, 0, 0] and len(seq.block_table) == 6
    assert blocks.num_free == 2
    blocks.free(seq)
    assert blocks.num_free == 5
