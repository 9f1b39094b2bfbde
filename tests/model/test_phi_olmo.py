"""RoPE variants (yarn, longrope, partial rotary), Phi-3 (checkpoint-fused qkv / gate_up) and OLMo 2 against
transformers in float32: the RoPE tables exactly, the logits and greedy tokens of tiny checkpoints, both
LongRoPE factor sets, the rank slices of the fused tensors, and TP=2 == TP=1 for Phi-3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.families import tiny_checkpoints
from helpers.reference import (
    LOGIT_ATOL,
    float32_engine,
    greedy,
    prefill_logits,
    reference_greedy,
    reference_model,
)
from helpers.tp_ranks import executor_for_case, prefill_and_decode, run_two_ranks

from hotstart import families
from hotstart.config import load_model_config
from hotstart.model import rope
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model
from hotstart.model.parallel import TensorParallel, divisibility_error

REPO = Path(__file__).resolve().parents[2]
TINY = tiny_checkpoints()
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# (name, tiny family, config changes): yarn on Llama and Qwen2 (with DeepSeek-style mscales)
VARIANTS = {
    "llama-yarn": ("llama", {"rope_scaling": {**YARN, "rope_theta": 500000.0}}),
    "qwen2-yarn-mscale": ("qwen2", {"rope_scaling": {**YARN, "rope_theta": 10000.0, "factor": 8.0,
                                                     "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 16}}),
}


def _checkpoint(folder: Path, family: str, **changes) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = TINY[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**kw, **changes})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            family, changes = VARIANTS[name]
            cache[name] = _checkpoint(tmp_path_factory.mktemp(name), family, **changes)
        return cache[name]

    return get


def _theirs_rope(model_dir: Path, positions: torch.Tensor):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    rotary = type(ref.model.rotary_emb)(ref.config)  # on the CPU
    return rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))


@pytest.mark.parametrize("name", ["phi3", "llama-yarn", "qwen2-yarn-mscale"])
def test_rope_tables_are_transformers(tiny_checkpoint, variant, name):
    """cos / sin (attention factor applied, partial rotary dims) equal transformers' at every position."""
    model_dir = tiny_checkpoint(name) if name in TINY else variant(name)
    cfg = load_model_config(model_dir)
    assert cfg.rope.type in ("yarn", "longrope")
    served = cfg.max_position_embeddings
    model = load_model(cfg, weight_files(model_dir), max_positions=served)
    positions = torch.arange(served)
    cos, sin = _theirs_rope(model_dir, positions)  # longrope: all positions < served: the long set
    ours = model.model.rotary
    assert ours.cos.shape[-1] == rope.rotary_dim(cfg.rope, cfg.head_dim) == cos.shape[-1]
    signed = sin[0].clone()  # our table holds rotate_half's sign on its first half (RotaryEmbedding.apply)
    signed[:, : signed.shape[-1] // 2] *= -1
    assert torch.allclose(ours.cos, cos[0], atol=1e-6, rtol=0) and torch.allclose(ours.sin, signed, atol=1e-6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_yarn_checkpoints_match_transformers(variant, name):
    model_dir = variant(name)
    core, ref = float32_engine(model_dir), reference_model(model_dir)
    ids = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = prefill_logits(core, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0), (ours - theirs).abs().max()
    assert greedy(core, ids, 24) == reference_greedy(ref, ids, 24)


def test_longrope_short_factors_within_the_original_context(tiny_checkpoint):
    """Served within original_max_position_embeddings (6): the short factors, as transformers uses for
    sequences that never pass it (4 prompt + 2 new tokens); served beyond it the logits differ (the long
    set, checked against transformers by test_model_reference.py with a 23-token prompt)."""
    model_dir = tiny_checkpoint("phi3")
    assert load_model_config(model_dir).rope.original_max_position_embeddings == 6
    short, ref = float32_engine(model_dir, max_model_len=6), reference_model(model_dir)
    ids = [5, 77, 301, 12]
    ours = prefill_logits(short, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0), (ours - theirs).abs().max()
    assert greedy(short, ids, 2) == reference_greedy(ref, ids, 2)
    long = prefill_logits(float32_engine(model_dir), ids)
    assert not torch.allclose(long, ours, atol=1e-2)


def _file_ranges(files) -> list[tuple[int, int]]:
    names, ranges = {str(f) for f in files}, []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] in names:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_phi3_fused_tensors_are_views_of_the_file_and_split_per_rank(tiny_checkpoint):
    model_dir = tiny_checkpoint("phi3-tp")
    cfg, files = load_model_config(model_dir), weight_files(model_dir)
    full = load_model(cfg, files)  # CPU, checkpoint dtype: zero-copy
    attn, mlp = full.model.layers[1].self_attn, full.model.layers[1].mlp
    ranges = _file_ranges(files)
    for w in (attn.qkv_proj.weight, mlp.gate_up_proj.weight):
        assert any(lo <= w.data_ptr() and w.data_ptr() + w.nbytes <= hi for lo, hi in ranges)
    assert attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qw, kw, vw = attn.qkv_proj.weight.split([q, kv, kv])
    gw, uw = mlp.gate_up_proj.weight.split([inter, inter])
    for rank in (0, 1):
        part = load_model(cfg, files, tp=TensorParallel(rank, 2))
        a, m = part.model.layers[1].self_attn, part.model.layers[1].mlp

        def rows(w: torch.Tensor, rank: int = rank) -> torch.Tensor:
            n = w.shape[0] // 2
            return w[rank * n:(rank + 1) * n]

        assert torch.equal(a.qkv_proj.weight, torch.cat([rows(qw), rows(kw), rows(vw)]))
        assert torch.equal(m.gate_up_proj.weight, torch.cat([rows(gw), rows(uw)]))


def test_olmo2_tensor_parallel_is_refused_in_one_line(tiny_checkpoint):
    cfg = load_model_config(tiny_checkpoint("olmo2-tp"))
    problem = divisibility_error(cfg, 2)
    assert problem.startswith("--tensor-parallel-size 2: not supported for Olmo2ForCausalLM: OLMo 2's q/k")
    assert "\n" not in problem and divisibility_error(cfg, 1) is None


def test_phi3_two_ranks_give_the_logits_of_one(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("phi3-tp")
    ids = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    cases = [{"name": "phi3-tp", "model": str(model), "fused": False, "ids": ids}]
    got = run_two_ranks(cases, tmp_path, 180)["phi3-tp"]
    for ours, ref in zip(got, prefill_and_decode(executor_for_case(cases[0], None), ids)):
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_make_model_plans_the_tensors_transformers_builds():
    """make-model's tensor plan for each new family and size: transformers' parameter names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hotstart.bench import make_model as mm
    from hotstart.bench import model_sizes

    for name in ("phi3", "olmo2"):
        fam, made = families.by_name(name), model_sizes.by_name(name)
        for size, shape in made.sizes.items():
            hidden, inter, _, heads, kv, _, tied = shape
            raw = {"architectures": [fam.architectures[0]], "model_type": fam.model_type,
                   "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 2,
                   "num_attention_heads": heads, "num_key_value_heads": kv, **made.config,
                   **made.size_config.get(size, {}),
                   "tie_word_embeddings": tied, "vocab_size": 1024, "pad_token_id": 0, "eos_token_id": 2}
            plan = {n: s for n, s, _ in mm.tensor_plan(raw)}
            kwargs = {k: v for k, v in raw.items() if k != "model_type"}
            config = AutoConfig.for_model(fam.model_type, **kwargs)
            with torch.device("meta"):
                ref = AutoModelForCausalLM.from_config(config)
            want = {n: tuple(p.shape) for n, p in ref.state_dict().items()}
            if tied:
                want.pop("lm_head.weight")
            assert plan == want, (name, size)


def test_make_model_sizes_have_the_published_parameter_counts():
    from argparse import Namespace

    from hotstart.bench import make_model as mm

    def params(family: str, size: str, vocab: int) -> float:
        ns = Namespace(family=family, size=size, layers=None, hidden=None, intermediate=None, heads=None,
                       kv_heads=None, head_dim=None, vocab=vocab, tie=None, dtype="bfloat16")
        return sum(mm._numel(s) for _, s, _ in mm.tensor_plan(mm.build_config(ns, 1000, {}))) / 1e9

    assert params("phi3", "mini", 32064) == pytest.approx(3.821, abs=0.005)  # Phi-3.5-mini-instruct
    assert params("phi3", "phi4-mini", 200064) == pytest.approx(3.836, abs=0.005)  # Phi-4-mini-instruct
    assert params("olmo2", "1b", 100352) == pytest.approx(1.485, abs=0.005)  # OLMo-2-0425-1B
    assert params("olmo2", "7b", 100352) == pytest.approx(7.299, abs=0.005)  # OLMo-2-1124-7B
