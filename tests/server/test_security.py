"""Security defaults: loopback bind (beyond it only with a key, or --allow-no-api-key), API key on every
endpoint but /health and /live (constant-time compare), no pickle loading, model names that never reach
the filesystem, and logs without keys or prompts.

/metrics needs the key too on the API's port: its counters (requests by status, prompt and generated
token totals, queue depth) describe the traffic; `--metrics-port` serves it without the key on a port of
its own, for a scrape (tests/server/test_reach.py). /health stays open for load balancers and
orchestrators, and says nothing but the engine's phase. The rest of who may reach the server (Host,
Origin, content type, the admin key): tests/server/test_reach.py.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import psutil
import pytest
from helpers.server import Server, serving

from hotstart.bench.default_hf import default_model_dir as served_model_folder

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-hotstart-Q7Zr4kP2vX9mTn8W"
PROMPT = "Describe the purple giraffe named Zorblaxian-4417 in one word."
PACKAGE = Path(__file__).resolve().parents[2] / "hotstart"
HOSTILE_MODELS = ["../../etc/passwd", "/etc/passwd", "~", "~root/.ssh/id_rsa", "..", ".",
                  str(served_model_folder()),  # the served model's own folder
                  f"{MODEL}/../{MODEL}", f"./{MODEL}", f"{MODEL}/", "file:///etc/passwd",
                  "%2e%2e%2fetc%2fpasswd"]


@pytest.fixture(scope="module")
def server(default_model_dir):
    # debug: if nothing leaks at the most verbose level, nothing leaks at the default one
    yield from serving("--max-model-len", "512", "--api-key", KEY, "--log-level", "debug")


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["message"]
    assert KEY not in r.text


# --- bind address ------------------------------------------------------------------------------------
def listening(pid: int) -> list[str]:
    """IP addresses the process and its descendants listen on (TCP)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    addrs = []
    for p in procs:
        try:
            addrs += [c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return addrs


def test_binds_loopback_by_default(server):
    assert server.url.startswith("http://127.0.0.1:")
    addrs = listening(server.proc.pid)
    assert addrs and set(addrs) == {"127.0.0.1"}, addrs  # nothing on 0.0.0.0 / ::, engine included


def test_beyond_loopback_without_a_key_is_refused_unless_allowed(default_model_dir):
    for host in ("0.0.0.0", "::"):
        proc = subprocess.Popen([sys.executable, "-m", "hotstart", "serve", "--host", host, "--port", "0"],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        _, err = proc.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("hotstart: error:"), err
        assert "--allow-no-api-key" in lines[0] and "HOTSTART_API_KEY" in lines[0]
        time.sleep(0.2)
        with pytest.raises(ProcessLookupError):  # nothing it started is left (its own process group)
            os.killpg(proc.pid, 0)
    s = Server("--host", "0.0.0.0", "--allow-no-api-key", "--max-model-len", "512", wait_ready=False)
    try:
        assert s.url.startswith("http://0.0.0.0:")
        assert "0.0.0.0" in listening(s.proc.pid)
    finally:
        s.stop()
    warnings = [line for line in s.output.splitlines() if "WARNING" in line]
    assert warnings and "without an API key" in warnings[0] and "--allow-no-api-key" in warnings[0], s.output


# --- the API key -------------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None), ("GET", "/startup", None),
    ("GET", "/metrics", None), ("GET", "/v1/does-not-exist", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
]
BAD_AUTH = [None, "", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer  x{KEY}", f"Basic {KEY}", KEY,
            "Bearer", f"Token {KEY}", f"Bearer {KEY} {KEY}", b"Bearer \xff\xfe", f"Bearer {KEY.lower()}"]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_every_endpoint_but_health_requires_the_key(server, method, path, body):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for auth in BAD_AUTH:
            headers = {} if auth is None else {"Authorization": auth}
            assert_401(c.request(method, path, json=body, headers=headers))
        r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == (404 if "does-not-exist" in path else 200), r.text[:300]
        assert KEY not in r.text
        # the scheme is case-insensitive (RFC 7235 2.1); the key is not
        lower = c.request(method, path, json=body, headers={"Authorization": f"bearer {KEY}"})
        assert lower.status_code != 401


def test_health_is_open_and_says_nothing_more(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_key_is_compared_in_constant_time():
    from hotstart.server import gate

    src = inspect.getsource(gate.Gate)
    assert "hmac.compare_digest(" in src
    assert not re.search(r"(==|!=)\s*self\.key|self\.key\s*(==|!=)|\bin self\.key", src), src


# --- no pickle ---------------------------------------------------------------------------------------
def call_text(src: str, start: int) -> str:
    """The source of the call whose opening parenthesis is the first one at or after START."""
    i = src.index("(", start)
    depth = 0
    for j in range(i, len(src)):
        depth += {"(": 1, ")": -1}.get(src[j], 0)
        if depth == 0:
            return src[start:j + 1]
    return src[start:]


def test_no_pickle_loading_anywhere_in_the_package():
    problems = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    for f in files:
        src = f.read_text()
        for m in re.finditer(r"\btorch\.load\s*\(", src):
            if not re.search(r"weights_only\s*=\s*True", call_text(src, m.start())):
                problems.append(f"{f}: torch.load without weights_only=True")
        for pattern, what in [(r"\b(c?pickle|dill|joblib|marshal)\.loads?\s*\(", "unpickling"),
                              (r"\bpickle\.Unpickler\b", "unpickling"),
                              (r"trust_remote_code\s*=\s*True", "trust_remote_code=True"),
                              (r"allow_pickle\s*=\s*True", "numpy allow_pickle=True"),
                              (r"\byaml\.(unsafe_)?load\s*\((?![^)]*SafeLoader)",
                               "yaml.load without SafeLoader")]:
            problems += [f"{f}: {what}" for _ in re.finditer(pattern, src)]
    assert not problems, problems


# --- model names ---------------------------------------------------------------------------------------
def model_url(name: str) -> str:
    """/v1/models/NAME with every character of NAME kept (the client would resolve dot segments)."""
    return "/v1/models/" + quote(name, safe="").replace(".", "%2E")


@pytest.mark.parametrize("name", HOSTILE_MODELS)
def test_hostile_model_names_are_404(server, name):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(server.url + model_url(name), headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                   json={"model": name, "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_model_names_never_reach_the_filesystem(default_model_dir):
    """In process, with an audit hook: no filesystem call sees any of the hostile names."""
    from starlette.testclient import TestClient

    from hotstart.boot.timeline import Timeline
    from hotstart.messages import EngineStats
    from hotstart.server.api import ApiSettings
    from hotstart.server.routes import build_app
    from hotstart.text.tokenizer import Tokenizer

    class IdleEngine:  # check_model answers before anything reaches the engine
        ready, status, info, stats, fast_path = True, "ready", None, EngineStats(), None
        timeline = Timeline(time.time())

    settings = ApiSettings(served_model_names=[MODEL])
    app = build_app(IdleEngine(), Tokenizer.from_dir(default_model_dir), settings)
    client = TestClient(app, raise_server_exceptions=False)
    hi = [{"role": "user", "content": "hi"}]
    client.post("/v1/chat/completions", json={"model": "warm-up", "messages": hi})  # lazy imports done
    client.get("/v1/models/warm-up")
    seen: list[tuple] = []
    recording = [True]
    needles = ("passwd", "id_rsa", str(default_model_dir), "~", "..")
    fs_events = ("open", "os.", "shutil.", "glob.", "pathlib.", "io.open")

    def hook(event: str, args: tuple) -> None:
        if recording[0] and event.startswith(fs_events):
            text = repr(args)
            if any(n in text for n in needles):
                seen.append((event, text[:200]))

    sys.addaudithook(hook)  # cannot be removed: it stops recording at the end of the test
    try:
        with pytest.raises(OSError):  # the hook sees file access: a control
            open("/nonexistent-dir/passwd")  # noqa: SIM115
        assert seen and seen[0][0] == "open", seen
        seen.clear()
        for name in HOSTILE_MODELS:
            r = client.post("/v1/chat/completions", json={"model": name, "messages": hi})
            assert r.status_code == 404, r.text
            r = client.post("/v1/completions", json={"model": name, "prompt": "hi"})
            assert r.status_code == 404, r.text
            assert client.get(model_url(name)).status_code == 404
    finally:
        recording[0] = False
    assert not seen, seen


# --- logs --------------------------------------------------------------------------------------------
def test_logs_never_contain_the_key_or_the_prompt(server):
    """Last in this module: it stops the shared server to read its whole output."""
    good = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": PROMPT}]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", headers=good,
                   json={"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert r.status_code == 200
        r = c.post("/v1/completions", headers=good, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                          "stream": True})
        assert r.status_code == 200
        # failures too: a bad parameter, an unknown model, too long a prompt, a wrong key
        for body in ({"model": MODEL, "messages": msgs, "temperature": 9},
                     {"model": PROMPT, "messages": msgs},
                     {"model": MODEL, "messages": [{"role": "user", "content": PROMPT * 200}]}):
            assert c.post("/v1/chat/completions", headers=good, json=body).status_code in (400, 404)
        assert c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {PROMPT}"},
                      json={"model": MODEL, "messages": msgs}).status_code == 401
        for path in ("/startup", "/metrics", "/v1/models"):
            assert KEY not in c.get(path, headers=good).text
    server.stop()
    out = server.output
    assert "Traceback" not in out, out[-3000:]
    for secret in (KEY, PROMPT, "Zorblaxian"):
        assert secret not in out, f"{secret!r} found in the server's output"
