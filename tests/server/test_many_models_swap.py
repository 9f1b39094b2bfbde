"""Many models, round 2 (issue 44), end to end on one server of real random-weight models (written by
`hotstart make-model`), engines forked on demand, real HTTP: a pinned model, an alias, eviction by the
memory budget, a stream on one model that keeps coming while two others load, the prefix cache that
survives an unload (blocks on disk, read back, the same greedy answer), and nothing left after SIGTERM."""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import time

import httpx
import psutil
from helpers.server import Server, Stream

from hotstart.bench.prometheus import metric_values
from hotstart.server.multi_launch import estimate_cost

KV = 8 << 20  # 8,192 tokens of the tiny model
ENGINE = ["--max-model-len", "2048", "--max-num-seqs", "4", "--dtype", "float32", "--zygote", "off",
          "--kv-cache-memory", str(KV), "--prefix-cache-disk", "64M"]
LONG = " ".join(random.Random(7).choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(90))


def cards(server: Server) -> dict[str, dict]:
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def complete(server: Server, model: str, prompt: str = "Once upon a time") -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def metric(server: Server, name: str, model: str) -> float:
    return metric_values(httpx.get(server.url + "/metrics", timeout=30).text, name).get(model, 0.0)


def test_pins_aliases_memory_a_stream_through_loads_and_the_prefix_cache_across_an_unload(tmp_path):
    one = tmp_path / "m1"
    done = subprocess.run([sys.executable, "-m", "hotstart", "make-model", "--family", "qwen2", "--size",
                           "tiny", "--dtype", "float32", "--out", str(one)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("m2", "m3"):  # the same weights under other names: other snapshots, other engines
        shutil.copytree(one, tmp_path / name)
    ns = argparse.Namespace(max_num_seqs=4, max_model_len=2048, kv_cache_memory=KV)
    cost = sum(estimate_cost(one, ns, 1 << 40, 3))
    budget = 2 * cost + cost // 2  # room for two models, not three (--max-loaded-models allows three)
    server = Server(*(f"m{i}={tmp_path / f'm{i}'}" for i in (1, 2, 3)), "--pin", "m1", "--alias", "fast=m2",
                    "--max-loaded-models", "3", "--models-memory", str(budget), "--keep-alive", "-1", *ENGINE,
                    env={"HOTSTART_KV_DIR": str(tmp_path / "kv")})
    try:
        m = cards(server)  # /health was 200: the pinned model is loaded
        assert (m["m1"]["state"], m["m1"]["pinned"], m["m2"]["state"]) == ("loaded", True, "unloaded")
        assert m["m2"]["aliases"] == ["fast"] and m["fast"]["root"] == "m2" and m["m1"]["resident_bytes"] > 0
        assert m["m1"]["memory_bytes"] == cost

        stream = Stream(server.url, {"model": "m1", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                                     "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        stream.start()
        assert stream.started.wait(60) and stream.is_alive(), stream.error
        t_load = time.perf_counter()
        first = complete(server, "fast", LONG)  # loads m2 beside the stream
        assert first["model"] == "m2"
        complete(server, "m3")  # no memory left for three: m2 (idle, least recently used) goes, m1 is pinned
        t_loaded = time.perf_counter()
        assert stream.is_alive(), "the stream ended before the loads did: make it longer"
        m = cards(server)
        states = {k: m[k]["state"] for k in ("m1", "m2", "m3")}
        assert states == {"m1": "loaded", "m2": "unloaded", "m3": "loaded"}
        assert metric(server, "hotstart_model_evictions", "m2") == 1 and m["m2"]["prefix_blocks_on_disk"] >= 5
        # the stream kept coming while both loaded: a long pause would be a gap as long as a load
        inside = [t for t in stream.times if t_load <= t <= t_loaded]
        before = [b - a for a, b in zip(stream.times, stream.times[1:]) if b <= t_load]
        gaps = [b - a for a, b in zip(inside, inside[1:])]
        assert len(inside) >= 5 and gaps, (len(inside), t_loaded - t_load)
        bound = max(1.0, 8 * statistics.median(before))
        assert max(gaps) <= bound, f"longest gap {max(gaps):.2f} s while loading, bound {bound:.2f} s"

        again = complete(server, "fast", LONG)  # m2 again (m3 evicted): its prefix read back from disk
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(server, "hotstart_prefix_cache_disk_restored_blocks_total", "m2") >= 5
        stream.halt.set()  # hang up: the server aborts it
        stream.join(60)
        assert stream.error is None and not any("error" in line for line in stream.lines)
        engines = [e.pid for fs in psutil.Process(server.proc.pid).children() for e in fs.children()]
        assert len(engines) == 2
    finally:
        server.stop(timeout=30)  # SIGTERM: it must end every engine itself (asserted)
    assert not [p for p in engines if psutil.pid_exists(p)]
    assert not list((tmp_path / "kv").glob("*/*/.*.tmp"))
