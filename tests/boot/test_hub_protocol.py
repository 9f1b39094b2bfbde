"""Hub ids downloaded through boot/remote/ from a real loopback hub (tests/helpers/hub.py), in process:
the hub is proven faithful by huggingface_hub's and modelscope's own clients, the files land in their
standard caches (which those clients and transformers then read offline), only the needed files are
fetched, digests are checked, faults are retried, and every bad repository is one line that leaves
nothing a later start would trust."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers.hub import GOOD, NO_ACCESS, hub_env, make_repos, start_hub, trusted
from safetensors.numpy import save_file

from hotstart.boot.resolve import resolve_model
from hotstart.errors import HotstartError

NEEDED = {"config.json", "tokenizer.json", "model.safetensors.index.json",
          "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors"}


def sharded(folder: Path, config: Path) -> Path:
    """Three safetensors shards (~0.4 MB each: several 64 KiB chunks) and their index, no torch."""
    folder.mkdir(parents=True)
    shutil.copy(config, folder / "config.json")
    rng = np.random.default_rng(0)
    weight_map = {}
    for i in range(1, 4):
        name = f"model-0000{i}-of-00003.safetensors"
        tensors = {f"layer{i}.w{j}": rng.standard_normal((100, 256)).astype(np.float32) for j in range(4)}
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("repos")
    folders = make_repos(root, default_model_dir, sharded(root / "base", default_model_dir / "config.json"))
    h = start_hub(folders, root / "memo.json")
    h.folders = folders
    yield h
    h.stop()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    """This process's environment pointed at the hub, caches in tmp_path; 64 KiB chunks, 3 threads."""
    def set_env(token: str | None = None, **more: str) -> Path:
        for k, v in {**hub_env(hub, tmp_path, token), **more}.items():
            monkeypatch.setenv(k, v)
        return tmp_path
    monkeypatch.setattr("hotstart.boot.remote.download.CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr("hotstart.boot.remote.download.THREADS", 3)
    hub.fail = hub.cut = 0
    hub.log.clear()
    set_env()
    return set_env


def downloaded(spec: str, revision: str | None = None):
    r = resolve_model(spec, revision)
    if r.remote is not None and r.remote.downloader is not None:
        r.remote.downloader.progress_to = None
        assert r.remote.downloader.wait(60)
        assert r.remote.stats()["error"] is None, r.remote.stats()
    return r


def test_huggingface_hub_downloads_from_the_loopback_hub(hub, env):
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download("acme/tiny", cache_dir=str(env() / "hf-client"), endpoint=hub.url))
    src = hub.folders["acme/tiny"]
    for f in src.rglob("*"):
        if f.is_file():
            assert (path / f.relative_to(src)).read_bytes() == f.read_bytes(), f
    kinds = {(m, p.split("/")[2] if p.startswith("/api/") else "resolve") for m, p, *_ in hub.log}
    assert {("GET", "models"), ("HEAD", "resolve"), ("GET", "resolve")} <= kinds


def test_download_lands_in_the_hf_cache_and_every_client_reads_it_offline(hub, env, monkeypatch):
    root = env()
    r = downloaded("acme/tiny")
    d = r.remote.stats()
    assert (r.source, d["state"], d["error"], d["files_total"]) == ("hf", "done", None, 3)
    assert d["bytes_verified"] == d["bytes_total"] > 0
    fetched = {p.split("/resolve/")[1].split("/", 1)[1] for _, p, *_ in hub.requests("/resolve/")}
    assert fetched == NEEDED  # never original/, the GGUF, the .bin or the README
    repo = root / "hf" / "models--acme--tiny"
    commit = hub.repos["acme/tiny"].commit
    assert r.path == repo / "snapshots" / commit and (repo / "refs" / "main").read_text() == commit
    files = hub.repos["acme/tiny"].files
    for name in NEEDED:
        link = r.path / name
        want = files[name].sha256 if files[name].lfs else files[name].oid
        assert link.is_symlink() and os.readlink(link) == f"../../blobs/{want}"
        assert link.read_bytes() == (hub.folders["acme/tiny"] / name).read_bytes()
    assert not [p for p in repo.rglob("*") if p.name.endswith((".partial", ".arrival"))]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    from huggingface_hub import hf_hub_download, snapshot_download
    from transformers import AutoConfig

    offline = {"cache_dir": str(root / "hf"), "local_files_only": True}  # (their constants: read at import)
    assert Path(snapshot_download("acme/tiny", **offline)) == r.path
    assert Path(hf_hub_download("acme/tiny", "config.json", **offline)) == r.path / "config.json"
    assert AutoConfig.from_pretrained("acme/tiny", **offline).model_type == json.loads(
        (r.path / "config.json").read_text())["model_type"]
    again = resolve_model("acme/tiny")
    assert (again.path, again.source, hub.log) == (r.path, "hf-cache", [])  # not one request


def test_revisions_tags_and_commits(hub, env):
    root = env()
    commit = hub.repos["acme/tiny"].commit
    r = downloaded("acme/tiny", "v1")
    assert (root / "hf/models--acme--tiny/refs/v1").read_text() == commit
    hub.log.clear()
    by_commit = resolve_model("acme/tiny", commit)
    assert (by_commit.path, by_commit.source, hub.log) == (r.path, "hf-cache", [])  # a commit never moves
    hub.log.clear()
    warm = resolve_model("acme/tiny", "v1")
    assert warm.source == "hf-cache" and [p for _, p, *_ in hub.log] == ["/api/models/acme/tiny/revision/v1"]


def test_modelscope_by_prefix_and_by_vllm_switch_into_its_own_layout(hub, env):
    root = env()
    r = downloaded("modelscope://acme/tiny")
    snap = root / "ms" / "models" / "acme--tiny" / "snapshots" / "master"
    assert (r.path, r.source, r.remote.stats()["state"]) == (snap, "modelscope", "done")
    assert {p.name for p in snap.iterdir()} == NEEDED
    assert all(p.startswith("/api/v1/") for _, p, *_ in hub.log)
    env(VLLM_USE_MODELSCOPE="True")
    hub.log.clear()
    again = resolve_model("acme/tiny")
    assert (again.path, again.source, len(hub.log)) == (snap, "modelscope-cache", 1)

    from modelscope import snapshot_download as ms_download  # its own client, offline, finds our files

    assert Path(ms_download("acme/tiny", cache_dir=str(root / "ms"), local_files_only=True)) == snap
    other = root / "ms-client"
    assert (Path(ms_download("acme/tiny", cache_dir=str(other))) / "config.json").read_bytes() == (
        hub.folders["acme/tiny"] / "config.json").read_bytes()  # and downloads from the loopback hub


def test_faults_are_retried(hub, env):
    env()
    hub.fail, hub.cut = 3, 2  # 503s and bodies cut in half, on the data GETs
    r = downloaded("acme/tiny")
    assert r.remote.stats()["state"] == "done" and hub.fail == hub.cut == 0
    assert any(status == 503 for *_, status, _ in hub.log)


def test_a_corrupt_file_fails_its_digest_and_nothing_is_kept(hub, env, tmp_path):
    root = env()
    shard = hub.folders["acme/tiny"] / "model-00002-of-00003.safetensors"
    good = shard.read_bytes()
    try:
        bad = bytearray(good)
        bad[-5] ^= 0xFF  # same size, same header: only the digest can tell
        shard.write_bytes(bytes(bad))
        r = resolve_model("acme/tiny")
        assert r.remote.downloader.wait(60)
        d = r.remote.stats()
    finally:
        shard.write_bytes(good)
    assert d["state"] == "failed" and "do not match the listed digest" in d["error"], d
    assert "model-00002-of-00003.safetensors" in d["error"]
    assert trusted(root) == []
    snap = r.path
    assert not (snap / shard.name).exists() and not (snap / f"{shard.name}.partial").exists()
    blob = hub.repos["acme/tiny"].files[shard.name].sha256
    assert not (root / "hf/models--acme--tiny/blobs" / blob).exists()


def test_resume_keeps_durable_chunks(hub, env, monkeypatch):
    env()
    monkeypatch.setattr("hotstart.boot.remote.download.CHECKPOINT_S", 0.05)
    hub.stall_s = 0.05
    try:
        r = resolve_model("acme/tiny")
        dl = r.remote.downloader
        dl.progress_to = None
        while dl.stats()["bytes_done"] < 0.4 * dl.total:
            assert not dl.wait(0.05)
        dl.stop()
        assert dl.wait(30) and dl.stats()["state"] == "stopped" and r.remote.lock_fd is None
    finally:
        hub.stall_s = 0.0
    again = downloaded("acme/tiny")
    d = again.remote.stats()
    assert d["state"] == "done" and d["bytes_resumed"] > 0, d


@pytest.mark.parametrize("spec,token,revision,needles", [
    ("acme/gated", None, None, ["'acme/gated'", "gated", "HF_TOKEN"]),
    ("acme/gated", NO_ACCESS, None, ["'acme/gated'", "gated", "no access", "HF_TOKEN"]),
    ("acme/gated", "hf_wrong", None, ["'acme/gated'", "rejected the token from HF_TOKEN"]),
    ("acme/private", None, None, ["'acme/private'", "not found", "private", "HF_TOKEN"]),
    ("acme/nothere", GOOD, None, ["'acme/nothere'", "not found", "check the id"]),
    ("acme/tiny", None, "v9", ["'acme/tiny'", "revision 'v9' was not found"]),
    ("acme/binonly", None, None, ["acme/binonly", "no safetensors", "pytorch_model.bin", "never pickle"]),
    ("acme/noconfig", None, None, ["acme/noconfig", "no config.json"]),
    ("modelscope://acme/nothere", None, None, ["'acme/nothere'", "not found", "MODELSCOPE_API_TOKEN"]),
])
def test_bad_repositories_are_one_line_and_leave_nothing_trusted(hub, env, spec, token, revision, needles):
    root = env(token)
    with pytest.raises(HotstartError) as e:
        resolve_model(spec, revision)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert trusted(root) == []
    if token:
        assert token not in msg


def test_granted_token_reads_a_gated_repo(hub, env):
    env(GOOD)
    assert downloaded("acme/gated").remote.stats()["state"] == "done"
    assert all(auth for _, p, _, _, auth in hub.log)  # the token went to the endpoint


def test_cdn_redirect_drops_the_token(hub, env):
    env(GOOD)
    hub.cdn = True
    try:
        r = downloaded("acme/gated")
    finally:
        hub.cdn = False
    assert r.remote.stats()["state"] == "done"
    cdn = hub.requests("/_cdn/")
    assert cdn and not any(auth for *_, auth in cdn)


def test_offline_and_unreachable_serve_the_cache(hub, env, capsys):
    env()
    first = downloaded("acme/tiny")
    env(HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    down = resolve_model("acme/tiny")
    assert (down.path, down.source) == (first.path, "hf-offline")
    assert capsys.readouterr().err.count("hotstart: WARNING:") == 1
    env(HF_HUB_OFFLINE="1")
    with pytest.raises(HotstartError, match="HF_HUB_OFFLINE is set"):
        resolve_model("acme/smol")


def test_an_interrupted_snapshot_is_never_served_offline(hub, env):
    root = env()
    first = downloaded("acme/tiny")
    shard = first.path / "model-00003-of-00003.safetensors"
    shard.resolve().unlink()  # its blob: killed before the rename
    shard.unlink()
    (first.path / (shard.name + ".partial")).write_bytes(struct.pack("<Q", 8) + b"{}      ")
    env(HF_HUB_OFFLINE="1")
    with pytest.raises(HotstartError, match="incomplete"):
        resolve_model("acme/tiny")
    env()
    again = downloaded("acme/tiny")  # online: the missing shard is fetched again, the rest kept
    assert again.remote.stats()["files_total"] == 1 and (root / "hf").exists()
