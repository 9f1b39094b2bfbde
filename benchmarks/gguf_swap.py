"""Swapping GGUF models: hotstart's many-models server against llama.cpp's router (issue 44's GGUF goal).

    python benchmarks/gguf_swap.py A.gguf B.gguf C.gguf --llama-server PATH [--rounds 3] [--out swap.json]

The same three GGUF files (copied into one folder, as llama.cpp's router wants them), two models loaded at
most on each server:
  hotstart      hotstart serve a=A b=B c=C --max-loaded-models 2 --keep-alive -1
  llama-server  llama-server --models-dir DIR --models-max 2 (router mode: a child server per model)
Per round, after a warm-up request to each model (page cache, tokenizer, the kernel library), requests go
to a, b, c, a, b, c: each one's model is not loaded (the least recently used one is evicted for it); the
seconds from sending a streamed 4-token completion to its first token are a swap. Servers alternate
first within a round. Medians and every sample are printed; --out writes them as JSON. A timing: run it
alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import httpx

from hotstart.bench.process import Server, free_port

ORDER = ("a", "b", "c", "a", "b", "c")


_CLIENT: list[httpx.Client] = []  # one for the run: a new client costs ~20 ms (its TLS context) per request


def first_token(url: str, model: str) -> float:
    if not _CLIENT:
        _CLIENT.append(httpx.Client(timeout=600))
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True}
    t = time.perf_counter()
    with _CLIENT[0].stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    return time.perf_counter() - t
    raise RuntimeError(f"{model}: no token in the stream")


def hotstart(files: dict[str, str]) -> Server:
    argv = [sys.executable, "-m", "hotstart", "serve", *(f"{k}={v}" for k, v in files.items()), "--port", "0",
            "--max-loaded-models", "2", "--keep-alive", "-1"]
    srv = Server.launch(argv, tag="hotstart", env=dict(os.environ))
    deadline = time.perf_counter() + 300
    srv.wait_url(deadline)
    srv.wait_healthy(deadline)
    return srv


def llama_router(exe: str, folder: str) -> Server:
    port = free_port()
    argv = [exe, "--models-dir", folder, "--models-max", "2", "--host", "127.0.0.1", "--port", str(port),
            "-c", "2048", "-t", str(os.cpu_count() or 1)]
    srv = Server.launch(argv, tag="llama-server", env=dict(os.environ), url=f"http://127.0.0.1:{port}")
    deadline = time.perf_counter() + 300
    srv.wait_url(deadline)
    while time.perf_counter() < deadline:  # the router answers /v1/models once it has listed the folder
        try:
            if httpx.get(f"{srv.url}/v1/models", timeout=5).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    srv.stop()
    raise RuntimeError("llama-server's router did not come up")


def router_ids(url: str, stems: dict[str, str]) -> dict[str, str]:
    """a/b/c -> the router's model id for that file (it lists the folder's files by name)."""
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    out = {}
    for key, stem in stems.items():
        match = [i for i in listed if stem in i]
        if len(match) != 1:
            raise RuntimeError(f"llama-server lists {listed}: no single id for {stem}")
        out[key] = match[0]
    return out


def one_round(name: str, srv: Server, ids: dict[str, str], out: dict[str, list]) -> None:
    for key in ("a", "b", "c"):
        first_token(srv.url, ids[key])  # warm-up: every file page-cached, every model seen once
    for key in ORDER:
        out[name].append(first_token(srv.url, ids[key]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("c")
    p.add_argument("--llama-server", required=True, help="the llama-server binary (router mode)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="gguf-swap-")
    files, stems = {}, {}
    try:
        for key in ("a", "b", "c"):
            src = getattr(args, key)
            stem = f"swap-{key}-{os.path.basename(src).removesuffix('.gguf')}"
            dst = os.path.join(folder, stem + ".gguf")
            shutil.copyfile(src, dst)
            files[key], stems[key] = dst, stem
        samples: dict[str, list[float]] = {"hotstart": [], "llama-server": []}
        for r in range(args.rounds):
            for name in (("hotstart", "llama-server") if r % 2 == 0 else ("llama-server", "hotstart")):
                srv = hotstart(files) if name == "hotstart" else llama_router(args.llama_server, folder)
                try:
                    ids = {k: k for k in files} if name == "hotstart" else router_ids(srv.url, stems)
                    one_round(name, srv, ids, samples)
                finally:
                    srv.stop()
                print(f"round {r + 1} {name}: " + " ".join(f"{x:.3f}" for x in samples[name][-len(ORDER):]),
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for k, v in samples.items():
        print(f"{k:13s} swap median {med[k]:.3f} s (min {min(v):.3f}, max {max(v):.3f}, n={len(v)})")
    ratio = med["hotstart"] / med["llama-server"]
    print(f"hotstart / llama-server: {ratio:.2f}x (goal <= 0.5: {'met' if ratio <= 0.5 else 'MISSED'}); "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "samples": samples, "median": med, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
