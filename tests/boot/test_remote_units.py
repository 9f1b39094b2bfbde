"""s3:// models without a server: spec parsing, settings precedence, load order, header checks, and the
arrival files through which the loader reads weights while they are written (real files, real threads)."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from hotstart.boot.remote import is_remote, parse_remote
from hotstart.boot.remote.snapshot import RemoteObject, header_size_check, weight_order
from hotstart.boot.remote.store import store_settings
from hotstart.errors import HotstartError, WeightsError
from hotstart.model import arrival
from hotstart.model.arrival import COMPLETE, HEARTBEAT, STATE, WATERMARK, ArrivalState, open_arrived
from hotstart.model.files import weight_files


@pytest.mark.parametrize(
    "spec, bucket, prefix, name",
    [
        ("s3://models/smol", "models", "smol", "smol"),
        ("s3://models/org/smol/", "models", "org/smol", "smol"),
        ("s3://my.bucket-1", "my.bucket-1", "", "my.bucket-1"),
        ("chat=s3://models/a/b", "models", "a/b", "chat"),
    ],
)
def test_parse_remote(spec, bucket, prefix, name):
    assert is_remote(spec)
    r = parse_remote(spec)
    assert (r.bucket, r.prefix, r.name) == (bucket, prefix, name)
    assert r.key("config.json") == (f"{prefix}/config.json" if prefix else "config.json")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("s3://Bad_Bucket/x", "not a valid S3 bucket"),
        ("s3://ab/x", "not a valid S3 bucket"),
        ("s3://models/a/../b", "invalid prefix"),
        ("s3://models/a//b", "invalid prefix"),
        ("s3://models/a?b", "invalid prefix"),
        ("=s3://models/a", "not a valid model name"),
    ],
)
def test_parse_remote_rejects(spec, needle):
    with pytest.raises(HotstartError, match=needle):
        parse_remote(spec)


def test_is_remote_leaves_other_specs_alone():
    for spec in (None, "", "org/name", "./s3://x", "/tmp/a=s3://b", "HuggingFaceTB/SmolLM2-135M"):
        assert not is_remote(spec)


def test_settings_precedence_and_profiles(tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = AKIDEFAULT\naws_secret_access_key = s1\n"
        "[other]\naws_access_key_id = AKIOTHER\naws_secret_access_key = s2\naws_session_token = tk\n"
    )
    conf = tmp_path / "config"
    conf.write_text("[profile other]\nregion = eu-west-3\nendpoint_url = http://127.0.0.1:9\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(conf)}

    config, shown, how = store_settings(
        {
            **files,
            "AWS_ACCESS_KEY_ID": "AKIENV",
            "AWS_SECRET_ACCESS_KEY": "e",
            "AWS_ENDPOINT_URL": "http://a:1",
            "AWS_ENDPOINT_URL_S3": "http://s3:2/",
        }
    )
    assert (config["access_key_id"], config["endpoint"], shown, how) == (
        "AKIENV",
        "http://s3:2",
        "http://s3:2",
        "environment",
    )
    config, shown, how = store_settings({**files, "AWS_PROFILE": "other"})
    assert (config["access_key_id"], config["session_token"], config["region"], config["endpoint"]) == (
        "AKIOTHER",
        "tk",
        "eu-west-3",
        "http://127.0.0.1:9",
    )
    assert how == "profile other"
    config, shown, how = store_settings({**files, "AWS_REGION": "ap-south-1"})
    assert (config["access_key_id"], config["region"], shown) == (
        "AKIDEFAULT",
        "ap-south-1",
        "AWS S3 (ap-south-1)",
    )
    config, _, how = store_settings(
        {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    )
    assert "access_key_id" not in config and how.startswith("default chain")
    for value in (shown, how):  # what messages show never carries a secret
        assert "s1" not in value and "s2" not in value and "AKI" not in value


def _objs(*names: str) -> list[RemoteObject]:
    return [RemoteObject(n, 10, f'"{n}"') for n in names]


def test_weight_order_follows_the_loader_rules(tiny_checkpoint):
    spec = parse_remote("s3://models/m")
    index = json.dumps(
        {
            "weight_map": {
                "a": "model-00002-of-00002.safetensors",
                "b": "model-00001-of-00002.safetensors",
                "c": "model-00002-of-00002.safetensors",
            }
        }
    )
    tensors = _objs(
        "model-00002-of-00002.safetensors", "consolidated.safetensors", "model-00001-of-00002.safetensors"
    )
    assert [o.name for o in weight_order(spec.url, tensors, index)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert [o.name for o in weight_order(spec.url, _objs("b.safetensors", "model.safetensors"), None)] == [
        "model.safetensors"
    ]
    assert [o.name for o in weight_order(spec.url, _objs("b.safetensors", "a.safetensors"), None)] == [
        "a.safetensors",
        "b.safetensors",
    ]
    with pytest.raises(HotstartError, match="does not have"):
        weight_order(spec.url, _objs("model-00001-of-00002.safetensors"), index)
    # the same order as the loader's own rules on a real sharded checkpoint written by transformers
    folder = tiny_checkpoint("llama", shard=True)
    names = [p.name for p in folder.iterdir() if p.name.endswith(".safetensors")]
    got = weight_order(spec.url, _objs(*sorted(names)), (folder / "model.safetensors.index.json").read_text())
    assert [o.name for o in got] == [p.name for p in weight_files(folder)]


def _safetensors_bytes(data_len: int) -> bytes:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [data_len // 4], "data_offsets": [0, data_len]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + bytes(data_len)


def test_header_size_check():
    spec = parse_remote("s3://models/m")
    blob = _safetensors_bytes(4096)
    assert header_size_check(spec.url, RemoteObject("x.safetensors", len(blob), ""), blob) == len(blob) - 4096
    assert header_size_check(spec.url, RemoteObject("x.safetensors", len(blob), ""), blob[:20]) is None
    with pytest.raises(HotstartError, match="truncated"):
        header_size_check(spec.url, RemoteObject("x.safetensors", len(blob) - 100, ""), blob[:-100])
    with pytest.raises(HotstartError, match="trailing bytes"):
        header_size_check(spec.url, RemoteObject("x.safetensors", len(blob) + 8, ""), blob + bytes(8))
    with pytest.raises(HotstartError, match="does not fit"):
        header_size_check(spec.url, RemoteObject("x.safetensors", 50, ""), struct.pack("<Q", 1 << 20))


class _Writer:
    """Writes SRC into DST.partial chunk by chunk the way the downloader does (pwrite, then the
    watermark), then fsyncs and renames; `fail_at` records a failure at that chunk instead."""

    def __init__(self, src: Path, dst: Path, chunk: int, pause: float, fail_at: int | None = None):
        self.data, self.dst, self.chunk, self.pause, self.fail_at = (
            src.read_bytes(),
            dst,
            chunk,
            pause,
            fail_at,
        )
        self.state = ArrivalState.create(arrival.arrival_path(dst), len(self.data), chunk, '"etag"')
        self.fd = os.open(arrival.partial_path(dst), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, len(self.data))
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        for i, off in enumerate(range(0, len(self.data), self.chunk)):
            time.sleep(self.pause)
            if i == self.fail_at:
                self.state.fail("s3://models/m/x.safetensors: access denied (AccessDenied)")
                return
            os.pwrite(self.fd, self.data[off : off + self.chunk], off)
            self.state.set(WATERMARK, min(len(self.data), off + self.chunk))
            self.state.beat()
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(arrival.partial_path(self.dst), self.dst)
        self.state.set(STATE, COMPLETE)


def test_loader_reads_a_file_while_it_arrives(tiny_checkpoint, tmp_path):
    import torch

    from hotstart.config import load_model_config
    from hotstart.model.loader import load_model

    src = tiny_checkpoint("qwen2")
    dst = tmp_path / "m"
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    writer = _Writer(src / "model.safetensors", dst / "model.safetensors", chunk=64 << 10, pause=0.002)
    assert weight_files(dst) == [dst / "model.safetensors"]  # arriving counts as present
    writer.thread.start()
    cfg = load_model_config(dst)
    arrived = load_model(cfg, [dst / "model.safetensors"], dtype=torch.float32)
    writer.thread.join(30)
    assert (dst / "model.safetensors").is_file() and not arrival.partial_path(
        dst / "model.safetensors"
    ).exists()
    plain = load_model(cfg, [src / "model.safetensors"], dtype=torch.float32)
    ref = dict(plain.named_parameters())
    for name, p in arrived.named_parameters():
        assert torch.equal(p, ref[name]), name


def test_arrival_failure_and_a_dead_writer_end_the_wait(tmp_path, monkeypatch):
    blob = _safetensors_bytes(1 << 20)
    (tmp_path / "src.safetensors").write_bytes(blob)
    writer = _Writer(
        tmp_path / "src.safetensors", tmp_path / "x.safetensors", chunk=128 << 10, pause=0.01, fail_at=3
    )
    writer.thread.start()
    f, wait = open_arrived(tmp_path / "x.safetensors", lambda p: open(p, "rb"))
    try:
        with pytest.raises(WeightsError, match="access denied"):
            wait(len(blob))
    finally:
        f.close()
    dead = _Writer(tmp_path / "src.safetensors", tmp_path / "y.safetensors", chunk=128 << 10, pause=0.0)
    dead.state.set(WATERMARK, 128 << 10)  # header in, then the writer goes silent
    os.pwrite(dead.fd, blob[: 128 << 10], 0)
    dead.state.set(HEARTBEAT, time.time_ns() - int(60e9))
    monkeypatch.setattr(arrival, "HEARTBEAT_STALE_S", 1.0)
    f, wait = open_arrived(tmp_path / "y.safetensors", lambda p: open(p, "rb"))
    try:
        with pytest.raises(WeightsError, match="stopped"):
            wait(len(blob))
    finally:
        f.close()


def test_hostile_listings_never_name_a_path(monkeypatch, tmp_path):
    from hotstart.boot.remote.hfhub import HfSource
    from hotstart.boot.remote.snapshot import candidates
    from hotstart.boot.remote.source import StoreError

    objs = [RemoteObject(n, 10, "e") for n in ("config.json", "..", "a\0.safetensors", "x.safetensors")]
    sidecars, tensors = candidates("hub", objs, "endpoint")
    assert [o.name for o in sidecars + tensors] == ["config.json", "x.safetensors"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "")
    source = HfSource("acme/evil", "a" * 40)  # a commit: no revision request
    tree = [{"type": "file", "path": "model.safetensors", "size": 10, "oid": "b" * 40,
             "lfs": {"oid": "../../../../etc/x", "size": 10}}]
    monkeypatch.setattr(source, "_get", lambda *a, **k: tree)
    with pytest.raises(StoreError, match="invalid digest"):
        source.list()
