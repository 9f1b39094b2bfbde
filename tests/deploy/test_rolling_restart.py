"""A rolling restart under load: two real `hotstart serve` replicas (the default model) behind nginx, 8
streaming clients through it, each replica restarted in turn (SIGTERM: drain, exit; then launched again):
zero failed requests. nginx OSS has no active health checks: it learns from the answers (passive checks):
a draining or starting replica answers 503 (or refuses the connection), which `proxy_next_upstream error
timeout http_503 non_idempotent` retries on the other replica (safe: a 503 from hotstart means the request
was not run). `max_fails=0`: no replica is ever marked down, each request that meets a draining or
restarting one is passed on to the other at once (with max_fails=1, a failure of the last replica left
made nginx answer 502 "no live upstreams" to every request for fail_timeout)."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from helpers.server import Server

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make test "
                                                                        "installs it where apt-get can)")]
ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--shutdown-timeout", "60")
CONF = """
{user}worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
daemon off;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  upstream hotstart {{
    server 127.0.0.1:{p1} max_fails=0;
    server 127.0.0.1:{p2} max_fails=0;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://hotstart;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;  # the client's: keyless replicas refuse a foreign Host ("hotstart")
      proxy_buffering off;
      proxy_connect_timeout 1s;
      proxy_read_timeout 120s;
      proxy_next_upstream error timeout http_503 non_idempotent;
      proxy_next_upstream_tries 6;
      proxy_next_upstream_timeout 30s;
    }}
  }}
}}
"""
BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "ignore_eos": True, "stream": True,
        "temperature": 0, "messages": [{"role": "user", "content": "Count to ten."}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Clients:
    """N threads, each sending streaming requests one after another until stop(); `ok` and `failed`."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.ok, self.failed = url, 0, []
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def one(self, c: httpx.Client) -> str | None:
        """None if the request succeeded, else what went wrong."""
        try:
            with c.stream("POST", self.url + "/v1/chat/completions", json=BODY) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read()[:200]!r}"
                lines = [x for x in r.iter_lines() if x]
        except httpx.HTTPError as e:
            return repr(e)
        if not lines or lines[-1] != "data: [DONE]" or any('"error"' in x for x in lines):
            return f"stream: {lines[-2:]}"
        return None

    def loop(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.done.is_set():
                err = self.one(c)
                with self.lock:
                    if err is None:
                        self.ok += 1
                    else:
                        self.failed.append(err)
                if err is not None:
                    time.sleep(0.1)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(180)


def test_rolling_restart_behind_nginx_fails_no_request(default_model_dir, tmp_path):
    ports = [free_port(), free_port()]
    replicas = [None, None]
    def start(i: int) -> None:
        replicas[i] = Server(*ARGS, "--port", str(ports[i]))

    starters = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    assert all(replicas), "a replica did not start"
    proxy_port = free_port()
    user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""
    (tmp_path / "nginx.conf").write_text(CONF.format(user=user, d=tmp_path, p1=ports[0], p2=ports[1],
                                                     port=proxy_port))
    nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                              str(tmp_path / "error.log")], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{proxy_port}"
    clients = None
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert nginx.poll() is None, nginx.stderr.read().decode()
            assert time.monotonic() < deadline, "nginx did not answer"
            time.sleep(0.1)
        clients = Clients(url, 8)
        time.sleep(2)
        timings = []
        for i, port in enumerate(ports):
            t_sig = time.monotonic()
            drain_s = replicas[i].stop(timeout=90)  # SIGTERM: drain, then everything exits
            t_launch = time.monotonic()
            replicas[i] = Server(*ARGS, "--port", str(port))
            ready = time.monotonic()
            timings.append((drain_s, ready - t_launch, ready - t_sig))
            time.sleep(1)
        clients.stop()
        for i, (drain_s, launch_s, out_s) in enumerate(timings):
            print(f"\nreplica {i}: out of rotation {out_s:.2f} s = drain + exit {drain_s:.2f} s + "
                  f"launch -> ready {launch_s:.2f} s")
        print(f"{clients.ok} requests succeeded, {len(clients.failed)} failed")
        assert not clients.failed, clients.failed[:5]
        assert clients.ok >= 16
    finally:
        if clients is not None:
            clients.done.set()
        if nginx.poll() is None:
            os.killpg(nginx.pid, signal.SIGQUIT)  # graceful: lets the workers end
            try:
                nginx.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(nginx.pid, signal.SIGKILL)
                nginx.wait(10)
        for r in replicas:
            if r is not None and r.proc.poll() is None:
                r.stop(timeout=40)
