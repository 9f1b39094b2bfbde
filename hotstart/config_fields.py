"""One field of a model's config.json (or of its RoPE parameters) read with its type checked: the value,
the default where it is absent or null, or one line naming the file and the field (ModelConfigError)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hotstart.errors import ModelConfigError


def read(raw: dict, name: str, kind: type, src: Path, default: Any = ..., positive: bool = False):
    """RAW[NAME] as KIND (an int is a float too); absent or null: DEFAULT (none given: refused)."""
    if name not in raw or raw[name] is None:
        if default is ...:
            raise ModelConfigError(f"{src}: missing field '{name}'")
        return default
    value = raw[name]
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok or (kind is float and not math.isfinite(value)):
        raise ModelConfigError(f"{src}: field '{name}' must be {kind.__name__}, got {value!r}")
    if positive and value <= 0:
        raise ModelConfigError(f"{src}: field '{name}' must be > 0, got {value!r}")
    return value


def number(params: dict, name: str, key: str, src: Path, default: Any) -> Any:
    """A number of the RoPE parameters (null: DEFAULT), refused naming KEY.NAME when not one."""
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ModelConfigError(f"{src}: field '{key}.{name}' must be a number, got {value!r}")
    return float(value)
