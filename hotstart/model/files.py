"""Which files of a model folder hold the weights (in load order) and the small sidecars (torch-free:
the API process, the loader and the benchmarks all use it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hotstart.errors import WeightsError
from hotstart.gguf_file import is_gguf
from hotstart.model.arrival import arriving

SIDECAR_NAMES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "special_tokens_map.json", "model.safetensors.index.json",
)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, in load order (a GGUF file: itself).

    The shards named by model.safetensors.index.json (sorted, unique), else model.safetensors,
    else every *.safetensors sorted by name. Raises WeightsError if there are none, if the index is
    not valid JSON, or if it names a shard that is missing.
    """
    model_dir = Path(model_dir)
    if model_dir.is_file() and is_gguf(model_dir):
        return [model_dir]  # a GGUF file holds the weights, the config and the tokenizer
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
            raise WeightsError(f"{index}: invalid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightsError(f"{index}: has no weight_map")
        names = sorted(set(map(str, weight_map.values())))
        for name in names:
            if not confined(name):
                raise WeightsError(f"{index} names shard {name!r}, outside the model folder (a shard is a "
                                   "file name in it)")
        shards = [model_dir / s for s in names]
        for shard in shards:
            if not (shard.is_file() or arriving(shard)):  # also an HF-cache symlink whose blob is gone
                raise WeightsError(f"{index} names shard {shard.name}, which is missing from {model_dir}")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file() or arriving(single):
        return [single]
    found = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if found:
        return found
    other = sorted(p.name for p in model_dir.glob("*.bin")) if model_dir.is_dir() else []
    hint = f" (found {', '.join(other[:3])}: hotstart loads safetensors only)" if other else ""
    raise WeightsError(f"no safetensors weights in {model_dir}{hint}")


def confined(name: str) -> bool:
    """Whether NAME, from an index, names a file inside the model folder: relative, no `..`, no NUL. The
    file itself may be a symlink (the Hugging Face cache links each one to its blob)."""
    if not name or "\0" in name or "\\" in name or os.path.isabs(name) or name.startswith("~"):
        return False
    parts = name.split("/")
    return all(part not in ("", ".", "..") for part in parts) and name.endswith(".safetensors")


def sidecar_files(model_dir: Path) -> list[Path]:
    """The small files a start reads besides the weights (config, tokenizer, template), those that exist
    (none beside a GGUF file: its header holds them)."""
    if Path(model_dir).is_file():
        return []
    return [p for p in (Path(model_dir) / n for n in SIDECAR_NAMES) if p.is_file()]
