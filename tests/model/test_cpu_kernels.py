"""hotstart's CPU kernels (hotstart/model/cpu_kernels.py): the small-batch linear kernel equals a float64
matmul on odd shapes, segments and strided rows (the paged decode kernel against its reference:
tests/model/test_paged_attention.py); a model whose steps run through both equals the plain path in
float32 (greedy identical); the fast path builds, loads and attaches them behind READY, says so, and
serves on when they cannot be built."""

from __future__ import annotations

import time

import pytest
import torch
from util import greedy_batch

from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath, pack_model
from hotstart.engine.fastpath.pack import attach_gemv
from hotstart.messages import FastPathState as S
from hotstart.model import cpu_kernels
from hotstart.model.files import weight_files

DTYPES = [torch.float32, torch.bfloat16]
# three greedy requests of 12, 16 and 20 tokens: their decodes run 3, then 2, then 1 at a time, all
# <= MAX_ROWS (the small-batch kernel's)
RAGGED = (12, 16, 20)


def _needs(dtype: torch.dtype) -> None:
    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler: the engine serves with oneDNN alone")
    if not cpu_kernels.supported(dtype):
        pytest.skip(f"this CPU lacks the instructions of the {dtype} kernel (the engine says so and "
                    "serves with oneDNN)")


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path_factory.getbasetemp() / "gemv-home"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_a_float64_matmul(dtype):
    """Rows 1-5 (5: a second pass over the weights), widths not a multiple of the vector (33, 100) and
    one that is (576), rows too long for 4 rows of x in L1 (5,000: taken in pieces), three segments side
    by side with and without biases, a weight whose rows are a view of a wider tensor, float32 or bf16
    out."""
    _needs(dtype)
    cpu_kernels.load(cpu_kernels.build())
    g = torch.Generator().manual_seed(0)
    for k in (33, 100, 576, 5000):
        wide = torch.randn(21, k + 7, generator=g).to(dtype)
        weights = [torch.randn(37, k, generator=g).to(dtype), wide[:, 3:3 + k],
                   torch.randn(5, k, generator=g).to(dtype)]
        assert weights[1].stride(0) == k + 7
        for biased in (False, True):
            biases = [torch.randn(w.shape[0], generator=g).to(dtype) if biased else None for w in weights]
            seg = cpu_kernels.Segments(weights, biases)
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


def test_tile_kernel_equals_a_float64_matmul():
    """bf16 steps of 2 - 48 tokens through the repacked copy: widths not a multiple of 64 outputs (37 + 5)
    nor of 2 inputs (33), a bias on one segment, bf16 or float32 out: one bf16 rounding of a float32 sum
    of exact products."""
    if not cpu_kernels.tiles_supported(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16 (the engine keeps oneDNN past the GEMV's 4 tokens)")
    cpu_kernels.load(cpu_kernels.build())
    g = torch.Generator().manual_seed(2)
    for n, k in ((37, 33), (200, 100), (960, 576)):
        weights = [torch.randn(n, k, generator=g).bfloat16(), torch.randn(5, k, generator=g).bfloat16()]
        biases = [torch.randn(n, generator=g).bfloat16(), None]
        seg = cpu_kernels.Segments(weights, biases, tiles=True)
        assert seg.tiles.nbytes >= sum(w.nbytes for w in weights)  # a copy, padded
        for m in (2, 5, 7, 13, 48):
            assert seg.fits(torch.empty(m, k))
            x = torch.randn(m, k, generator=g).bfloat16()
            bias = torch.cat([biases[0], torch.zeros(5)]).double()
            ref = x.double() @ torch.cat(weights).double().t() + bias
            scale = ref.abs().max().item()
            for out_dtype in (torch.bfloat16, torch.float32):
                out = seg(x, out_dtype)
                assert out.shape == (m, n + 5) and out.dtype == out_dtype
                tol = (2 ** -8 if out_dtype == torch.bfloat16 else 0) * ref.abs() + 1e-5 * scale
                assert ((out.double() - ref).abs() <= tol).all(), (n, k, m, out_dtype)
    assert not seg.fits(torch.empty(cpu_kernels.TILE_MAX_ROWS + 1, k))


def _core(model_dir, dtype: str = "float32") -> EngineCore:
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20)
    return EngineCore.build(cfg)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2-moe", "phi3", "gemma2", "gemma3", "mistral"])
def test_model_through_the_kernels_equals_plain_in_float32(family, tiny_checkpoint, monkeypatch):
    """qwen2's q/k/v biases, llama, the experts of qwen2-moe, phi3's fused checkpoint, gemma2's tied head,
    soft-capping and sliding layers, mistral's window: every decode step of <= MAX_ROWS tokens goes
    through the small-batch kernel and every decode attention through the paged kernel (both counted),
    and the greedy tokens are those of the plain path, logits within float32 accumulation order."""
    _needs(torch.float32)
    core = _core(tiny_checkpoint(family))
    ref_logits: list = []
    ref = greedy_batch(core, ref_logits, RAGGED, ignore_eos=True)
    model = core.runner.model
    pack_model(model)
    cpu_kernels.load(cpu_kernels.build())
    assert attach_gemv(model) >= len(model.model.layers) + 1
    cpu_kernels.enable_attention(True)
    calls, attended = [], []
    call, attend = cpu_kernels.Segments.__call__, cpu_kernels._attention_fn
    monkeypatch.setattr(cpu_kernels.Segments, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    monkeypatch.setattr(cpu_kernels, "_attention_fn", lambda *a: attended.append(1) or attend(*a))
    logits: list = []
    assert greedy_batch(core, logits, RAGGED, ignore_eos=True) == ref
    layers = len(model.model.layers)
    decodes = max(RAGGED) - 1  # decode steps (the longest request's: its first token came with its prefill)
    assert len(calls) >= decodes * (layers + 1)  # every layer and the LM head, at each of those steps
    assert len(attended) >= decodes * layers
    assert len(logits) == len(ref_logits) > 0
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_bfloat16_steps_through_every_kernel_add_no_error(default_model_dir):
    """The default model in bf16, a 40-token prompt teacher-forced (one step of 40 tokens: the tile kernel,
    the layer ops) and 4 greedy requests decoding together: the kernels add no error beyond bf16's own
    (against the float32 model: mean |error| within 1.25x of the plain bf16 path's, top-1 agreement
    within 5 points), and it serves."""
    if not cpu_kernels.tiles_supported(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16 (no tile kernel)")
    from hotstart.engine.fastpath.pack import install_kernels
    from hotstart.engine.model_runner import StepInputs

    ids = [(i * 7919) % 49000 + 3 for i in range(40)]

    def logits(core):
        return core.runner.run(StepInputs(ids, [0], [len(ids)], [[1, 2, 3]], [False], [True]))

    exact = logits(_core(default_model_dir, "float32"))
    core = _core(default_model_dir, "bfloat16")
    plain = logits(core)
    model = core.runner.model
    pack_model(model)
    notes = install_kernels(model, cpu_kernels.build(), ("", "", ""))
    assert f"(<= {cpu_kernels.TILE_MAX_ROWS} tokens)" in notes[0] and model.layer_ops, notes
    tiles, call = [], cpu_kernels.Tiles.__call__
    cpu_kernels.Tiles.__call__ = lambda self, *a: tiles.append(1) or call(self, *a)
    try:
        fast = logits(core)
        assert len(tiles) == len(model.model.layers) * 4 + 1  # q/k/v, o, gate/up, down; the LM head
        assert sum(len(t) for t in greedy_batch(core).values()) == 4 * 24
    finally:
        cpu_kernels.Tiles.__call__ = call
    err_plain, err_fast = (plain - exact).abs().mean().item(), (fast - exact).abs().mean().item()
    assert err_fast <= 1.25 * err_plain + 1e-3, (err_fast, err_plain)
    top1 = lambda x: (x.argmax(-1) == exact.argmax(-1)).float().mean().item()  # noqa: E731
    assert top1(fast) >= top1(plain) - 0.05


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
    assert status.packing is S.PACKED and "small-batch kernels on" in status.packing_detail, status
    assert cpu_kernels.library_path().parent == tmp_path / "kernels" and cpu_kernels.library_path().exists()
    assert core.runner.model.lm_head_gemv is not None and cpu_kernels._attention_fn is not None
    assert "paged decode kernel" in status.packing_detail
    again = FastPath(_core(tiny_checkpoint("llama")), "eager-only", (8,), lambda m: None)
    again.tick(idle=True)
    assert again._kernels_build is None  # cached: no second compile


def test_without_the_kernels_the_engine_serves_on(tiny_checkpoint, tmp_path, monkeypatch):
    """HOTSTART_GEMV=off, HOTSTART_DECODE_KERNEL=off, or a compiler that fails: the packing stage says
    which kernel is off and why, and the steps run on oneDNN / torch's attention (and serve)."""
    _needs(torch.float32)
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path))
    for env, why in ((("HOTSTART_GEMV", "off"), "no small-batch kernel: HOTSTART_GEMV=off"),
                     (("HOTSTART_DECODE_KERNEL", "off"), "paged decode kernel: HOTSTART_DECODE_KERNEL=off"),
                     (("CXX", "false"), "no small-batch kernel: g++ failed")):
        monkeypatch.setenv(*env)
        core = _core(tiny_checkpoint("llama"))
        fast = FastPath(core, "eager-only", (8,), lambda m: None)
        _settle(fast)
        status = fast.status()
        assert status.packing is S.PACKED and why in status.packing_detail, status
        assert (core.runner.model.lm_head_gemv is None) == (env[0] != "HOTSTART_DECODE_KERNEL")
        assert (cpu_kernels._attention_fn is None) == (env[0] != "HOTSTART_GEMV")
        assert sum(map(len, greedy_batch(core, None, RAGGED, ignore_eos=True).values())) == sum(RAGGED)
        monkeypatch.delenv(env[0])
