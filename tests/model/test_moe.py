"""Mixture of experts (hotstart/model/moe.py): the grouped expert computation against a per-token loop,
experts as zero-copy views of the file, the config fields read and refused, tensor parallel inside each
expert (two ranks give the logits of one), and a real server answering with a MoE checkpoint. Logits and
greedy tokens against transformers: tests/model/test_model_reference.py (every family)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.families import tiny_checkpoints
from helpers.reference import LOGIT_ATOL, greedy, prefill_logits, reference_greedy
from helpers.server import Server
from helpers.tp_ranks import executor_for_case, prefill_and_decode, run_two_ranks

from hotstart import families
from hotstart.config import EngineConfig, load_model_config
from hotstart.engine.core import EngineCore
from hotstart.errors import HotstartError, ModelConfigError
from hotstart.messages import EngineRequest
from hotstart.model import parallel
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model
from hotstart.model.moe import SparseMoE
from hotstart.model_config import parse_model_config
from hotstart.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
TINY = tiny_checkpoints()
MOE = [f.name for f in families.FAMILIES if f.moe is not None]


def _cfg(family: str, **changes):
    model_type, kw = TINY[family]
    return parse_model_config({"model_type": model_type, **kw, **changes}, Path("/m/config.json"))


def _random_moe(family: str, dtype: torch.dtype) -> SparseMoE:
    cfg = _cfg(family)
    block = SparseMoE(cfg, fused=False, moe=families.by_name(family).moe)
    g = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3).to(dtype)
    return block


def _per_token(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The plainest reading of the routing: each token through its k experts, one at a time."""
    weights, ids = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            out[t] += w * block.experts[e](x[t:t + 1])[0]
        if block.shared_expert is not None:
            row = x[t:t + 1]
            out[t] += torch.sigmoid(block.shared_expert_gate(row))[0] * block.shared_expert(row)[0]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("family", MOE)
def test_grouped_experts_equal_a_per_token_loop_and_run_only_active_experts(family, dtype, tol):
    block = _random_moe(family, dtype)
    calls: list[int] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls.append(e))
    for tokens in (1, 2, 17):
        x = torch.randn(tokens, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
        x = x.to(dtype)
        calls.clear()
        with torch.no_grad():
            got, want = block(x), _per_token(block, x)
        active = sorted(set(block.route(x)[1].flatten().tolist()))
        assert calls[:len(active)] == active  # one call per active expert, in expert order
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()  # relative to the output
        assert err < tol, err


def test_expert_weights_are_views_of_the_file(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2-moe")
    model = load_model(load_model_config(model_dir), weight_files(model_dir))
    files = {str(p) for p in weight_files(model_dir)}
    with open("/proc/self/maps") as f:
        ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                  if len(line.split()) >= 6 and line.split()[5] in files]
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n or ".shared_expert" in n]
    assert len(experts) == 3 * (5 * 3 + 3 + 1)  # 3 MoE layers: 5 experts, a shared one and its gate
    outside = [n for n, p in experts if not any(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi
                                                for lo, hi in ranges)]
    assert ranges and outside == []  # each expert's bytes inside the file's mapping: no copies


def test_moe_fields_read_as_transformers_reads_them():
    q2, q3, mx = _cfg("qwen2-moe"), _cfg("qwen3-moe"), _cfg("mixtral")
    assert (q2.num_experts, q2.num_experts_per_tok, q2.moe_layers) == (5, 3, (0, 2, 3))
    assert not q2.norm_topk_prob
    assert q2.shared_expert_intermediate_size == 56 and q2.qkv_bias  # qkv_bias absent: True (Qwen1.5-MoE)
    assert q3.moe_layers == (1, 3) and q3.norm_topk_prob and q3.shared_expert_intermediate_size == 0
    assert mx.moe_layers == (0, 1) and mx.norm_topk_prob and mx.moe_intermediate_size == mx.intermediate_size
    # Qwen3-MoE writes num_local_experts (transformers' attribute_map); Qwen releases write num_experts
    assert _cfg("qwen3-moe", num_local_experts=9).num_experts == 9
    assert _cfg("mixtral", router_aux_loss_coef=0.02, router_jitter_noise=0.1) == mx  # training only


@pytest.mark.parametrize("family,changes,message", [
    ("qwen3-moe", {"num_experts_per_tok": 8}, r"field 'num_experts_per_tok' \(8\) is more than the experts"),
    ("qwen2-moe", {"mlp_only_layers": "1"}, r"field 'mlp_only_layers' must be a list of layer indices"),
    ("qwen2-moe", {"decoder_sparse_step": 0}, r"field 'decoder_sparse_step' must be > 0"),
    ("mixtral", {"num_local_experts": "8"}, r"field 'num_local_experts' must be int"),
])
def test_bad_moe_fields_are_refused_naming_the_field(family, changes, message):
    with pytest.raises(ModelConfigError, match=message) as e:
        _cfg(family, **changes)
    assert str(e.value).startswith("/m/config.json: ") and "\n" not in str(e.value)


# sliding windows shorter than the text, in the layers transformers slides for each family
MOE_WINDOWS = [
    ("mixtral", {"sliding_window": 6}),  # every layer
    ("qwen3-moe", {"use_sliding_window": True, "sliding_window": 6}),  # every layer
    ("qwen2-moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3}),  # layers 0, 2
    ("qwen2-moe", {"use_sliding_window": True, "sliding_window": 5,
                   "layer_types": ["full_attention", "sliding_attention"] * 2}),
]


@pytest.mark.parametrize("family,changes", MOE_WINDOWS,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(MOE_WINDOWS)])
def test_windows_in_moe_models_match_transformers(tmp_path, family, changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = TINY[family]
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**kw, **changes}),
                                              dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    cfg = load_model_config(tmp_path)
    assert any(cfg.layer_window(i) for i in range(cfg.num_hidden_layers))
    core = EngineCore.build(EngineConfig(
        model_path=str(tmp_path), weight_files=tuple(str(p) for p in weight_files(tmp_path)), device="cpu",
        dtype="float32", kv_cache_memory=16 << 20, max_model_len=1024, block_size=4))
    ids = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    want = reference_greedy(theirs, ids, 24, eos=None)
    assert greedy(core, ids, 24) == want  # decode past the window: paged blocks, windowed decode attention
    text = ids + want
    with torch.no_grad():
        their_logits = theirs(torch.tensor([text])).logits[0, -1]
    our_logits = prefill_logits(core, text)  # one prefill of 43 tokens: the windowed prefill mask
    err = (our_logits - their_logits).abs().max()
    assert torch.allclose(our_logits, their_logits, atol=LOGIT_ATOL, rtol=0), err


def test_a_qwen2_moe_window_is_unread_without_use_sliding_window():
    assert _cfg("qwen2-moe", sliding_window=0).sliding_window is None


def test_an_expert_width_not_divisible_is_named():
    cfg = _cfg("qwen3-moe", moe_intermediate_size=37)
    with pytest.raises(HotstartError, match=r"moe_intermediate_size \(37\) must be divisible"):
        parallel.local_config(cfg, 2)


def test_two_ranks_give_the_logits_of_one(tiny_checkpoint, tmp_path):
    cases = [{"name": f"{fam}{'-fused' if fused else ''}", "model": str(tiny_checkpoint(f"{fam}-tp")),
              "fused": fused, "ids": list(range(3, 22))} for fam in MOE for fused in (False, True)]
    got = run_two_ranks(cases, tmp_path, 300)
    for case in cases:
        want = prefill_and_decode(executor_for_case(case, None), case["ids"])
        for step, (ours, ref) in enumerate(zip(got[case["name"]], want)):
            assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (case["name"], step,
                                                                  (ours - ref).abs().max())


def test_the_server_answers_with_the_engines_greedy_tokens(tiny_checkpoint, default_model_dir, tmp_path):
    """Qwen2-MoE (shared expert, a dense layer) through `hotstart serve`, its weights packed for oneDNN."""
    import time

    import httpx

    from hotstart.text.tokenizer import Tokenizer

    model = Path(shutil.copytree(tiny_checkpoint("qwen2-moe"), tmp_path / "qwen2-moe"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    ids = list(range(40, 57))
    cfg = EngineConfig(model_path=str(model), weight_files=tuple(map(str, weight_files(model))), device="cpu",
                       dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    core = EngineCore.build(cfg)
    core.add_request(EngineRequest("r", ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    want: list[int] = []
    while core.has_work():
        for o in core.step():
            want += o.new_token_ids
    s = Server(str(model), "--device", "cpu", "--dtype", "float32", "--compile", "eager-only",
               "--max-model-len", "256")
    try:
        tok = Tokenizer.from_dir(model)
        for packed in (False, True):  # the plain weights, then the oneDNN-packed ones (experts included)
            deadline = time.monotonic() + 60
            while packed and not (fast := httpx.get(s.url + "/startup").json()["fast_path"])["packing"] \
                    .startswith("packed"):
                assert time.monotonic() < deadline, fast
                time.sleep(0.05)
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": model.name, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}).json()
            assert r["choices"][0]["logprobs"]["tokens"] == [tok.token_text(i) for i in want], packed
    finally:
        s.stop()
