"""A GGUF model's decode step in one kernel call (hotstart/model/quant_step.py, kernels/quant_step.cpp):
its logits equal model/layer_ops.py's step bit for bit (same kernels, same order, the products finished as
QuantLinear.finish rounds them), in float32 and bf16, with llama's q/k row order, qwen2's biases, several
sequences in the decode group's longest-first order, and K-quant mixes; steps with a prompt in them keep
the layer ops; the fast path says why it is off (a float tensor, HOTSTART_QUANT_STEP=off)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import greedy_batch
from helpers.gguf import make
from helpers.kernels import load_shared_kernels

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import pack_model
from hotstart.engine.fastpath.pack import install_kernels
from hotstart.model import cpu_kernels, quant, quant_kernels, quant_step


@pytest.fixture(autouse=True)
def _library(tmp_path_factory, monkeypatch):
    monkeypatch.delenv("HOTSTART_QUANT_KERNEL", raising=False)  # the suite's default keeps GGUF on torch
    load_shared_kernels(tmp_path_factory, monkeypatch)
    yield
    quant.set_kernel(None)  # the install registered the kernels: later tests of this worker get the default


def _engine(path, dtype: str) -> tuple[EngineCore, list[str]]:
    """An engine on the GGUF at PATH with the fast path's kernels installed (as the fast path does)."""
    cfg = EngineConfig(model_path=str(path), weight_files=(str(path),), device="cpu", dtype=dtype,
                       max_model_len=128, kv_cache_memory=16 << 20, enable_prefix_caching=False)
    core = EngineCore.build(cfg)
    pack_model(core.runner.model, copies=False)  # a GGUF's packing stage: the groups, no copies
    return core, install_kernels(core.runner.model, cpu_kernels.build(), ("", "", ""), copies=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,mix", [("llama", "Q4_1"), ("qwen2", "Q5_0"), ("llama", "Q4_K_M"),
                                        ("qwen2", "Q8_0")])
def test_one_call_decode_steps_equal_the_layer_ops_bit_for_bit(family, mix, dtype, tmp_path_factory):
    """Three prompts (8, 11, 14 tokens) prefilled, then decode steps of 3, 2 and 1 sequences: every decode
    step runs in one call (counted), every prefill through the layer ops; logits and tokens equal an
    engine on the same file whose every step takes the layer ops."""
    if dtype == "bfloat16" and not cpu_kernels.attention_supported(torch.bfloat16):
        pytest.skip("no bf16 kernels on this CPU")
    path, _ = make(family, mix, tmp_path_factory.mktemp(f"{family}-{mix}"))
    fused, notes = _engine(path, dtype)
    assert "one-call decode step" in notes, notes
    plain, _ = _engine(path, dtype)
    plain.runner.model.quant_step = None

    step, served = fused.runner.model.quant_step, []

    def counted(h, meta):
        out = step(h, meta)
        served.append(out is not None)
        return out

    fused.runner.model.quant_step = counted
    got_logits, want_logits = [], []
    got = greedy_batch(fused, got_logits, (12, 16, 20), ignore_eos=True)
    want = greedy_batch(plain, want_logits, (12, 16, 20), ignore_eos=True)
    assert got == want
    assert served.count(True) >= 19 and not all(served)  # the decode steps; the prefill kept the layer ops
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits, strict=True):
        assert torch.equal(a, b)


def test_the_fast_path_says_why_there_is_no_one_call_step(tmp_path_factory, monkeypatch):
    path, _ = make("llama", "BF16", tmp_path_factory.mktemp("llama-bf16"))  # float tensors: torch multiplies
    core, notes = _engine(path, "float32")
    assert core.runner.model.quant_step is None and not any("one-call" in n for n in notes)
    model = core.runner.model
    assert quant_kernels.bind()  # the matmul kernel loaded (install binds it for quantized models only)
    assert quant_step.unsupported(model) == "a projection not in quantized blocks the kernel takes"

    path, _ = make("llama", "Q4_0", tmp_path_factory.mktemp("llama-q4_0"))
    monkeypatch.setenv("HOTSTART_QUANT_STEP", "off")
    core, notes = _engine(path, "float32")
    assert core.runner.model.quant_step is None and core.runner.model.layer_ops
    assert "no one-call decode step: HOTSTART_QUANT_STEP=off" in notes
