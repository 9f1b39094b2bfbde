"""`hotstart serve s3://...` against a real S3 endpoint on loopback (moto's server), with real uploads:
the default model answers correctly, a sharded checkpoint answers as its local folder does, a restart
serves the warm cache after one listing (and, with the store unreachable, the cached copy with a
warning), an interrupted download resumes, and 5xx answers and cut bodies are retried."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.s3 import FaultProxy, Moto
from helpers.server import Server, openai_client

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def moto():
    m = Moto()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 27 MB float32 qwen2-shaped checkpoint in 3 shards with the default model's tokenizer."""
    out = tmp_path_factory.mktemp("tiny") / "m"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hotstart",
            "make-model",
            "--family",
            "qwen2",
            "--size",
            "tiny",
            "--dtype",
            "float32",
            "--shard-size",
            "1MB",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


def startup(server: Server) -> dict:
    with urllib.request.urlopen(server.url + "/startup", timeout=30) as r:
        return json.loads(r.read())


def phases(server: Server) -> list[str]:
    return [p["name"] for p in startup(server)["phases"]]


def greedy(server: Server, model: str) -> tuple[str, list]:
    c = openai_client(server)
    r = c.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0, logprobs=1
    )
    return r.choices[0].text, r.choices[0].logprobs.tokens


def test_default_model_from_s3_then_warm_then_offline(moto, default_model_dir, tmp_path):
    moto.upload("models", "smol", default_model_dir)
    home = tmp_path / "home"
    audit = tmp_path / "audit.json"
    proxy = FaultProxy(moto.port)  # the endpoint; stopped below to make the store unreachable
    env = {**moto.env(proxy.url), "HOTSTART_HOME": str(home), "HOTSTART_AUDIT_IMPORTS": str(audit)}
    s = Server("s3://models/smol", env=env, ready_timeout=300)
    try:
        answer = (
            openai_client(s)
            .chat.completions.create(model="smol", messages=CHAT, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
        )
        body = startup(s)
    finally:
        s.stop()
    assert "Paris" in answer
    d = body["download"]
    size = (default_model_dir / "model.safetensors").stat().st_size
    assert (d["state"], d["source"], d["bytes_total"], d["bytes_done"], d["error"]) == (
        "done",
        "s3",
        size,
        size,
        None,
    )
    assert d["cpu_s"] > 0 and d["rate_mbps"] > 0
    names = [p["name"] for p in body["phases"]]
    assert {"s3 listed", "sidecars downloaded", "downloaded model.safetensors", "weights downloaded"} <= set(
        names
    )
    assert "% (" in s.output and "MB/s" in s.output  # the terminal progress line
    assert "testing" not in s.output  # the credentials are never printed
    seen = json.loads(audit.read_text())  # the API process: no torch, and its threads imported nothing
    assert not seen["torch_imported"] and not seen["off_main_thread"], seen

    cached = Path(d["path"])
    assert (cached / ".hotstart-s3.json").is_file() and not list(cached.glob("*.partial"))
    warm = Server("s3://models/smol", env=env, ready_timeout=300)
    try:
        again = (
            openai_client(warm)
            .chat.completions.create(model="smol", messages=CHAT, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
        )
        wbody = startup(warm)
    finally:
        warm.stop()
    assert again == answer
    assert wbody["download"]["source"] == "s3-cache" and wbody["download"]["path"] == str(cached)
    assert "s3 listed" in [p["name"] for p in wbody["phases"]]
    assert "weights downloaded" not in [p["name"] for p in wbody["phases"]]

    proxy.stop()  # nothing listens at the endpoint any more
    offline = Server("s3://models/smol", env=env, ready_timeout=300)
    try:
        third = (
            openai_client(offline)
            .chat.completions.create(model="smol", messages=CHAT, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
        )
        obody = startup(offline)
    finally:
        offline.stop()
    assert third == answer and obody["download"]["source"] == "s3-offline"
    assert "hotstart: WARNING:" in offline.output and "cannot reach the store" in offline.output


def test_sharded_named_model_answers_as_its_local_folder(moto, tiny, tmp_path):
    moto.upload("models", "tiny", tiny)
    env = {
        **moto.env(),
        "HOTSTART_HOME": str(tmp_path / "home"),
        "HOTSTART_S3_CHUNK_MB": "0.25",
        "HOTSTART_S3_THREADS": "3",
    }
    s = Server("chat-tiny=s3://models/tiny", env=env, ready_timeout=300)
    try:
        models = [m.id for m in openai_client(s).models.list().data]
        remote = greedy(s, "chat-tiny")
        body = startup(s)
    finally:
        s.stop()
    assert models == ["chat-tiny"]
    assert body["download"]["files_total"] == 3 and body["download"]["state"] == "done"
    done = [p["name"] for p in body["phases"] if p["name"].startswith("downloaded ")]
    assert done == [f"downloaded model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # in load order
    local = Server(str(tiny), env={"HOTSTART_HOME": str(tmp_path / "home2")}, ready_timeout=300)
    try:
        assert greedy(local, "m") == remote
    finally:
        local.stop()


def test_interrupted_download_resumes(moto, tiny, tmp_path):
    moto.upload("models", "resume", tiny)
    proxy = FaultProxy(moto.port)
    proxy.delay_s = 0.15  # slow enough to be interrupted half-way
    home = tmp_path / "home"
    env = {
        **moto.env(proxy.url),
        "HOTSTART_HOME": str(home),
        "HOTSTART_S3_CHUNK_MB": "0.5",
        "HOTSTART_S3_THREADS": "2",
        "HOTSTART_S3_CHECKPOINT_S": "0.2",
    }
    try:  # (the same endpoint both times: the cache is keyed by endpoint, bucket and prefix)
        s = Server("s3://models/resume", env=env, ready_timeout=300, wait_ready=False)
        deadline = time.monotonic() + 120
        while True:
            try:
                d = startup(s).get("download") or {}
            except OSError:
                d = {}
            if d.get("bytes_done", 0) > 0.3 * d.get("bytes_total", 1):
                break
            assert time.monotonic() < deadline, s.output[-2000:]
            time.sleep(0.1)
        time.sleep(0.5)  # a checkpoint after it
        os.killpg(s.proc.pid, signal.SIGKILL)  # the whole server, mid-download
        s.proc.wait(10)
        snap = Path(d["path"])
        assert list(snap.glob("*.partial")) and not (snap / ".hotstart-s3.json").exists()
        proxy.delay_s = 0.0
        again = Server("s3://models/resume", env=env, ready_timeout=300)
        try:
            text = greedy(again, "resume")
            d2 = startup(again)["download"]
        finally:
            again.stop()
    finally:
        proxy.stop()
    assert d2["state"] == "done" and d2["bytes_resumed"] > 0 and d2["bytes_done"] == d2["bytes_total"]
    assert not list(snap.glob("*.partial")) and not list(snap.glob("*.arrival"))
    local = Server(str(tiny), env={"HOTSTART_HOME": str(tmp_path / "home2")}, ready_timeout=300)
    try:
        assert greedy(local, "m") == text
    finally:
        local.stop()


def test_5xx_and_cut_bodies_are_retried(moto, tiny, tmp_path):
    moto.upload("models", "flaky", tiny)
    proxy = FaultProxy(moto.port)
    proxy.fail, proxy.cut = 3, 2
    env = {**moto.env(proxy.url), "HOTSTART_HOME": str(tmp_path / "home"), "HOTSTART_S3_CHUNK_MB": "1"}
    try:
        s = Server("s3://models/flaky", env=env, ready_timeout=300)
        try:
            text = greedy(s, "flaky")
            d = startup(s)["download"]
        finally:
            s.stop()
    finally:
        proxy.stop()
    assert (proxy.failed, proxy.cut_done) == (3, 2)
    assert d["state"] == "done" and text
