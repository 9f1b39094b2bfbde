"""`hotstart bench startup`: the real harness on the default model, servers that fail in every way, and
named peers (a stdlib fake server stands in for vLLM / llama.cpp: no peer install needed).

Each test runs the CLI in its own session with a hard timeout and checks (/proc) that no process
of any launched group survives. Bounded: ~40-70 s in all on 2 cores.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import run_session

from hotstart.procs import alive, group_pids

REPO = Path(__file__).resolve().parents[2]


def bench(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_session([sys.executable, "-m", "hotstart", "bench", "startup", *args], timeout,
                       {**os.environ, **(env or {})}, cwd=REPO)


def assert_groups_gone(data: dict) -> None:
    pgids = {r["stop"]["pgid"] for r in data["runs"] if "stop" in r}
    for r in data["runs"]:
        assert r.get("stop", {}).get("leftover", []) == [], r
    left = [p for g in pgids for p in group_pids(g) if alive(p)]
    assert not left, f"processes left in groups {pgids}: {left}"


@pytest.mark.e2e
def test_default_model_cold_weights(tmp_path, default_model_dir):
    # A private copy: a server someone else runs on the default model maps its weights, and mapped
    # pages cannot be evicted, which would make "cold" untestable here.
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    out = tmp_path / "out"
    t = time.monotonic()
    res = bench([str(model), "--config", "hotstart", "--cold", "weights", "--runs", "1", "--warmup", "0",
                 "--max-tokens", "4", "--timeout", "90", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    (run,) = data["runs"]
    assert run["ok"], run
    assert run["residency"]["weights"] < 2.0, run  # evicted right before launch
    assert 0 < run["t_health"] <= run["t_first"] < time.monotonic() - t
    assert run["answer"].strip()
    assert run["timeline"]["phases"], "hotstart's /startup timeline is kept"
    whats = {f["what"]: f for f in data["floor"]}
    assert whats["import_torch"]["ok"] and whats["import_torch"]["seconds"] > 0
    assert whats["read_weights"]["bytes"] >= data["meta"]["weights_bytes"] * 0.99
    assert whats["read_weights"]["residency"]["weights"] < 2.0
    # the start's two imports alone, timed in-process: less than the whole interpreter's run
    for what in ("import_engine", "import_web"):
        assert whats[what]["ok"] and 0 < whats[what]["seconds"] < whats[what]["wall"], whats[what]
    assert_groups_gone(data)
    table = (out / "table.md").read_text()
    assert "| weights | hotstart | 1/1 |" in table and "floor: import torch" in table
    # imports in the start vs alone, from the timeline: "| weights | hotstart | 1.23 | 0.98 | 1.26x | ..."
    row = next(line for line in table.splitlines() if line.startswith("| weights | hotstart | ")
               and line.count("x |") == 2)
    assert all(float(c.rstrip("x")) > 0 for c in row.strip("| ").split(" | ")[2:]), row
    assert (out / "startup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hotstart" in res.stderr and "health" in res.stderr  # progress lines


def test_failing_peers_are_reported_not_hung(tmp_path):
    """A server that exits at once, one that never answers /health with 200, one that never listens."""
    out = tmp_path / "out"
    py = sys.executable
    t = time.monotonic()
    res = bench(["--peer", f"{py} -c 'import sys; sys.stderr.write(\"boom\\n\"); sys.exit(3)' {{port}}",
                 "--peer", f"{py} -m http.server --bind 127.0.0.1 {{port}}",
                 "--peer", "sleep 600 {port}",
                 "--cold", "none", "--runs", "1", "--warmup", "0", "--timeout", "3", "--no-floor",
                 "--out", str(out)], timeout=60)
    assert time.monotonic() - t < 40
    assert res.returncode == 1, res.stderr
    data = json.loads((out / "results.json").read_text())
    runs = {r["config"]: r for r in data["runs"]}
    assert [r["ok"] for r in runs.values()] == [False, False, False]
    crashed = runs[next(k for k in runs if k.startswith("python") and "http" not in k)]
    assert "exited with code 3" in crashed["error"] and "boom" in crashed["stderr_tail"]
    assert "within 3 s" in runs["python -m http.server"]["error"]
    assert "within 3 s" in runs["sleep"]["error"]
    assert "FAILED" in res.stdout
    assert_groups_gone(data)


def test_interrupt_stops_the_server_and_keeps_results(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hotstart",
        "bench",
        "startup",
        "--peer",
        "sleep 600 {port}",
        "--cold",
        "none",
        "--runs",
        "3",
        "--warmup",
        "0",
        "--timeout",
        "1",
        "--no-floor",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait for the first (failed) run, then interrupt the second
            if (out / "results.json").is_file() and json.loads((out / "results.json").read_text())["runs"]:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["interrupted"] and len(data["runs"]) >= 2
    assert data["runs"][-1].get("interrupted"), data["runs"][-1]  # the run in flight is on record too
    assert_groups_gone(data)


def test_bad_arguments_are_one_line_errors(tmp_path):
    cases = [(["--config", "hotstart:turbo"], "unknown variant 'turbo'"),
             (["--config", "vllm"], "must be hotstart"),
             (["--peer", "transformers serve"], "must contain {port}"),
             (["--runs", "0"], "--runs must be >= 1")]
    for args, message in cases:
        res = bench([*args, "--out", str(tmp_path / "o")], timeout=60)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, res.stderr)


def test_bench_help_does_not_import_torch():
    code = ("import sys\nfrom hotstart.cli import build_parser\n"
            "for a in (['bench', 'startup', '--help'], ['make-model', '--help'], ['bench', '--help']):\n"
            "    try: build_parser().parse_args(a)\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr


# A stand-in OpenAI server (stdlib): argv = port, answer, "health" or "no-health" (404 like llama.cpp's),
# model. The answer may name @model (its last argument) and @cache (VLLM_CACHE_ROOT as the server saw it).
FAKE_PEER = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, answer, health, model = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if os.environ.get("FAKE_COMPILE"):  # like vLLM without a cache entry: it writes its compile cache
    d = os.path.join(os.environ["VLLM_CACHE_ROOT"], "torch_compile_cache")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, str(os.getpid())), "w").close()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, code, obj):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        if self.path == "/health" and health == "health": return self.send(200, {})
        if self.path == "/v1/models": return self.send(200, {"data": [{"id": model}]})
        self.send(404, {})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        text = answer.replace("@model", model).replace("@cache", os.environ.get("VLLM_CACHE_ROOT", "-"))
        self.send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_peer(
    tmp_path: Path, answer: str, health: str = "health", model: str = "{model}", env: str = ""
) -> str:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    return f"{env} {sys.executable} {script} {{port}} {shlex.quote(answer)} {health} {model}".strip()


def test_named_peers_from_commands_env(tmp_path):
    """--peers reads commands.env; names, {gguf} / --peer-model, /health 404 -> /v1/models, the vLLM first
    start with an empty cache root (removed after), answers recorded, --expect for hotstart only."""
    peers_dir = tmp_path / "peers"
    peers_dir.mkdir()
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"\0" * 4096)
    vcache = tmp_path / "vllm-cache"
    vllm = fake_peer(
        tmp_path, "Lyon cache=@cache", env=f"LD_PRELOAD={lib} VLLM_CACHE_ROOT={vcache} FAKE_COMPILE=1"
    )
    llama = fake_peer(tmp_path, "Nice @model", health="no-health", model="{gguf}")
    (peers_dir / "commands.env").write_text(
        f"# written by a test\nVLLM_PEER={shlex.quote(vllm)}\nLLAMACPP_PEER={shlex.quote(llama)}\n")
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8188)
    out = tmp_path / "out"
    res = bench(
        [
            "--peers",
            "vllm,llamacpp",
            "--peer",
            fake_peer(tmp_path, "Marseille @model"),
            "--peer-name",
            "My peer",
            "--peer-model",
            f"My peer={gguf}",
            "--vllm-first-start",
            "--expect",
            "Paris",
            "--cold",
            "weights",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--no-floor",
            "--timeout",
            "30",
            "--timeout",
            "vllm=40",
            "--out",
            str(out),
        ],
        timeout=90,
        env={"HOTSTART_PEERS": str(peers_dir)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    runs = {r["config"]: r for r in data["runs"]}
    assert list(runs) == ["vLLM", "llama.cpp", "My peer", "vLLM (first start)"]
    assert all(r["ok"] for r in runs.values()), runs
    from hotstart.boot.default_model import find_gguf

    assert runs["llama.cpp"]["answer"] == f"Nice {find_gguf()}"  # {gguf}
    assert runs["llama.cpp"]["health_path"] == "/v1/models"  # its /health is 404
    assert runs["My peer"]["answer"] == f"Marseille {gguf}"  # --peer-model
    first = runs["vLLM (first start)"]
    assert (
        first["answer"] == f"Lyon cache={first['vllm_cache_root']}"
        and "first-start" in first["vllm_cache_root"]
    )
    assert not Path(first["vllm_cache_root"]).exists()  # removed after the run
    assert runs["vLLM"]["answer"] != first["answer"]
    configs = {c["label"]: c for c in data["meta"]["configs"]}
    assert configs["vLLM"]["timeout"] == 40 and configs["llama.cpp"]["timeout"] == 30
    assert configs["vLLM"]["env"]["LD_PRELOAD"] == str(lib)
    assert data["meta"]["vllm_compile_cache"] == {"path": str(vcache / "torch_compile_cache"), "files": 0,
                                                  "warm": False}
    assert runs["vLLM"]["vllm_cache_added"] == 1 and "vllm_cache_added" not in first  # its own empty root
    assert data["meta"]["vllm_compile_cache_after"]["files"] == 1
    assert configs["vLLM"]["expect"] is None  # --expect Paris is hotstart's check only
    assert os.path.realpath(gguf) in data["meta"]["peer_weights"]
    # the default model is served from the GGUF llama.cpp reads: evicted once, as hotstart's weights
    assert os.path.realpath(find_gguf()) in data["meta"]["weights"] + data["meta"]["peer_weights"]
    assert set(runs["My peer"]["residency"]) == {"weights", "peer_weights"}
    assert data["answers"]["My peer"] == {"runs": 1, "answers": {f"Marseille {gguf}": 1}}
    table = (out / "table.md").read_text()
    assert "vLLM compile cache warm: no (0 files" in table and "compiled anyway" in table
    assert "first / vLLM" in table and "first / llama.cpp" in table
    assert "| weights | vLLM (first start) | 1/1 |" in table and "- llama.cpp (1 runs): 'Nice " in table
    assert_groups_gone(data)


def test_peer_expectation_and_wrong_answer_recorded(tmp_path):
    out = tmp_path / "out"
    res = bench(["--peer", fake_peer(tmp_path, "Lyon"), "--peer-name", "fake", "--expect-peers", "Paris",
                 "--cold", "none", "--runs", "1", "--warmup", "0", "--no-floor", "--timeout", "20",
                 "--out", str(out)], timeout=60)
    assert res.returncode == 1, res.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert not run["ok"] and run["answer"] == "Lyon" and "does not contain 'Paris'" in run["error"]


def test_commands_env_reader_and_not_set_up(tmp_path, monkeypatch):
    from hotstart.bench import peers
    from hotstart.errors import HotstartError

    f = tmp_path / "commands.env"
    llama = "python -m llama_cpp.server --model '/a b/m.gguf' --port {port}"
    f.write_text(
        f"# comment\n\nVLLM_PEER='LD_PRELOAD=/x/lib.so vllm-nowhere serve {{model}} --port {{port}}'\n"
        f"LLAMACPP_PEER={shlex.quote(llama)}\nnot a line\n"
    )
    cmds = peers.read_commands_env(f)
    assert cmds["VLLM_PEER"] == "LD_PRELOAD=/x/lib.so vllm-nowhere serve {model} --port {port}"
    assert peers.split_command(cmds["LLAMACPP_PEER"], "x")[1][4] == "/a b/m.gguf"
    monkeypatch.setenv("HOTSTART_PEERS", str(tmp_path / "none"))
    with pytest.raises(HotstartError, match="make peers"):
        peers.known_peer("vllm")
    monkeypatch.setenv("HOTSTART_PEERS", str(tmp_path))
    for key, why in (("transformers", "no TRANSFORMERS_PEER"), ("vllm", "vllm-nowhere not found"),
                     ("sglang", "unknown peer")):
        with pytest.raises(HotstartError, match=why):
            peers.known_peer(key)
    res = bench(["--peers", "transformers", "--out", str(tmp_path / "o")], timeout=60,
                env={"HOTSTART_PEERS": str(tmp_path)})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "not set up" in res.stderr and "make peers" in res.stderr
    assert peers.parse_timeouts(["60", "vLLM=500"]) == (60.0, {"vllm": 500.0})
    assert peers.timeout_for("vLLM (first start)", "vllm", True, 60.0, {}) == peers.VLLM_TIMEOUT_S
    assert peers.timeout_for("vLLM (first start)", "vllm", True, 60.0, {"vllm": 90.0}) == 90.0


def test_cold_sets_per_peer_environment(tmp_path):
    """A peer's interpreter folders, its LD_PRELOAD library and executable are evicted in `all`, a kept
    folder never is; which folders each config needs is recorded."""
    from hotstart.bench import evict as ev
    from hotstart.bench import peers

    lib, src, kept = tmp_path / "libx.so", tmp_path / "src", tmp_path / "src" / "cache"
    lib.write_bytes(b"x")
    kept.mkdir(parents=True)
    (src / "a.py").write_text("a")
    (kept / "graph.bin").write_text("b")
    words = [sys.executable, "-m", "http.server"]
    files = peers.program_files(words, {"LD_PRELOAD": f"{lib}:/nonexistent.so"})
    assert files == [str(lib), os.path.realpath(sys.executable)]
    cold = ev.build_cold_sets([], {"peer": (ev.python_of(words[0]), [str(src)], files)}, keep=[str(kept)])
    assert os.path.realpath(lib) in cold.env.paths and os.path.realpath(src / "a.py") in cold.env.paths
    assert os.path.realpath(kept / "graph.bin") not in cold.env.paths and cold.kept == [
        os.path.realpath(kept)
    ]
    dirs = cold.per_config["peer"]["dirs"]
    assert os.path.realpath(src) in dirs and any(d.endswith("site-packages") for d in dirs)
    assert peers.is_vllm(["/p/bin/vllm", "serve"]) and peers.is_vllm(["python", "-m", "vllm.entrypoints.cli"])
    assert not peers.is_vllm(["python", "-m", "llama_cpp.server"])


def test_report_start_cost_and_ratios():
    """The start's own cost per run (t_first - t_repeat), against the floor of the same round, and
    every config against the first one and each peer."""
    from hotstart.bench import report

    def run(cfg, rnd, first, repeat):
        return {
            "config": cfg,
            "mode": "all",
            "round": rnd,
            "warmup": False,
            "ok": True,
            "t_health": first - 0.5,
            "t_first": first,
            "t_repeat": repeat,
            "answer": "Paris" if cfg == "hotstart" else "Lyon",
        }

    floors = [{"what": w, "mode": "all", "round": r, "warmup": False, "ok": True, "seconds": s}
              for r, (imp, read) in enumerate([(2.0, 0.5), (2.2, 0.4), (1.8, 0.3)])
              for w, s in (("import_torch", imp), ("read_weights", read))]
    configs = [{"label": "hotstart", "kind": "hotstart"}, {"label": "vLLM", "kind": "peer"},
               {"label": "llama.cpp", "kind": "peer"}]
    data = {"meta": {"modes": ["all"], "configs": configs,
                     "vllm_compile_cache": {"path": "/c/torch_compile_cache", "files": 53, "warm": True}},
            "runs": [run("hotstart", 0, 2.6, 0.4), run("hotstart", 1, 3.0, 0.5), run("hotstart", 2, 2.4, 0.4),
                     *(run("vLLM", r, 60.0 + r, 1.0) for r in range(3)),
                     *(run("llama.cpp", r, 4.0, 0.2) for r in range(3))],
            "floor": floors}
    rows = {r["config"]: r for r in report.summarize(data)}
    hot = rows["hotstart"]
    assert hot["start_cost"]["median"] == pytest.approx(2.2)  # 2.2, 2.5, 2.0
    assert hot["cost_x_floor"] == pytest.approx(2.0 / 1.8)  # per round: 2.2/2.0, 2.5/2.2, 2.0/1.8
    assert hot["x_peers"]["vLLM"] == pytest.approx(2.6 / 61.0) and hot["x_peers"][
        "llama.cpp"
    ] == pytest.approx(0.65)
    assert rows["vLLM"]["x_first_config"] == pytest.approx(61.0 / 2.6)
    text = report.format_table(report.summarize(data), data)
    assert "vLLM compile cache warm: yes (53 files" in text
    assert "| all | hotstart | 3/3 | 2.10 |" in text  # health median
    assert "| all | hotstart | 1.11x | yes | 1.00x | 1.30x | 0.04x | 0.65x |" in text
    assert "| all | vLLM | 29.50x | no |" in text  # per round 59/2.0, 60/2.2, 61/1.8
    assert "- hotstart (3 runs): 'Paris' x3" in text and "- vLLM (3 runs): 'Lyon' x3" in text
