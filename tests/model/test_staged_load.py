"""The staged upload (model/upload.py: the CUDA load path) run on CPU: weights copied through a ring of
small buffers, in chunks, converted after the copy, into fused and plain parameters, equal the plain
zero-copy load exactly."""

from __future__ import annotations

import pytest
import torch

from hotstart.config import load_model_config
from hotstart.model import upload
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model


@pytest.mark.parametrize(
    "family,fused,dtype",
    [("qwen2", True, torch.float32), ("qwen3", False, torch.float32), ("llama", True, torch.bfloat16)],
)
def test_staged_load_equals_plain(family, fused, dtype, tiny_checkpoint, monkeypatch):
    folder = tiny_checkpoint(family)
    cfg = load_model_config(folder)
    plain = load_model(cfg, weight_files(folder), dtype=dtype, fused=fused)
    monkeypatch.setenv("HOTSTART_STAGED_LOAD", "1")
    monkeypatch.setattr(upload, "BUFFER_BYTES", 4096)  # many chunks per tensor, buffers reused
    seen = []
    real = upload.StagedCopier.copy

    def spy(self, dst, src):
        seen.append((src.dtype, dst.dtype, src.numel() * src.element_size()))
        return real(self, dst, src)

    monkeypatch.setattr(upload.StagedCopier, "copy", spy)
    staged = load_model(cfg, weight_files(folder), dtype=dtype, fused=fused)
    a, b = dict(plain.named_parameters()), dict(staged.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].dtype == dtype and torch.equal(a[name], b[name]), name
    assert seen and all(s == torch.float32 for s, _, _ in seen)  # the checkpoint is float32
    assert max(n for _, _, n in seen) > 4 * 4096  # tensors went in several chunks through reused buffers
    if dtype != torch.float32:
        assert any(d == dtype for _, d, _ in seen)  # converted after the copy
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(plain.model.embed_tokens(ids), staged.model.embed_tokens(ids))
