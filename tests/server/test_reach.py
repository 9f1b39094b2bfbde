"""Reachable only by whom it should be (server/access.py, server/gate.py), against real servers: a keyless
server (this machine's users) refuses a foreign Host (DNS rebinding), a POST without a JSON content type
and a cross-origin browser request, unless --allowed-hosts / --allowed-origins say otherwise (then with
CORS); a keyed one serves /metrics without the key on --metrics-port only; with --admin-key, loading,
unloading and `keep_alive` are the admin's; stored responses are the key's that made them (GET, DELETE).
The keyless server also runs with a $HOTSTART_HOME others may write, holding a planted kernel library
(hotstart/trust.py): it warns, never loads it, and serves."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers.server import serving
from openai import NotFoundError, OpenAI

MODEL = "SmolLM2-135M-Instruct"
KEY, ADMIN = "sk-user-5Jq2", "sk-admin-8Wd4"
HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FOREIGN = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example", "EVIL.example.",
           "llm.internal.evil.example", "xcorp.example"]


PLANTED = r"""
#include <fcntl.h>
__attribute__((constructor)) static void planted(void) { close(open(MARKER, O_CREAT | O_WRONLY, 0600)); }
"""


@pytest.fixture(scope="module")
def planted_home(tmp_path_factory):
    """A $HOTSTART_HOME others may write (0777), holding the CPU kernels' library where the engine looks,
    with a matching hash record: a real library whose constructor leaves MARKER if anything loads it."""
    from hotstart import diskio, trust
    from hotstart.model import cpu_kernels

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the planted library")
    root = tmp_path_factory.mktemp("planted")
    home, marker = root / "home", root / "loaded"
    trust.make_private_dir(home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOTSTART_HOME", str(home))
        lib = cpu_kernels.library_path()
    trust.make_private_dir(lib.parent)
    (root / "planted.c").write_text(f'#define MARKER "{marker}"\n#include <unistd.h>\n{PLANTED}')
    tmp = diskio.temp_name(lib)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp), str(root / "planted.c")], check=True,
                   timeout=60)
    diskio.publish_recorded(tmp, lib)
    home.chmod(0o777)
    return home, marker


@pytest.fixture(scope="module")
def keyless(default_model_dir, planted_home):
    home, _ = planted_home
    yield from serving(str(default_model_dir), "--served-model-name", MODEL, "--max-model-len", "256",
                       "--allowed-hosts", "llm.internal,.corp.example", "--allowed-origins", "http://app.example",
                       "--allowed-origins", "vscode-webview://*", "--compile", "eager-only",
                       env={"HOTSTART_HOME": str(home)})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Several models (one tiny one, loaded on demand), an API key, an admin key, a metrics port."""
    root = tmp_path_factory.mktemp("reach-models")
    cmd = [sys.executable, "-m", "hotstart", "make-model", "--family", "qwen2", "--size", "tiny", "--dtype",
           "float32", "--out", str(root / "tiny")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    yield from serving("--model-dir", str(root), "--max-model-len", "128", "--max-num-seqs", "2", "--zygote",
                       "off", "--metrics-port", "0",
                       env={"HOTSTART_API_KEY": KEY, "HOTSTART_ADMIN_KEY": ADMIN})


def refused(r: httpx.Response, status: int, code: str, param: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] == "invalid_request_error", err
    assert "access-control-allow-origin" not in r.headers


def test_a_foreign_host_is_refused_and_this_machines_names_are_served(keyless):
    port = keyless.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=keyless.url, timeout=60) as c:
        for host in FOREIGN:
            refused(c.get("/v1/models", headers={"Host": host}), 403, "host_not_allowed", "Host")
            refused(c.post("/v1/chat/completions", json=HI, headers={"Host": host}), 403, "host_not_allowed",
                    "Host")
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "api.localhost",
                     socket.gethostname(), "llm.internal", "LLM.internal.", "a.corp.example", "corp.example"):
            r = c.get("/v1/models", headers={"Host": host})
            assert r.status_code == 200, (host, r.text[:200])
        assert c.post("/v1/chat/completions", json=HI, headers={"Host": "llm.internal"}).status_code == 200


def test_a_post_without_a_json_content_type_is_refused(keyless):
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()
    with httpx.Client(base_url=keyless.url, timeout=60) as c:
        for ctype in (None, "text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", "text/json", "application/jsonp"):
            headers = {} if ctype is None else {"content-type": ctype}
            r = c.post("/v1/completions", content=body, headers=headers)
            refused(r, 415, "unsupported_media_type", "Content-Type")
            assert f"got `{(ctype or 'none').split(';')[0]}`" in r.json()["error"]["message"]
        for ctype in ("application/json", "Application/JSON; charset=utf-8"):
            assert c.post("/v1/completions", content=body, headers={"content-type": ctype}).status_code == 200


def test_cross_origin_browser_requests_are_refused_unless_allowed(keyless):
    port = int(keyless.url.rsplit(":", 1)[1])
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with httpx.Client(base_url=keyless.url, timeout=60) as c:
        for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Origin": f"http://127.0.0.1:{port + 1}"}, {"Sec-Fetch-Site": "cross-site"},
                        {"Sec-Fetch-Site": "same-site", "Origin": f"http://localhost:{port + 1}"},
                        {"Origin": "http://app.example.evil"}):
            refused(c.get("/v1/models", headers=headers), 403, "cross_origin_refused", "Origin")
            refused(c.post("/v1/chat/completions", json=HI, headers=headers), 403, "cross_origin_refused",
                    "Origin")
        r = c.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
        refused(r, 403, "cross_origin_refused", "Origin")
        # its own pages, the address bar, and the one allowed origin (with CORS headers)
        for headers in ({"Origin": keyless.url}, {"Sec-Fetch-Site": "same-origin", "Origin": keyless.url},
                        {"Sec-Fetch-Site": "none"}):
            assert c.get("/v1/models", headers=headers).status_code == 200, headers
        r = c.post("/v1/chat/completions", json=HI, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.options("/v1/chat/completions", headers={"Origin": "http://app.example", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "vscode-webview://4f2a", "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "vscode-webview://4f2a"


def test_stored_responses_can_be_read_and_deleted(keyless):
    c = OpenAI(base_url=keyless.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    made = c.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
    assert c.responses.retrieve(made.id).output_text == made.output_text
    c.responses.delete(made.id)
    with pytest.raises(NotFoundError):
        c.responses.retrieve(made.id)
    with pytest.raises(NotFoundError):
        c.responses.delete(made.id)


def metrics_url(server) -> str:
    return re.search(r"without the key at (http://\S+/metrics)", server.output)[1]


def test_prometheus_scrapes_the_metrics_port_without_the_key(keyed):
    assert httpx.get(keyed.url + "/metrics").status_code == 401  # the API's port keeps the key
    r = httpx.get(metrics_url(keyed), timeout=30)
    assert r.status_code == 200 and "hotstart_model_state" in r.text, r.text[:300]
    base = metrics_url(keyed).removesuffix("/metrics")
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"),
                         ("POST", "/v1/models/tiny/load")):
        r = httpx.request(method, base + path, json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_admin_routes_and_keep_alive_need_the_admin_key(keyed):
    user, admin = ({"Authorization": f"Bearer {k}"} for k in (KEY, ADMIN))
    url = keyed.url + "/v1/models/tiny"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=keyed.url, timeout=120) as c:
        refused(c.post(url + "/load", json={}, headers=user), 403, "admin_key_required", None)
        refused(c.post("/v1/completions", json={**body, "keep_alive": 0}, headers=user), 403,
                "admin_key_required", "keep_alive")
        assert c.post(url + "/load", json={}, headers=admin).json()["state"] == "loaded"
        assert c.post("/v1/completions", json=body, headers=user).status_code == 200  # inference: the API key
        refused(c.post(url + "/unload", json={}, headers=user), 403, "admin_key_required", None)
        r = c.post("/v1/completions", json={**body, "keep_alive": 0}, headers=admin)  # unloads after it
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while c.get(url, headers=user).json()["state"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get(url, headers=user).json()["state"] == "unloaded"


def test_stored_responses_are_the_keys_that_made_them(keyed):
    mine, theirs = (OpenAI(base_url=keyed.url + "/v1", api_key=k, max_retries=0, timeout=120)
                    for k in (KEY, ADMIN))
    made = mine.responses.create(model="tiny", input="hi", max_output_tokens=2)
    for attempt in (lambda: theirs.responses.retrieve(made.id), lambda: theirs.responses.delete(made.id),
                    lambda: theirs.responses.create(model="tiny", input="go", previous_response_id=made.id)):
        with pytest.raises(NotFoundError):
            attempt()
    assert mine.responses.retrieve(made.id).id == made.id
    follow = mine.responses.create(model="tiny", input="go", previous_response_id=made.id,
                                   max_output_tokens=2)
    assert follow.previous_response_id == made.id
    mine.responses.delete(made.id)
    with pytest.raises(NotFoundError):
        mine.responses.retrieve(made.id)


def test_native_code_in_a_home_others_may_write_is_never_loaded(keyless, planted_home):
    _, marker = planted_home
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fast = httpx.get(keyless.url + "/startup", timeout=10).json().get("fast_path") or {}
        if fast.get("packing") not in (None, "planned", "packing"):
            break
        time.sleep(0.2)
    assert "open to other users" in fast.get("packing_detail", ""), fast  # why no CPU kernels
    assert not marker.exists(), "the planted library was loaded"
    warnings = [line for line in keyless.lines if "WARNING" in line and "HOTSTART_HOME" in line]
    assert len(warnings) == 1 and "open to other users" in warnings[0], keyless.output[-2000:]
    assert httpx.post(keyless.url + "/v1/chat/completions", json=HI, timeout=60).status_code == 200
