"""A stdlib OpenAI-style streaming server for the bench tests (it stands in for vLLM / llama.cpp / any peer:
no peer install needed), and a commands.env naming it as `make peers` writes one.

The server (argv: port, listen delay s, first-token delay s, token gap s, then anything, e.g. {model})
listens after the listen delay, answers /v1/models and streamed /v1/completions and /v1/chat/completions:
max_tokens (or max_completion_tokens) chunks, the first after the first-token delay, the rest a token gap
apart, the last with finish_reason "length"; a usage chunk if stream_options.include_usage (prompt tokens =
words of the prompt); then [DONE]. Every request body is appended to $FAKE_BODIES (one JSON per line)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

FAKE_SERVER = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, delay, first, gap = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
time.sleep(delay)
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        code, body = (200, {"data": [{"id": "fake-model"}]}) if self.path == "/v1/models" else (404, {})
        b = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_BODIES"], "a") as f:
            f.write(json.dumps(req) + "\n")
        chat = "messages" in req
        n = req.get("max_completion_tokens") or req["max_tokens"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        time.sleep(first)
        for i in range(n):
            piece = f"t{i} "
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == n - 1 else None
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode()); self.wfile.flush()
            if i < n - 1:
                time.sleep(gap)
        if (req.get("stream_options") or {}).get("include_usage"):
            text = req["messages"][-1]["content"] if chat else req["prompt"]
            usage = {"prompt_tokens": len(text.split()), "completion_tokens": n}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n"); self.wfile.flush()
        self.close_connection = True
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_server_cmd(tmp_path: Path, delay: float = 0.0, first: float = 0.0, gap: float = 0.01) -> str:
    """The fake server's command line, with {port} and {model} left for the benchmark to fill."""
    script = tmp_path / "fake_openai.py"
    script.write_text(FAKE_SERVER)
    return f"{sys.executable} {script} {{port}} {delay} {first} {gap} {{model}}"


def peers_env(tmp_path: Path, environ: dict, **timing) -> dict:
    """ENVIRON with HOTSTART_PEERS naming a commands.env whose vLLM and llama.cpp are the fake server, and
    FAKE_BODIES where it records the bodies."""
    cmd = fake_server_cmd(tmp_path, **timing)
    d = tmp_path / "peers"
    d.mkdir(exist_ok=True)
    (d / "commands.env").write_text(f"VLLM_PEER={shlex.quote(cmd)}\nLLAMACPP_PEER={shlex.quote(cmd)}\n")
    return {**environ, "HOTSTART_PEERS": str(d), "FAKE_BODIES": str(tmp_path / "bodies.jsonl")}


def bodies(tmp_path: Path) -> list[dict]:
    path = tmp_path / "bodies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
