"""The model registry: config.json's `architectures[0]` -> its family (hotstart/families.py) -> the class
that builds it, in a module of hotstart/model/families imported only now (a family's code costs nothing
until a checkpoint of it is loaded)."""

from __future__ import annotations

import importlib

from hotstart import families
from hotstart.model.decoder import CausalLM
from hotstart.model_config import ModelConfig


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The CausalLM subclass building CFG's architecture."""
    module, _, name = families.by_name(cfg.family).builder.partition(":")
    return getattr(importlib.import_module(module), name)
