"""The models of `hotstart serve MODEL [MODEL ...]` / `--model-dir DIR`, their flags (ModelsConfig), and
keep-alive durations (string parsing and a folder listing only: stdlib; the CLI imports it)."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hotstart.errors import HotstartError
from hotstart.flags import at_least_one, byte_size, option

# a served model name: what --served-model-name and NAME=s3:// accept (boot/remote/url.py)
_NAME = re.compile(r"^[A-Za-z0-9_.\-][A-Za-z0-9_.:\-/]{0,127}$")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: NAME (what requests say in `model`; None: resolved name) and SPEC (folder,
    hub id or s3:// URL, as resolve_model takes it)."""

    name: str | None
    spec: str


def split_spec(text: str) -> ModelSpec:
    """`NAME=PATH|HUB_ID|s3://...` or a bare spec. NAME=s3:// stays whole (boot/remote parses it)."""
    head, sep, tail = text.partition("=")
    if not sep or "/" in head or not head or head.startswith(("~", ".")) or os.path.isdir(text):
        return ModelSpec(None, text)  # a path may hold "="
    if not _NAME.match(head):
        raise HotstartError(f"model '{text}': '{head}' is not a valid model name (letters, digits, '._-:/')")
    if not tail:
        raise HotstartError(f"model '{text}': nothing after '='")
    return ModelSpec(head, text if tail.startswith("s3://") else tail)


def model_dir_specs(folder: str) -> list[ModelSpec]:
    """Every subfolder of FOLDER with a config.json, named by the subfolder (sorted)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise HotstartError(f"--model-dir {folder}: no such folder")
    found = [ModelSpec(p.name, str(p)) for p in sorted(root.iterdir())
             if p.is_dir() and (p / "config.json").is_file() and _NAME.match(p.name)]
    if not found:
        raise HotstartError(f"--model-dir {folder}: no subfolder holds a config.json")
    return found


def gather(models: list[str] | None, model_dir: str | None) -> list[ModelSpec]:
    """The configured models, in order; duplicate names are an error."""
    specs = [split_spec(m) for m in models or []] + (model_dir_specs(model_dir) if model_dir else [])
    return specs


def parse_duration(value: object) -> float | None:
    """Ollama's keep_alive: seconds (a number, or a string of one), or a Go-style duration ("5m", "30s",
    "1h30m", "-1m"); None for a negative one (forever). ValueError when it is neither."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        negative = text.startswith("-")
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"expected a duration such as 5m, 30s or 300, got {value!r}") from None
            seconds = sum(float(n) * _UNIT[u] for n, u in parts)
        seconds = -seconds if negative else seconds
    else:
        raise ValueError(f"expected a duration such as 5m, 30s or 300, got {value!r}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return None if seconds < 0 else seconds


def duration_flag(text: str) -> str:
    """An argparse type: a valid duration, kept as text (configs travel as plain data)."""
    try:
        parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


duration_flag.metavar = "DURATION"


@dataclass(frozen=True)
class ModelsConfig:
    """`hotstart serve`'s flags for several models (read only when more than one is served)."""

    model_dir: str | None = option(None, "serve every subfolder of DIR holding a config.json, named by the "
                                         "subfolder (with or beside MODEL arguments)", metavar="DIR")
    preload: tuple[str, ...] | None = option(
        None, "load this model at start (repeatable, or comma-separated); /health waits for these only",
        action="append")
    max_loaded_models: int = option(3, "most engines loaded at once (least recently used unloaded first)",
                                    type=at_least_one)
    keep_alive: str = option("5m", "how long an idle model stays loaded: 30s, 5m, 1h, seconds; 0 = unload "
                                   "after each request, -1 = never (a request's keep_alive overrides it)",
                             type=duration_flag)
    max_waiting_requests: int = option(64, "requests that may wait for a model to load; more get 503 with "
                                           "Retry-After", type=at_least_one)
    models_memory: int | None = option(
        None, "bytes the loaded models may use together, e.g. 16G (weights + KV cache; default: what is "
              "available at start: a cgroup's limit minus its working set, else MemAvailable)",
        type=byte_size)
    pin: tuple[str, ...] | None = option(
        None, "keep this model loaded: loaded at start, never evicted, never unloaded by keep-alive (only "
              "POST /v1/models/NAME/unload); repeatable or comma-separated", action="append")
    alias: tuple[str, ...] | None = option(
        None, "NAME=TARGET: requests naming NAME are answered by model TARGET (repeatable)", action="append")
    priority: tuple[str, ...] | None = option(
        None, "NAME=N: eviction order, the lowest N unloaded first (default 0), then the least recently "
              "used (repeatable)", action="append")

    def preload_names(self) -> list[str]:
        return _names(self.preload)

    def pin_names(self) -> list[str]:
        return _names(self.pin)

    def alias_map(self, served: list[str]) -> dict[str, str]:
        """{alias: target} of --alias, checked against SERVED (the models' names)."""
        out: dict[str, str] = {}
        for item in self.alias or ():
            alias, _, target = (p.strip() for p in item.partition("="))
            if not alias or not target or not _NAME.match(alias):
                raise HotstartError(f"--alias {item}: expected NAME=TARGET (NAME: letters, digits, '._-:/')")
            if target not in served:
                raise HotstartError(f"--alias {item}: no model named {target} (served: {', '.join(served)})")
            if alias in served or alias in out:
                raise HotstartError(f"--alias {item}: {alias} names a model or another alias already")
            out[alias] = target
        return out

    def priorities(self, served: list[str]) -> dict[str, int]:
        """{model: N} of --priority, checked against SERVED."""
        out: dict[str, int] = {}
        for item in self.priority or ():
            model, _, value = (p.strip() for p in item.partition("="))
            if model not in served:
                raise HotstartError(f"--priority {item}: no model named {model} (served: "
                                    f"{', '.join(served)})")
            try:
                out[model] = int(value)
            except ValueError:
                raise HotstartError(f"--priority {item}: expected NAME=N, N an integer") from None
        return out


def _names(items) -> list[str]:
    return [n.strip() for item in items or () for n in item.split(",") if n.strip()]
