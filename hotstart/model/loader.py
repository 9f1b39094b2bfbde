"""Build a model on the meta device and stream safetensors weights into it, strictly.

Files are read in the given order and tensors in file-offset order (sequential I/O); the position
is published through on_progress (the engine feeds the LoadCursor that keeps the API process's
prefetcher just ahead). Unfused tensors are assigned: on CPU in the checkpoint's dtype that is a
zero-copy view of the (page-cached) file, so a warm load costs almost nothing and the weights are
not held twice in RAM. Fused projections (qkv, gate_up; GPUs) are copied once into their fused
parameter. The model class is the family's (model/registry.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from hotstart.errors import WeightsError
from hotstart.gguf_file import is_gguf
from hotstart.model import arrival, parallel, registry
from hotstart.model.decoder import CausalLM
from hotstart.model.gguf_loader import load_gguf_model
from hotstart.model.layers import FusedLinear
from hotstart.model.safetensors_io import PageToucher, SafetensorsFile
from hotstart.model.upload import StagedCopier
from hotstart.model_config import ModelConfig

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = {"F32", "F16", "BF16"}


def _checkpoint_names(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Checkpoint tensor name -> (model parameter name, shard of a FusedLinear or None), from the
    modules themselves: a fused module's shards are its siblings in the checkpoint."""
    out: dict[str, tuple[str, str | None]] = {}
    for path, module in model.named_modules():
        for leaf, _ in module.named_parameters(recurse=False):
            param = f"{path}.{leaf}" if path else leaf
            if isinstance(module, FusedLinear) and not module.whole:  # whole: the checkpoint's own tensor
                parent = path.rpartition(".")[0]
                out.update({f"{parent}.{shard}.{leaf}": (param, shard) for shard in module.shards})
            else:
                out[param] = (param, None)
    return out


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def load_model(
    cfg: ModelConfig,
    files: Sequence[Path],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    fused: bool | None = None,
    tp: parallel.TensorParallel | None = None,
) -> CausalLM:
    """Build CFG's model (its family's CausalLM, model/registry.py) and fill every parameter from FILES.
    on_progress gets the global byte offset (sum of earlier file sizes + offset in the current file) after
    each tensor. fused: fuse q/k/v and gate/up (default: on GPUs only). tp: build and fill only rank
    tp.rank's part (model/parallel.py)."""
    if len(files) == 1 and is_gguf(files[0]):
        if tp is not None:
            raise WeightsError(f"{files[0]}: GGUF files are served on one rank (no --tensor-parallel-size)")

        return load_gguf_model(cfg, files[0], device, dtype, max_positions, on_progress)
    device = torch.device(device)
    if fused is None:
        fused = device.type != "cpu"
    with torch.device("meta"):
        model = _build(cfg, max_positions, fused, tp)
    expected = {n: p for n, p in model.named_parameters()}
    names = _checkpoint_names(model)
    filled: dict[str, set[str | None]] = {}  # parameter -> shards loaded (None: not fused)
    fused_buffers: dict[str, torch.Tensor] = {}

    def fused_buffer(target: str, shape) -> torch.Tensor:
        """The fused parameter TARGET (q/k/v or gate/up), allocated at its first shard."""
        buf = fused_buffers.get(target)
        if buf is None:
            buf = fused_buffers[target] = torch.empty(shape, device=device, dtype=dtype)
            _set_param(model, target, buf)
        return buf

    base = 0
    toucher = PageToucher()  # first CPU touch of each populated page, overlapped with the reads after it
    # to a GPU: through pinned staging buffers, copies overlapped with the reads (model/upload.py)
    staged = StagedCopier(device) if device.type == "cuda" or os.environ.get("HOTSTART_STAGED_LOAD") else None
    if not files:
        raise WeightsError(f"{cfg.path}: no safetensors weight files found")
    for path in files:
        st, arrived = arrival.open_arrived(path, SafetensorsFile)  # downloading: once its header is in
        try:
            for info in st.in_file_order():
                name = info.name
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                target, proj = names.get(name, (None, None))
                if target is None:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # tied: the embedding serves as the output projection
                    raise WeightsError(f"{path}: unexpected tensor '{name}' for {cfg.architecture}")
                if info.dtype not in FLOAT_DTYPES:
                    raise WeightsError(f"{path}: tensor '{name}' has dtype {info.dtype}, "
                                       "expected a float dtype")
                meta = expected[target]
                split = parallel.split_of(model, target, proj) if tp is not None else None
                if proj is None:
                    want = parallel.full_shape(meta.shape, split)
                else:
                    start, size = model.get_submodule(target.rpartition(".")[0]).shards[proj]
                    want = parallel.full_shape((size, *meta.shape[1:]), split)
                if info.shape != want:
                    raise WeightsError(f"{path}: tensor '{name}' has shape {list(info.shape)}, "
                                       f"expected {list(want)}")
                arrived(info.end)  # its bytes are in (a no-op unless the file is still downloading)
                src = st.get(info) if split is None else parallel.rank_part(st, info, split)
                if staged is not None:
                    if split is None:
                        st.populate(info)  # one syscall brings the pages in; the copy below reads them
                    if proj is None:
                        param = torch.empty(src.shape, device=device, dtype=dtype)
                        _set_param(model, target, param)
                    else:
                        param = fused_buffer(target, meta.shape)[start:start + size]
                    staged.copy(param, src)
                elif proj is None:
                    param = src.to(device=device, dtype=dtype).contiguous()  # a column range is copied
                    if split is None and param.data_ptr() == src.data_ptr():
                        st.populate(info)  # zero-copy: read the bytes now, not in the first forward
                        toucher.touch(param)
                    _set_param(model, target, param)
                else:
                    fused_buffer(target, meta.shape)[start:start + size].copy_(src)
                filled.setdefault(target, set()).add(proj)
                if on_progress is not None:
                    on_progress(base + info.end)
        finally:
            st.close()
        base += st.size
    toucher.close()
    if staged is not None:
        staged.finish()
    missing = [ckpt for ckpt, (param, shard) in names.items() if shard not in filled.get(param, ())]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightsError(f"{cfg.path}: missing tensor(s) {shown}{more}")
    model.post_load(device, dtype)
    return model.eval()


def _build(cfg: ModelConfig, max_positions: int | None, fused: bool,
           tp: parallel.TensorParallel | None) -> CausalLM:
    """The model on the current (meta) device: whole, or rank tp.rank's part of it."""
    model_class = registry.model_class(cfg)
    if tp is None:
        return model_class(cfg, max_positions, fused)
    model = model_class(parallel.local_config(cfg, tp.world_size), max_positions, fused)
    parallel.shard(model, tp)
    return model
