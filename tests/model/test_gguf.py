"""GGUF served directly: every tensor type dequantized bit-exact against the `gguf` package, the header
reader against its GGUFReader, odd-shaped random-weight GGUFs of each family against a float32
transformers model of the same dequantized weights, and each refusal's one line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.gguf import make
from helpers.reference import float32_engine, greedy, prefill_logits

from hotstart.bench.gguf_make import SCALES, random_blocks
from hotstart.boot.default_model import find_gguf
from hotstart.errors import HotstartError, WeightsError
from hotstart.gguf_file import TYPES, GGUFFile, SkippedStrings, lean_header
from hotstart.messages import Span
from hotstart.model import quant
from hotstart.model_config import load_model_config


@pytest.mark.parametrize("ggml_type", sorted(TYPES), ids=lambda t: TYPES[t][0])
def test_every_type_dequantizes_bit_exact(ggml_type):
    import gguf

    name, block, size = TYPES[ggml_type]
    rng = np.random.default_rng(ggml_type)
    if block == 1:
        blocks = random_blocks(name, 7, 37, rng)
    else:  # every bit pattern of quants and sub-block scales; the float16 scales finite
        blocks = rng.integers(0, 256, (7, 3, size), dtype=np.uint8)
        off, n = SCALES[name]
        blocks[..., off:off + 2 * n] = rng.standard_normal((7, 3, n)).astype(np.float16).view(np.uint8)
        blocks = blocks.reshape(7, -1)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type))
    got = quant.dequantize(torch.from_numpy(blocks), ggml_type).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))


def test_quant_linear_reference_and_the_kernel_slot():
    rng = np.random.default_rng(0)
    w = torch.from_numpy(random_blocks("Q4_K", 5, 512, rng))
    x = torch.randn(3, 512)
    layer = quant.QuantLinear(w, 12, 512)
    assert torch.equal(layer(x), F.linear(x, quant.dequantize(w, 12)))
    calls = []

    def kernel(xk, wk, t):
        calls.append((tuple(xk.shape), tuple(wk.shape), t))
        return None if xk.shape[0] > 1 else torch.full((1, wk.shape[0]), 7.0)

    quant.set_kernel(kernel)
    try:
        assert torch.equal(layer(x[:1]), torch.full((1, 5), 7.0))  # handled
        assert torch.equal(layer(x), F.linear(x, quant.dequantize(w, 12)))  # None: the reference
    finally:
        quant.set_kernel(None)
    assert calls == [((1, 512), (5, 288), 12), ((3, 512), (5, 288), 12)]


@pytest.mark.parametrize("chunk", [1 << 22, 512 * 3])  # one chunk; three rows a chunk (a 2-row last chunk)
def test_kept_dequantized_chunks_give_the_same_products_bit_for_bit(monkeypatch, chunk):
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", chunk)
    rng = np.random.default_rng(1)
    w = torch.from_numpy(random_blocks("Q4_1", 11, 512, rng))
    kept: list[torch.Tensor] = []
    for m in (1, 4, 1):
        x = torch.randn(m, 512)
        assert torch.equal(quant.reference_matmul(x, w, 3, kept), quant.reference_matmul(x, w, 3))
    assert len(kept) == (1 if chunk > 11 * 512 else 4)  # filled by the first call, reused after
    assert torch.equal(torch.cat(kept), quant.dequantize(w, 3))
    kept[0].fill_(0)  # later calls use what was kept, not a new dequantization
    assert not torch.equal(quant.reference_matmul(x, w, 3, kept), quant.reference_matmul(x, w, 3))


def _same_header(path):
    import gguf

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        got = ours.fields[key]
        if len(field.data) > 1000:  # a vocabulary: its length, its ends (contents() of all of it: ~20 s)
            assert len(got) == len(field.data), key
            got = got[:50] + got[-50:]
            want = field.contents(slice(0, 50)) + field.contents(slice(len(field.data) - 50, None))
        else:
            want = field.contents()
        if isinstance(want, float):
            assert np.float32(got) == np.float32(want), key
        elif isinstance(want, list) and want and isinstance(want[0], float):
            assert np.array_equal(np.float32(got), np.float32(want)), key
        else:
            assert got == want, key
    assert [t.name for t in sorted(ref.tensors, key=lambda t: t.data_offset)] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.ggml_type, info.start, info.end - info.start) == (int(t.tensor_type), t.data_offset,
                                                                       t.n_bytes)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


# family, mix: every type is in one file (Q4_K_M: Q4_K + Q6_K; Q5_K_M: Q5_K + Q6_K; odd widths: Q8_0)
CASES = [("llama", "Q4_0"), ("llama", "BF16"), ("qwen2", "Q5_0"), ("qwen2", "Q5_1"), ("qwen3", "Q4_K_M"),
         ("gemma2", "Q5_K_M"), ("llama", "Q4_1"), ("qwen2", "F16")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cache = {}

    def get(family, mix):
        if (family, mix) not in cache:
            cache[family, mix] = make(family, mix, tmp_path_factory.mktemp(f"{family}-{mix}"))
        return cache[family, mix]

    return get


def test_header_equals_the_gguf_packages_reader():
    _same_header(find_gguf())  # written files: read by the model tests below


@pytest.mark.parametrize("family,mix", CASES)
def test_served_model_equals_float32_of_the_dequantized_weights(files, family, mix):
    path, ref = files(family, mix)
    core = float32_engine(path, max_model_len=128)
    ids = [1, 504, 3458, 282, 4649, 314, 25, 1159, 1230, 17][: 7 + len(family) % 4]
    got, want = prefill_logits(core, ids), ref(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert greedy(core, ids, 6) == expected


def _corrupt(tmp_path, src, name, edit):
    data = bytearray(src.read_bytes())
    edit(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def test_refusals_name_the_file_and_what_is_supported(tmp_path, files):
    path = files("llama", "Q4_0")[0]
    gf = GGUFFile(path)
    first = next(iter(gf.tensors.values()))
    cases = {
        "notgguf.gguf": (lambda d: d.__setitem__(slice(0, 4), b"GGML"), "not a GGUF file"),
        "v1.gguf": (lambda d: d.__setitem__(slice(4, 8), (1).to_bytes(4, "little")), "GGUF version 1 is not"),
        "truncated.gguf": (lambda d: d.__delitem__(slice(len(d) - 100, None)), "truncated: tensor"),
        "header.gguf": (lambda d: d.__delitem__(slice(4000, None)), "truncated GGUF header"),
    }
    for name, (edit, text) in cases.items():
        bad = _corrupt(tmp_path, path, name, edit)
        with pytest.raises(WeightsError, match=text) as e:
            load_model_config(bad)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
    # a tensor of a type not served: Q2_K (10) written over the first tensor's type field
    raw = path.read_bytes()
    at = raw.index(first.name.encode()) + len(first.name) + 4 + 8 * len(first.shape)
    q2k = (10).to_bytes(4, "little")
    bad = _corrupt(tmp_path, path, "q2k.gguf", lambda d: d.__setitem__(slice(at, at + 4), q2k))
    with pytest.raises(WeightsError, match=rf"tensor '{first.name}' has type Q2_K, which hotstart does not "
                                           r"serve \(served: F32, F16, BF16, Q4_0"):
        load_model_config(bad)
    # an architecture not served: general.architecture's value
    arch = raw.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    bad = _corrupt(tmp_path, path, "arch.gguf",
                   lambda d: d.__setitem__(slice(arch, arch + 5), b"mamba"))
    with pytest.raises(HotstartError, match=r"architecture 'mamba' is not served \(served: llama, qwen2"):
        load_model_config(bad)


def test_the_engines_header_skips_the_vocabulary_text_and_reads_the_rest_the_same(tmp_path, files):
    path = files("llama", "Q4_0")[0]
    full, lean = GGUFFile(path), GGUFFile(path, text_arrays=False)
    assert lean.tensors == full.tensors and lean.data_offset == full.data_offset
    skipped = {k for k, v in lean.fields.items() if isinstance(v, SkippedStrings)}
    assert "tokenizer.ggml.tokens" in skipped
    for k, v in full.fields.items():
        if k in skipped:
            assert isinstance(v, list) and all(isinstance(s, str) for s in v)
            assert len(lean.fields[k]) == len(v)
        else:
            assert lean.fields[k] == v
    raw = path.read_bytes()
    inside = raw.index(b"tokenizer.ggml.tokens") + 200  # cut in the middle of the token strings
    cut = _corrupt(tmp_path, path, "cut.gguf", lambda d: d.__delitem__(slice(inside, None)))
    for text_arrays in (True, False):
        with pytest.raises(WeightsError, match="truncated GGUF header") as e:
            GGUFFile(cut, text_arrays=text_arrays)
        assert str(cut) in str(e.value)
    first = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8 + 8
    bad = _corrupt(tmp_path, path, "latin1.gguf", lambda d: d.__setitem__(first, 0xFF))
    with pytest.raises(WeightsError, match="'tokenizer.ggml.tokens' array is not UTF-8"):
        GGUFFile(bad)
    tokens = GGUFFile(bad, text_arrays=False).fields["tokenizer.ggml.tokens"]  # the engine never decodes them
    assert len(tokens) == len(full.get("tokenizer.ggml.tokens"))


def test_the_lean_header_is_parsed_once_per_version_of_the_file(tmp_path, files):
    path = tmp_path / "m.gguf"
    path.write_bytes(files("llama", "Q4_0")[0].read_bytes())
    first = lean_header(path)
    assert lean_header(path) is first and isinstance(first.get("tokenizer.ggml.tokens"), SkippedStrings)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten: parsed again
    assert lean_header(path) is not first and lean_header(path).tensors == first.tensors
    with pytest.raises(WeightsError, match="cannot read"):
        lean_header(tmp_path / "missing.gguf")


def test_the_forkserver_computes_a_ggufs_header_and_snapshot_for_the_engines_it_forks_next(tmp_path, files):
    from hotstart.forkserver.server import ForkServer
    from hotstart.gguf_file import _lean
    from hotstart.model import kv_files

    path = tmp_path / "m.gguf"
    path.write_bytes(files("llama", "Q4_0")[0].read_bytes())
    server = ForkServer(Span("preload", 0.0, 0.0, "forkserver"), None)
    missing = str(tmp_path / "missing.gguf")  # unreadable: the engine's to report
    server.warm = [(str(path), (str(path),)), (str(path), (str(path),)), (missing, (missing,))]
    before, keys = _lean.cache_info(), kv_files._snapshot_key.cache_info()
    server._warm_caches()  # while idle, after forking engines for PATH
    assert server.warm == [] and _lean.cache_info().misses == before.misses + 1
    assert kv_files._snapshot_key.cache_info().misses == keys.misses + 1
    lean_header(path)  # what an engine forked after it finds: computed already
    key = kv_files.snapshot_key(path, [path])
    assert _lean.cache_info().hits == before.hits + 1
    assert kv_files._snapshot_key.cache_info().hits == keys.hits + 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # rewritten: a new key
    assert kv_files.snapshot_key(path, [path]) != key


def test_a_page_cached_file_loads_the_same_through_the_helper_thread(tmp_path_factory, files):
    """Cold (evicted): populated and touched tensor by tensor as they are mapped; page-cached (a swap back
    to it): populated and touched by one helper thread while the modules are built. The same weights."""
    from helpers.disk import disk_backed_dir

    from hotstart.model import gguf_loader
    from hotstart.residency import evict

    with disk_backed_dir(tmp_path_factory, "gguf-resident") as d:
        path = d / "m.gguf"
        path.write_bytes(files("qwen3", "Q4_K_M")[0].read_bytes())
        cfg, header = load_model_config(path), lean_header(path)
        end = max(t.end for t in header.tensors.values())
        evict(path)
        assert not gguf_loader._all_resident(path, header.data_offset, end)
        cold = gguf_loader.load_gguf_model(cfg, path, dtype=torch.float32).state_dict()
        assert gguf_loader._all_resident(path, header.data_offset, end)  # that load read every tensor
        warm = gguf_loader.load_gguf_model(cfg, path, dtype=torch.float32).state_dict()
    assert cold.keys() == warm.keys() and all(torch.equal(cold[k], warm[k]) for k in cold)
    assert not gguf_loader._all_resident(path, header.data_offset, end)  # gone: told, never raised
