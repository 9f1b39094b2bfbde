"""The small-batch kernel (hotstart/model/gemv.py): equal to a float64 matmul on odd shapes, segments and
strided rows; a model whose steps of few tokens run through it equals the plain path in float32
(greedy identical); the fast path builds, loads and attaches it behind READY, says so, and serves on
when it cannot be built."""

from __future__ import annotations

import time

import pytest
import torch

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath, pack_model
from hotstart.engine.fastpath.pack import attach_gemv
from hotstart.messages import EngineRequest, SamplingParams
from hotstart.messages import FastPathState as S
from hotstart.model import gemv
from hotstart.model.files import weight_files

DTYPES = [torch.float32, torch.bfloat16]


def _needs(dtype: torch.dtype) -> None:
    if gemv.compiler() is None:
        pytest.skip("no C++ compiler: the engine serves with oneDNN alone")
    if not gemv.supported(dtype):
        pytest.skip(f"this CPU lacks the instructions of the {dtype} kernel (the engine says so and "
                    "serves with oneDNN)")


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path_factory.getbasetemp() / "gemv-home"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_a_float64_matmul(dtype):
    """Rows 1-5 (5: a second pass over the weights), widths not a multiple of the vector (33, 100) and
    one that is (576), three segments side by side with and without biases, a weight whose rows are a
    view of a wider tensor, float32 or bf16 out."""
    _needs(dtype)
    gemv.load(gemv.build())
    g = torch.Generator().manual_seed(0)
    for k in (33, 100, 576):
        wide = torch.randn(21, k + 7, generator=g).to(dtype)
        weights = [torch.randn(37, k, generator=g).to(dtype), wide[:, 3:3 + k],
                   torch.randn(5, k, generator=g).to(dtype)]
        assert weights[1].stride(0) == k + 7
        for biased in (False, True):
            biases = [torch.randn(w.shape[0], generator=g).to(dtype) if biased else None for w in weights]
            seg = gemv.Segments(weights, biases)
            for m in range(1, 6):
                x = torch.randn(m, k, generator=g).to(dtype)
                ref = x.double() @ torch.cat(weights).double().t()
                if biased:
                    ref = ref + torch.cat(biases).double()
                outs = [seg(x)] + ([seg(x, torch.float32)] if dtype == torch.bfloat16 else [])
                for out in outs:
                    assert out.shape == (m, 63)
                    scale = ref.abs().max().item()
                    # float32: accumulation order; bf16: the products are exact, the sum float32, then one
                    # rounding to bf16 (<= 2^-8 relative) unless the output is float32
                    tol = 1e-5 * scale if out.dtype == torch.float32 else 2 ** -8 * ref.abs() + 1e-4 * scale
                    assert ((out.double() - ref).abs() <= tol).all(), (k, m, biased, out.dtype)


def _core(model_dir, dtype: str = "float32") -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20)
    return EngineCore.build(cfg)


def _greedy(core: EngineCore, logits: list) -> list[list[int]]:
    """Three greedy requests, batched: their decodes run 3, then 2, then 1 at a time (all <= MAX_ROWS)."""
    tag = time.monotonic_ns()
    for i in range(3):
        core.add_request(EngineRequest(f"{i}-{tag}", list(range(3, 9 + 5 * i)),
                                       SamplingParams(max_tokens=12 + 4 * i, temperature=0)))
    out: dict[str, list[int]] = {}
    forward = core.runner.forward

    def keep(batch, want, *rest):
        x = forward(batch, want, *rest)
        if x is not None and len(batch) <= gemv.MAX_ROWS and all(n == 1 for _, n in batch):
            logits.append(x.clone())
        return x

    core.runner.forward = keep
    try:
        while core.has_work():
            for o in core.step():
                out.setdefault(o.request_id.split("-")[0], []).extend(o.new_token_ids)
    finally:
        core.runner.forward = forward
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2-moe", "phi3", "gemma2"])
def test_model_through_the_kernel_equals_plain_in_float32(family, tiny_checkpoint, monkeypatch):
    """qwen2's q/k/v biases, llama, the experts of qwen2-moe, phi3's fused checkpoint, gemma2's tied head
    and soft-capping: every decode step of <= MAX_ROWS tokens goes through the kernel (counted) and the
    greedy tokens are those of the plain path, logits within float32 accumulation order."""
    _needs(torch.float32)
    core = _core(tiny_checkpoint(family))
    ref_logits: list = []
    ref = _greedy(core, ref_logits)
    model = core.runner.model
    pack_model(model)
    gemv.load(gemv.build())
    assert attach_gemv(model) >= len(model.model.layers) + 1
    calls = []
    call = gemv.Segments.__call__
    monkeypatch.setattr(gemv.Segments, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    logits: list = []
    assert _greedy(core, logits) == ref
    assert len(calls) >= len(logits) * (len(model.model.layers) + 1)  # every layer and the LM head
    assert len(logits) == len(ref_logits) > 0
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def _settle(fast: FastPath) -> None:
    deadline = time.monotonic() + 300
    while fast.busy() and time.monotonic() < deadline:
        fast.tick(idle=True)
        time.sleep(0.01)
    assert not fast.busy()


def test_the_fast_path_builds_and_attaches_it_behind_ready(tiny_checkpoint, tmp_path, monkeypatch):
    """Built by g++ in a child process into $HOTSTART_HOME/kernels (the next engine loads it from there),
    attached once the layers are prepacked, and named in the packing stage's detail."""
    _needs(torch.float32)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    core = _core(tiny_checkpoint("llama"))
    fast = FastPath(core, "eager-only", (8,), lambda m: None)
    _settle(fast)
    status = fast.status()
    assert status.packing is S.PACKED and "small-batch kernel on" in status.packing_detail, status
    assert gemv.library_path().parent == tmp_path / "kernels" and gemv.library_path().exists()
    assert core.runner.model.lm_head_gemv is not None
    again = FastPath(_core(tiny_checkpoint("llama")), "eager-only", (8,), lambda m: None)
    again.tick(idle=True)
    assert again._gemv_build is None  # cached: no second compile


def test_without_the_kernel_the_engine_serves_with_onednn(tiny_checkpoint, tmp_path, monkeypatch):
    """HOTSTART_GEMV=off, or a compiler that fails: the packing stage says why and every step runs
    on oneDNN (greedy tokens as before)."""
    _needs(torch.float32)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    for env, why in ((("HOTSTART_GEMV", "off"), "HOTSTART_GEMV=off"), (("CXX", "false"), "g++ failed")):
        monkeypatch.setenv(*env)
        core = _core(tiny_checkpoint("llama"))
        fast = FastPath(core, "eager-only", (8,), lambda m: None)
        _settle(fast)
        status = fast.status()
        assert status.packing is S.PACKED and why in status.packing_detail, status
        assert core.runner.model.lm_head_gemv is None
        assert sum(map(len, _greedy(core, []))) == 12 + 16 + 20
        monkeypatch.delenv(env[0])
