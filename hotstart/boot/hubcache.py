"""Where the hubs' own caches are and which hub a bare id means, read from the environment the way
huggingface_hub, modelscope and vLLM read it (stdlib only: resolve.py runs this at t=0 of every start).

  Hugging Face  HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub (HF_HOME: else
                $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface); HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
  ModelScope    MODELSCOPE_CACHE (default ~/.cache/modelscope): models/{owner}--{name}/snapshots/{revision}
                since modelscope 1.38; older releases used {owner}/{name with '.' as '___'} under
                models/ or hub/ (modelscope still reuses such a folder when it exists)
  which hub     ModelScope for a `modelscope://ORG/NAME` model or when VLLM_USE_MODELSCOPE is true (vLLM's
                switch); else the Hugging Face Hub
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = ("1", "on", "yes", "true")


def env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def hf_offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE): no request to any hub (vLLM passes it to
    ModelScope's client too)."""
    return env_true("HF_HUB_OFFLINE") or env_true("TRANSFORMERS_OFFLINE")


def use_modelscope() -> bool:
    return env_true("VLLM_USE_MODELSCOPE")


def hf_home() -> Path:
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser()


def hf_hub_cache() -> Path:
    """The HF hub cache folder, with huggingface_hub's precedence of env vars."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    return hf_home() / "hub"


def hf_repo_dir(repo_id: str) -> Path:
    return hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))


def modelscope_root() -> Path:
    env = os.environ.get("MODELSCOPE_CACHE")
    return Path(os.path.expandvars(env)).expanduser() if env else Path.home() / ".cache" / "modelscope"


def modelscope_snapshot(repo_id: str, revision: str) -> Path:
    """Where modelscope >= 1.38 puts ORG/NAME at REVISION (a branch or tag name: it records no commits)."""
    return modelscope_root() / "models" / repo_id.replace("/", "--") / "snapshots" / revision


def modelscope_legacy(repo_id: str) -> Path | None:
    """The folder of an older modelscope that modelscope itself would reuse (non-empty), else None."""
    org, name = repo_id.split("/")
    base = modelscope_root()
    for p in (base / "models" / org / name.replace(".", "___"), base / "hub" / "models" / org /
              name.replace(".", "___")):
        try:
            if p.is_dir() and any(p.iterdir()):
                return p
        except OSError:
            continue
    return None


def modelscope_candidates(repo_id: str, revision: str = "master") -> list[Path]:
    """The folders ModelScope may have put `org/name` in, most likely first: the current layout, then
    the older ones ({cache}/hub/models/{org}/{name}, '.' in the name written as '___', or
    {cache}/hub/{org}/{name}; MODELSCOPE_CACHE named the folder holding hub/ in some releases and the
    hub folder itself in others, so both are tried)."""
    org, name = repo_id.split("/")
    env = os.environ.get("MODELSCOPE_CACHE")
    base = modelscope_root()
    roots = [base / "hub", base] if env else [base / "hub"]
    names = [name.replace(".", "___"), name] if "." in name else [name]
    out: list[Path] = [modelscope_snapshot(repo_id, revision)]
    for root in roots:
        for prefix in (root / "models", root):
            for n in names:
                if (p := prefix / org / n) not in out:
                    out.append(p)
    return out
