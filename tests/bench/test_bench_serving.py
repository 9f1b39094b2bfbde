"""benchmarks/serve_bench.py and benchmarks/over_time.py against a stdlib stand-in for the peers (no vLLM or
llama.cpp install needed): the peers come from a temporary commands.env, as `make peers` writes it.

Bounded: ~20 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from util import run_session

REPO = Path(__file__).resolve().parents[2]

# Streams N content chunks (N = the request's max_tokens), 10 ms apart; listens only after a delay (argv 2)
# so the over-time clients must retry; records every request body in $FAKE_BODIES. Extra argv ignored.
FAKE_SSE = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, delay = int(sys.argv[1]), float(sys.argv[2])
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
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        for i in range(req["max_tokens"]):
            ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason":
                               "length" if i == req["max_tokens"] - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode()); self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n"); self.wfile.flush()
        self.close_connection = True
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def peers_env(tmp_path: Path, delay: float = 0.0) -> dict:
    script = tmp_path / "fake_sse.py"
    script.write_text(FAKE_SSE)
    cmd = f"{sys.executable} {script} {{port}} {delay} {{model}}"
    d = tmp_path / "peers"
    d.mkdir(exist_ok=True)
    (d / "commands.env").write_text(f"VLLM_PEER={shlex.quote(cmd)}\nLLAMACPP_PEER={shlex.quote(cmd)}\n")
    return {**os.environ, "HOTSTART_PEERS": str(d), "FAKE_BODIES": str(tmp_path / "bodies.jsonl")}


def run(script: str, args: list[str], env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    return run_session([sys.executable, str(REPO / "benchmarks" / script), *args], timeout, env,
                       merge_stderr=True, cwd=REPO)


def bodies(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "bodies.jsonl").read_text().splitlines()]


def test_serve_bench_peers_force_length_their_way(tmp_path, default_model_dir):
    out = tmp_path / "serve.json"
    res = run("serve_bench.py", ["--model", str(default_model_dir), "--servers", "vllm,llamacpp", "--concurrency",
                                 "1,2", "--rounds", "1", "--max-tokens", "6", "--max-load", "100", "--noise-cores", "99",
                                 "--retries", "0", "--max-wait", "0", "--out", str(out)], peers_env(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:]
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["vLLM", "llama.cpp"]
    llama = data["results"]["llama.cpp"]
    assert llama["weights"] == "GGUF" and "--n_threads" in llama["argv"]
    assert data["results"]["vLLM"]["argv"][-2:] == ["--dtype", "auto"]
    for name, r in data["results"].items():
        assert r["levels"]["2"]["median"]["all_full_length"], name
        assert r["levels"]["2"]["median"]["ttft_p99"] is not None
    sent = bodies(tmp_path)
    vllm_bodies = [b for b in sent if b.get("ignore_eos")]
    llama_bodies = [b for b in sent if "logit_bias" in b]
    assert vllm_bodies and all(b["min_tokens"] == b["max_tokens"] and b["model"] == "fake-model" for b in vllm_bodies)
    assert llama_bodies and all(b["min_tokens"] == 6 and "ignore_eos" not in b for b in llama_bodies)
    assert set(llama_bodies[0]["logit_bias"]) == {"0", "2"}  # SmolLM2: <|endoftext|>, <|im_end|> (= eos)
    assert "| 2 | llama.cpp | GGUF |" in "\n".join(data["table"])


def test_serve_bench_ratio_table():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import serve_bench

    def res(kind, tps, ttft):
        m = {"ttft_p50": ttft, "ttft_p99": ttft * 2, "decode_tps_p50": tps / 4, "total_tps": tps,
             "all_full_length": True}
        return {"kind": kind, "weights": "bf16", "levels": {"4": {"median": m}}}

    results = {"hotstart[off]": res("hotstart", 40.0, 0.5), "hotstart[auto]": res("hotstart", 60.0, 0.4),
               "vLLM": res("vllm", 30.0, 1.0), "llama.cpp": res("llamacpp", 20.0, 2.0)}
    text = "\n".join(serve_bench.print_table(results, [4]))
    assert "| 4 | hotstart[auto] | bf16 | 0.40 | 0.80 | 15.0 | 60.0 | yes |" in text
    assert "| streams | hotstart | tok/s / vLLM | TTFT p50 / vLLM | tok/s / llama.cpp | TTFT p50 / llama.cpp |" in text
    assert "| 4 | hotstart[off] | 1.33x | 0.50x | 2.00x | 0.25x |" in text


def test_over_time_retries_until_the_server_answers(tmp_path, default_model_dir):
    out = tmp_path / "ot"
    res = run("over_time.py", ["--model", str(default_model_dir), "--servers", "llamacpp", "--streams", "3",
                               "--duration", "4", "--window", "1", "--max-tokens", "5", "--max-load", "100",
                               "--out", str(out)], peers_env(tmp_path, delay=1.5))
    assert res.returncode == 0, res.stdout[-3000:]
    r = json.loads((out / "over_time.json").read_text())["results"]["llamacpp"]
    assert r["first_answer_s"] >= 1.5 and r["health_path"] == "/v1/models" and r["health_s"] >= 1.5
    assert [w["t0"] for w in r["windows"]] == [0, 1, 2, 3]
    assert r["windows"][0]["tps"] == 0 and r["windows"][3]["tps"] > 0
    assert r["requests_answered"] >= 3 and r["stop"]["leftover"] == []
    assert (out / "over_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
