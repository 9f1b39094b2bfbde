"""`hotstart serve ORG/NAME` and `hotstart pull ORG/NAME` from a loopback hub (tests/helpers/hub.py), as
real processes: the default model by hub id answers correctly while its weights stream in (the API
process importing neither torch nor anything off its main thread), a restart serves the cache under
NAME=ORG/NAME, an unreachable endpoint serves it with one warning line; a killed pull resumes, and a
gated repository is one `hotstart: error:` line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers.cli import assert_fails_with, hotstart
from helpers.hub import GOOD, hub_env, start_hub
from helpers.server import Server, openai_client

from hotstart.model.arrival import ArrivalState

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("hub")
    h = start_hub({"acme/smol": default_model_dir, "acme/gated": default_model_dir}, root / "memo.json",
                  cap_mbps=200)
    yield h
    h.stop()


def ask(server: Server, model: str) -> tuple[str, dict]:
    answer = openai_client(server).chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0).choices[0].message.content
    with urllib.request.urlopen(server.url + "/startup", timeout=30) as r:
        return answer, json.loads(r.read())


def test_serve_by_hub_id_cold_warm_and_unreachable(hub, tmp_path, default_model_dir):
    audit = tmp_path / "audit.json"
    env = {**hub_env(hub, tmp_path, token=GOOD), "HOTSTART_AUDIT_IMPORTS": str(audit)}
    s = Server("acme/smol", env=env, ready_timeout=300)
    try:
        answer, body = ask(s, "acme/smol")
    finally:
        s.stop()
    assert "Paris" in answer
    d = body["download"]
    size = (default_model_dir / "model.safetensors").stat().st_size
    assert (d["source"], d["state"], d["bytes_total"], d["bytes_verified"], d["error"]) == (
        "hf", "done", size, size, None)
    names = {p["name"] for p in body["phases"]}
    assert {"hf listed", "sidecars downloaded", "downloaded model.safetensors", "weights downloaded"} <= names
    assert "% (" in s.output and GOOD not in s.output  # the progress line; never the token
    seen = json.loads(audit.read_text())
    assert not seen["torch_imported"] and not seen["off_main_thread"], seen

    # (a restart with the endpoint up serves the cache after one request: test_hub_protocol.py)
    down = Server("smol=acme/smol", env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, ready_timeout=300)
    try:
        models = [m.id for m in openai_client(down).models.list().data]
        again, obody = ask(down, "smol")
    finally:
        down.stop()
    assert models == ["smol"] and again == answer and obody["download"]["source"] == "hf-offline"
    assert "downloaded model.safetensors" not in [p["name"] for p in obody["phases"]]
    assert down.output.count("hotstart: WARNING:") == 1 and "cannot reach it" in down.output


def test_pull_resumes_after_a_kill_and_gated_is_one_line(hub, tmp_path):
    env = {**os.environ, **hub_env(hub, tmp_path), "HOTSTART_S3_CHECKPOINT_S": "0.2"}
    hub.link.rate = 30e6  # slow enough to be killed half-way
    hub.log.clear()
    try:
        p = subprocess.Popen([sys.executable, "-m", "hotstart", "pull", "acme/smol"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        arrival = (tmp_path / "hf/models--acme--smol/snapshots" / hub.repos["acme/smol"].commit /
                   "model.safetensors.arrival")
        deadline = time.monotonic() + 60
        while not (arrival.is_file() and ArrivalState(arrival).durable(0)):  # chunk 0 in, checkpointed
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        hub.link.rate = 200e6
    run = hotstart("pull", "acme/smol", env=env, timeout=120)
    assert run.rc == 0, run.stderr
    assert run.stdout.strip().endswith("/snapshots/" + hub.repos["acme/smol"].commit)
    assert "pulling acme/smol 100%" in run.stderr and "verified" in run.stderr
    resumed = [r for r in hub.requests("model.safetensors") if r[2] == "bytes=0-16777215"]
    assert len(resumed) == 1  # the first chunk was durable: not fetched again

    gated = hotstart("pull", "acme/gated", env=env, timeout=60)
    assert_fails_with(gated, "acme/gated", "gated", "HF_TOKEN")
    assert not (tmp_path / "hf" / "models--acme--gated" / "refs").exists()  # nothing a start would trust
