"""A GGUF file mapped into a model, not converted: every tensor is a view of one private mmap of the file.

Float tensors (F32 / F16 / BF16) become parameters in the model's dtype (zero-copy where the dtypes
agree); quantized ones stay ggml blocks, uint8 [rows, row_bytes] views, in QuantLinear / QuantEmbedding
modules (model/quant.py) that take the place of the Linear / Embedding the family built. Names come from
hotstart/gguf_arch.py; what llama.cpp's converter changed is undone here: llama's q / k head
permutation (QuantLinear reorders its output; a float weight's rows are put back, a copy), Gemma's
1 + w norms (w - 1, a copy of a 1-D tensor). Tensors are read in file order and their pages populated
as they are mapped, the byte position reported as the safetensors loader reports it; a file wholly in
the page cache already (a many-models swap back to it) is instead populated and touched by one helper
thread while this one builds the modules (_Filler: the pages are there, nothing to wait for in order).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hotstart import gguf_arch
from hotstart.errors import WeightsError
from hotstart.gguf_file import TensorInfo, lean_header
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import Embedding, FusedLinear, Linear
from hotstart.model.quant import QuantEmbedding, QuantLinear
from hotstart.model.safetensors_io import MADV_POPULATE_READ, PAGE, PageToucher
from hotstart.model_config import ModelConfig
from hotstart.residency import madvise, resident_map

_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _Mapped:
    """The file's bytes as one private (copy-on-write) map: tensors are views of it."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    def view(self, info: TensorInfo) -> torch.Tensor:
        """Float types: the tensor [shape] in its dtype; quantized: uint8 [rows, row_bytes]."""
        if info.quantized:
            flat = torch.frombuffer(self.mm, dtype=torch.uint8, count=info.end - info.start,
                                    offset=info.start)
            return flat.view(-1, info.row_bytes)
        dtype = _TORCH[info.type_name]
        flat = torch.frombuffer(self.mm, dtype=dtype, count=(info.end - info.start) // dtype.itemsize,
                                offset=info.start)
        return flat.view(info.shape)

    def populate(self, info: TensorInfo) -> None:
        start = info.start // PAGE * PAGE
        try:
            self.mm.madvise(MADV_POPULATE_READ, start, info.end - start)
        except (OSError, ValueError):
            pass


class _Filler:
    """MAPPED's pages populated (madvise in one call, the GIL released) and touched once per page (the
    hypervisor's first-touch cost, PageToucher's docstring) on a helper thread; join() waits for it."""

    def __init__(self, mapped: _Mapped) -> None:
        self.whole = torch.frombuffer(mapped.mm, dtype=torch.uint8)
        self.thread = threading.Thread(target=self._run, name="hotstart-gguf-fill", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            madvise(self.whole.data_ptr(), self.whole.numel(), MADV_POPULATE_READ)
            self.whole[::PAGE].sum()
        except Exception:  # noqa: BLE001, S110 - best effort: the first forward pass faults in the rest
            pass

    def join(self) -> None:
        self.thread.join()


def _all_resident(path: Path, start: int, end: int) -> bool:
    """Every page of PATH's bytes [START, END) is in the page cache (mincore); False where that cannot be
    told."""
    start = start // PAGE * PAGE
    try:
        return end > start and resident_map(path, start, end - start).count(0) == 0
    except OSError:
        return False


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    # w: [heads * D, ...] in llama.cpp's order ([h, D/2, 2] per head) -> the checkpoint's ([h, 2, D/2])
    return w.reshape(heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_model(cfg: ModelConfig, path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                    on_progress: Callable[[int], None] | None = None) -> CausalLM:
    """CFG's model with every parameter mapped from the GGUF file PATH (model/loader.py's contract)."""
    from hotstart.model import registry  # noqa: PLC0415 - registry imports the families lazily itself

    device = torch.device(device)
    gf = lean_header(path)  # tensors and hyperparameters only
    _, arch = gguf_arch.arch_of(gf)
    with torch.device("meta"):
        model = registry.model_class(cfg)(cfg, max_positions or cfg.max_position_embeddings, False)
    expected = dict(model.named_parameters())
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    mapped = _Mapped(gf.path)
    end = max((i.end for i in gf.tensors.values()), default=0)  # the tensors' bytes: page-cached already?
    filler = _Filler(mapped) if _all_resident(gf.path, gf.data_offset, end) else None
    toucher = PageToucher()
    for info in gf.tensors.values():
        name = gguf_arch.checkpoint_name(arch, info.name)
        if name is None:
            continue
        if name == "" or name not in expected:
            raise WeightsError(f"{gf.path}: unexpected tensor '{info.name}' for GGUF architecture "
                               f"{gf.get('general.architecture')}")
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        want = tuple(expected[name].shape)
        if tuple(info.shape) != want:
            raise WeightsError(f"{gf.path}: tensor '{info.name}' has shape {list(info.shape)}, expected "
                               f"{list(want)}")
        unpermute = heads.get(module_name.rpartition(".")[2], 0) if arch.unpermute_qk else 0
        src = mapped.view(info)
        if filler is None:
            mapped.populate(info)
        if info.quantized:
            if leaf != "weight" or not isinstance(module, (Linear, Embedding)):
                raise WeightsError(f"{gf.path}: tensor '{info.name}' is quantized ({info.type_name}); "
                                   "only matrices may be")
            _set_quant(model, module_name, module, src.to(device), info, dtype, unpermute)
            if filler is None:
                toucher.touch(src)
        else:
            tensor = src
            if unpermute:
                tensor = _unpermute_rows(tensor, unpermute)
            if arch.norm_shift and module_name.endswith(("norm", "layernorm")):
                tensor = tensor.float() - 1.0  # Gemma's norms scale by (1 + w): the file holds 1 + w
            param = tensor.to(device=device, dtype=dtype).contiguous()
            if param.data_ptr() == src.data_ptr() and filler is None:
                toucher.touch(param)
            module._parameters[leaf] = nn.Parameter(param, requires_grad=False)
        if on_progress is not None:
            on_progress(info.end)
    toucher.close()
    if filler is not None:
        filler.join()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        shown = ", ".join(repr(n) for n in missing[:3])
        raise WeightsError(f"{gf.path}: missing tensor(s) for {shown}{more}")
    if cfg.tie_word_embeddings and isinstance(model.model.embed_tokens, QuantEmbedding):
        emb = model.model.embed_tokens
        model.quant_head = QuantLinear(emb.weight.data, emb.ggml_type, cfg.hidden_size)
        model.quant_head.weight = emb.weight  # one parameter, counted once
    elif isinstance(model.lm_head, QuantLinear):
        model.quant_head = model.lm_head
    model.post_load(device, dtype)
    return model.eval()


def _set_quant(model: nn.Module, name: str, module: nn.Module, blocks: torch.Tensor, info: TensorInfo,
               dtype: torch.dtype, unpermute: int) -> None:
    """Put a QuantLinear / QuantEmbedding over BLOCKS in the place of MODULE (named NAME) of MODEL."""
    if isinstance(module, Embedding):
        new: nn.Module = QuantEmbedding(blocks, info.ggml_type, info.shape[-1], dtype)
    else:
        split = module.split_sizes if isinstance(module, FusedLinear) else None
        new = QuantLinear(blocks, info.ggml_type, info.shape[-1], module.bias, unpermute, split)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)
