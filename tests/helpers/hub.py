"""A model hub on loopback for the tests (hotstart/bench/hubserver.py: the routes huggingface_hub and
modelscope use, proven by their own clients in tests/boot/test_hub_protocol.py), the repositories the
cases need, and the environment that points every client at it and every cache into a test folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hotstart.bench.hubrepo import load_repo
from hotstart.bench.hubserver import HubServer

GOOD, NO_ACCESS = "hf_test_good_token", "hf_test_valid_without_access"


def make_repos(root: Path, default_model: Path, tiny_sharded: Path) -> dict[str, Path]:
    """Folders for: acme/smol (the default model), acme/tiny (a sharded checkpoint beside files a server
    never needs: original/, a GGUF, a .bin, a README), acme/gated and acme/private (tiny copies),
    acme/binonly (pickle weights only), acme/noconfig (weights without config.json)."""
    out = {"acme/smol": default_model}
    tiny = root / "tiny"
    shutil.copytree(tiny_sharded, tiny)
    tok = default_model / "tokenizer.json"
    shutil.copy(tok, tiny / "tokenizer.json")
    (tiny / "original").mkdir()
    (tiny / "original" / "consolidated.00.pth").write_bytes(b"\x80\x02pickle" * 100)
    (tiny / "model-q4.gguf").write_bytes(b"GGUF" + bytes(4096))
    (tiny / "pytorch_model.bin").write_bytes(b"\x80\x02pickle" * 100)
    (tiny / "README.md").write_text("# tiny\n")
    out["acme/tiny"] = tiny
    for name in ("gated", "private"):
        shutil.copytree(tiny_sharded, root / name)
        out[f"acme/{name}"] = root / name
    binonly = root / "binonly"
    binonly.mkdir()
    shutil.copy(tiny_sharded / "config.json", binonly / "config.json")
    (binonly / "pytorch_model.bin").write_bytes(b"\x80\x02pickle" * 100)
    out["acme/binonly"] = binonly
    noconfig = root / "noconfig"
    noconfig.mkdir()
    for p in tiny_sharded.glob("*.safetensors*"):
        shutil.copy(p, noconfig / p.name)
    out["acme/noconfig"] = noconfig
    return out


def start_hub(folders: dict[str, Path], memo: Path, cap_mbps: float | None = None) -> HubServer:
    access = {"acme/gated": "gated", "acme/private": "private"}
    repos = [load_repo(rid, folder, access.get(rid, "public"), {GOOD} if rid in access else set(), memo,
                       extra_revisions={"v1": "main"}) for rid, folder in folders.items()]
    return HubServer(repos, cap_mbps, tokens={GOOD, NO_ACCESS}).start()


def hub_env(hub: HubServer, root: Path, token: str | None = None) -> dict[str, str]:
    """Every client at HUB, every cache under ROOT, no token unless TOKEN (a real one never leaks in)."""
    return {
        "HF_ENDPOINT": hub.url,
        "MODELSCOPE_ENDPOINT": hub.url,
        "HF_HOME": str(root / "hf-home"),
        "HF_HUB_CACHE": str(root / "hf"),
        "MODELSCOPE_CACHE": str(root / "ms"),
        "HOTSTART_HOME": str(root / "home"),
        "HF_TOKEN": token or "",
        "HF_TOKEN_PATH": str(root / "no-token"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
        "VLLM_USE_MODELSCOPE": "",
        "MODELSCOPE_API_TOKEN": "",
    }


def trusted(root: Path) -> list[str]:
    """What a later start would trust in ROOT's caches: HF refs, complete ModelScope records."""
    refs = [str(p.relative_to(root)) for p in (root / "hf").rglob("refs/*")]
    recs = [str(p.relative_to(root)) for p in (root / "home").rglob("*.json")]
    return refs + [r for r in recs if json.loads((root / r).read_text())]
