"""The CPU kernels' layer ops (hotstart/model/layer_ops.py, kernels/layer_ops.cpp): each op equals the
torch ops it replaces (float32 to accumulation order, bf16 but for a last-bit rounding of a norm's or a
SiLU's float32 arithmetic) on odd widths and partial rotary; Llama-shaped models (llama, qwen2's biases,
mistral's window, phi3's fused checkpoint and partial rotary) give the plain path's greedy tokens in
float32 with every step of few tokens through them; other families say why they keep the torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.engine import greedy_batch
from helpers.kernels import load_shared_kernels

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import pack_model
from hotstart.engine.fastpath.pack import install_kernels
from hotstart.model import cpu_kernels, layer_ops
from hotstart.model.files import weight_files
from hotstart.model.layers import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _library(tmp_path_factory, monkeypatch):
    load_shared_kernels(tmp_path_factory, monkeypatch)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: to accumulation order; bf16: equal but for a few elements one bf16 step apart."""
    scale = ref.float().abs().max().item()
    diff = (out.float() - ref.float()).abs()
    if dtype == torch.float32:
        assert diff.max().item() <= 1e-5 * scale
    else:
        assert (diff <= 2 ** -7 * ref.float().abs() + 1e-6 * scale).all()
        assert (diff > 0).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_op_equals_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(0)
    for rows, n in ((1, 100), (3, 576), (70, 37)):  # 70 x 37: rows over threads, a width of no vector
        x, delta = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
        norm = RMSNorm(n, 1e-6)
        norm.weight.data = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
        out, s = cpu_kernels.add_rmsnorm(x, delta, norm.weight, norm.eps)
        assert torch.equal(s, x + delta)  # one rounding of the sum, as torch's add
        _close(out, norm(x + delta), dtype)
        alone, same = cpu_kernels.add_rmsnorm(x, None, norm.weight, norm.eps)
        assert same is x
        _close(alone, norm(x), dtype)
        gate_up = (3 * torch.randn(rows, 2 * n, generator=g)).to(dtype)
        gate, up = gate_up.split(n, dim=-1)
        _close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary", [(64, 64), (20, 20), (36, 24)], ids=["64", "20", "partial"])
def test_rope_and_kv_write_equal_the_torch_ops(dtype, head_dim, rotary):
    """q rotated, k rotated into its cache slots and v copied into its slots, as RotaryEmbedding.apply and
    Attention.attend's index_copy_ do (bit for bit: the same products and sum, each rounded)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, tokens, slots = 6, 2, 5, 40
    y = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, rotary // 2, generator=g) * 6
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    sin[..., : rotary // 2].neg_()  # the table's sign (RotaryEmbedding.build)
    cos, sin = emb.cos().to(dtype), sin.to(dtype)
    slot = torch.tensor([3, 17, 0, 39, 8])
    k_cache, v_cache = (torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = cpu_kernels.rope_kv(y, heads, kv_heads, head_dim, cos, sin, slot, k_cache, v_cache)
    q_ref, k_ref, v_ref = y.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    assert torch.equal(q, RotaryEmbedding.apply(q_ref.view(tokens, heads, head_dim), cos, sin))
    k_rot = RotaryEmbedding.apply(k_ref.view(tokens, kv_heads, head_dim), cos, sin)
    ref_k.index_copy_(1, slot, k_rot.transpose(0, 1))
    ref_v.index_copy_(1, slot, v_ref.reshape(tokens, kv_heads, head_dim).transpose(0, 1))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _core(model_dir) -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    return EngineCore.build(cfg)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_llama_shaped_models_through_the_layer_ops_equal_plain_in_float32(family, tiny_checkpoint,
                                                                          monkeypatch):
    """Prefills (8-14 tokens) and decodes of 3, 2, then 1 sequences all take the layer ops (counted) with
    the GEMV and the paged decode kernel: greedy tokens of the plain path, logits within 1e-4 of scale."""
    core = _core(tiny_checkpoint(family))
    ref_logits: list = []
    ref = greedy_batch(core, ref_logits, (12, 16, 20), ignore_eos=True)
    model = core.runner.model
    pack_model(model)
    notes = install_kernels(model, cpu_kernels.build(), ("", "", ""))
    assert model.layer_ops and "layer ops" in notes
    steps, forward = [], layer_ops.forward
    monkeypatch.setattr(layer_ops, "forward", lambda *a: steps.append(1) or forward(*a))
    logits: list = []
    assert greedy_batch(core, logits, (12, 16, 20), ignore_eos=True) == ref
    assert len(steps) >= 20  # every step: one prefill step (or more) and 19 decode steps
    assert len(logits) == len(ref_logits) > 0
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


@pytest.mark.parametrize("family,why", [("gemma2", "not a Llama-shaped model"),
                                        ("qwen3", "q/k norms or an activation other than SiLU"),
                                        ("olmo2", "not a Llama-shaped layer"),
                                        ("qwen2-moe", "not a Llama-shaped layer")])
def test_other_families_say_why_and_keep_the_torch_ops(family, why, tiny_checkpoint):
    core = _core(tiny_checkpoint(family))
    model = core.runner.model
    pack_model(model)
    assert f"no layer ops: {why}" in install_kernels(model, cpu_kernels.build(), ("", "", ""))
    assert not model.layer_ops
    # and the plan's reason (HOTSTART_LAYER_OPS=off, no compiler, tensor parallel) keeps them off too
    llama = _core(tiny_checkpoint("llama")).runner.model
    pack_model(llama)
    notes = install_kernels(llama, cpu_kernels.build(), ("", "", "HOTSTART_LAYER_OPS=off"))
    assert not llama.layer_ops and not any("layer ops" in n for n in notes)
