"""Sliding-window attention and Gemma's attention against transformers (float32, tiny random checkpoints):
prompts longer than every window, chunked prefills that start past it, a step mixing a decode and a
prefill, greedy decodes well past the window; and one windowed family through a real server."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.families import tiny_checkpoints
from helpers.server import Server, openai_client

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.sequence import Sequence
from hotstart.messages import EngineRequest
from hotstart.model.files import weight_files
from hotstart.sampling_params import SamplingParams

LOGIT_ATOL = 1e-3
TINY = tiny_checkpoints()
# (test id, family, changes to its tiny config): windows of 8 - 16, shorter than the prompts
CASES = {
    "mistral": ("mistral", {}),
    "qwen2-opt-in": ("qwen2", {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1}),
    "qwen3-layer-types": ("qwen3", {"use_sliding_window": True, "sliding_window": 9, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            from transformers import AutoConfig, AutoModelForCausalLM

            family, changes = CASES[case]
            model_type, kw = TINY[family]
            torch.manual_seed(0)
            config = AutoConfig.for_model(model_type, **{**kw, **changes})
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            folder = tmp_path_factory.mktemp(case)
            model.save_pretrained(folder, safe_serialization=True)
            cache[case] = (folder, model)
        return cache[case]

    return get


def _engine(folder) -> EngineCore:
    cfg = EngineConfig(model_path=str(folder), weight_files=tuple(str(p) for p in weight_files(folder)),
                       device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024,
                       block_size=4)  # small blocks: windows span several, and slide out of whole ones
    return EngineCore.build(cfg)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _theirs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]  # [n, V]


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize("case", CASES)
def test_windowed_prefill_chunks_and_mixed_steps_match_transformers(checkpoint, case):
    folder, ref = checkpoint(case)
    core = _engine(folder)
    cfg = core.model_cfg
    assert cfg.sliding_window is not None and cfg.sliding_window < 20 and any(cfg.sliding_layers)
    a, b = _ids(45, 1), _ids(31, 2)
    # A: a 45-token prompt in chunks of 13 (the later chunks start past the window), all logits compared
    seq_a = Sequence("a", list(a), len(a), SamplingParams(max_tokens=1))
    core.blocks.allocate(seq_a, len(a) + 1)
    want = _theirs(ref, a)
    for start in range(0, len(a), 13):
        n = min(13, len(a) - start)
        seq_a.num_computed_tokens = start
        ours = core.runner.forward([(seq_a, n)], [False], [True])  # [n, V]: every new token's logits
        _close(ours, want[start:start + n])
    # one step: A decodes one more token while B's whole prompt prefills
    seq_a.token_ids.append(7)
    seq_a.num_computed_tokens = len(a)
    seq_b = Sequence("b", list(b), len(b), SamplingParams(max_tokens=1))
    core.blocks.allocate(seq_b, len(b))
    ours = core.runner.forward([(seq_a, 1), (seq_b, len(b))], [True, True])
    _close(ours[0], _theirs(ref, [*a, 7])[-1])
    _close(ours[1], _theirs(ref, b)[-1])


@pytest.mark.parametrize("case", CASES)
def test_greedy_decode_past_the_window_matches_transformers(checkpoint, case):
    folder, ref = checkpoint(case)
    core = _engine(folder)
    ids = _ids(41, 3)
    core.add_request(EngineRequest("g", list(ids), SamplingParams(max_tokens=24, temperature=0,
                                                                  ignore_eos=True)))
    ours: list[int] = []
    while core.has_work():
        for o in core.step():
            ours += o.new_token_ids
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs


def test_metadata_is_built_once_per_window(checkpoint):
    """Gemma 3's sliding layers share one windowed metadata per step; global layers use the step's own."""
    from hotstart.model.attention import AttnMetadata

    folder, _ = checkpoint("gemma3")
    core = _engine(folder)
    seen: list[AttnMetadata] = []
    real = AttnMetadata.window

    def spy(self, w):
        out = real(self, w)
        seen.append((w, id(out), id(self)))
        return out

    seq = Sequence("m", _ids(30, 4), 30, SamplingParams(max_tokens=1))
    core.blocks.allocate(seq, 30)
    AttnMetadata.window = spy
    try:
        core.runner.forward([(seq, 30)], [True])
    finally:
        AttnMetadata.window = real
    windows = [cfg_w for cfg_w, _, _ in seen]
    assert windows == [core.model_cfg.layer_window(i) for i in range(4)] == [12, 12, None, 12]
    assert len({i for w, i, _ in seen if w == 12}) == 1  # one windowed metadata, shared
    assert {i for w, i, meta in seen if w is None} == {seen[0][2]}  # the global layer: the step's own


def test_a_windowed_family_serves_through_the_server(checkpoint, default_model_dir, tmp_path):
    """Gemma 2 (window 8, soft-capping) behind `hotstart serve`: greedy text equal to transformers'."""
    from hotstart.text.tokenizer import Tokenizer

    src, ref = checkpoint("gemma2")
    folder = tmp_path / "gemma2"
    shutil.copytree(src, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    ids = _ids(40, 5)
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    s = Server(str(folder), "--max-model-len", "256", "--dtype", "float32")
    try:
        r = openai_client(s, timeout=60).completions.create(
            model="gemma2", prompt=ids, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == Tokenizer.from_dir(folder).decode(want)
    finally:
        s.stop()
