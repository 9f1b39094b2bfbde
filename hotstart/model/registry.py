"""The model registry: config.json's `architectures[0]` -> its family (hotstart/families.py) -> the class
that builds it: the shared decoder (model/decoder.py; model/moe.py's with experts), or a family's own in
a module of hotstart/model/families imported only now (its code costs nothing until a checkpoint of it is
loaded)."""

from __future__ import annotations

import importlib

from hotstart import families
from hotstart.model.decoder import CausalLM
from hotstart.model_config import ModelConfig


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The CausalLM (sub)class building CFG's architecture."""
    fam = families.by_name(cfg.family)
    if fam.builder:
        module, _, name = fam.builder.partition(":")
        return getattr(importlib.import_module(module), name)
    if fam.moe is not None:
        from hotstart.model.moe import MoECausalLM  # noqa: PLC0415 - only for a mixture of experts

        return MoECausalLM
    return CausalLM
