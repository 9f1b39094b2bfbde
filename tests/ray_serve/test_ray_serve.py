"""hotstart.ray on a real 3-node Ray cluster on loopback (tests/helpers/ray_cluster.py): the default model
behind Ray Serve's proxy, scaled from zero, up under load, back to zero, through the loss of a node, and
nothing left after `serve shutdown` and the cluster's stop. The tests run in this order on one cluster and
one application."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers.ray_cluster import LoopbackCluster, ray_unavailable
from helpers.server import serving

pytestmark = [pytest.mark.skipif(ray_unavailable() is not None, reason=str(ray_unavailable())),
              pytest.mark.xdist_group("ray")]

APP = "hs"
MODEL = "SmolLM2-135M-Instruct"
FLAGS = {"max_model_len": 512, "dtype": "float32"}  # float32: greedy tokens independent of the fast path
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0}


def replicas() -> dict:
    from ray import serve

    app = serve.status().applications.get(APP)
    return dict(app.deployments["hotstart"].replica_states) if app else {}


def wait_for(what, timeout: float, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := what()):
            return got
        time.sleep(every)
    return what()


def hotstart_procs(cluster) -> list:
    out = []
    for p in cluster.leftovers():
        try:
            cmd = " ".join(p.cmdline())
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
        if "-m hotstart." in cmd or "ServeReplica" in cmd or "NodeZygote" in cmd:
            out.append((p.pid, cmd[:100]))
    return out


@pytest.fixture(scope="module")
def direct(default_model_dir):
    """`hotstart serve` with the same flags, started first: its start overlaps the cluster's."""
    yield from serving("--max-model-len", "512", "--dtype", "float32", wait_ready=False)


@pytest.fixture(scope="module")
def cluster(direct):
    c = LoopbackCluster()
    try:
        c.start()
    except Exception as e:  # noqa: BLE001 - no Ray here: one line, not a failure of hotstart
        c.stop()
        pytest.skip(f"Ray cannot start a cluster here: {str(e).splitlines()[0] if str(e) else e!r}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def app(cluster):
    from ray import serve

    import hotstart.ray

    serve.run(hotstart.ray.build(min_replicas=0, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=0,
                                 downscale_delay_s=2, downscale_to_zero_delay_s=2, look_back_period_s=2,
                                 resources={"hotstart": 1}, **FLAGS),
              name=APP, route_prefix="/", blocking=False)
    assert wait_for(lambda: str(serve.status().applications[APP].status) == "ApplicationStatus.RUNNING", 60)
    return cluster.url


def test_scale_from_zero_on_a_request(cluster, app):
    assert replicas().get("RUNNING", 0) == 0
    t = time.monotonic()
    r = httpx.post(app + "/v1/chat/completions", json=CHAT, timeout=180)
    took = time.monotonic() - t
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert replicas().get("RUNNING") == 1
    phases = {p["name"]: p for p in httpx.get(app + "/startup", timeout=10).json()["phases"]}
    assert "engine ready" in phases and "first request served" in phases, phases
    print(f"scale from zero: first answer {took:.1f} s after the request; replica ready "
          f"{phases['engine ready']['end_s']:.1f} s after its constructor")
    # the replica is hotstart's API process: no torch in it (the engine runs in a process of its own)
    replica = [p for p in cluster.leftovers() if "ServeReplica" in " ".join(p.cmdline())]
    assert len(replica) == 1
    with open(f"/proc/{replica[0].pid}/maps") as f:
        assert "libtorch" not in f.read()


def test_answers_equal_hotstart_serve(app, direct):
    bodies = {
        "/v1/chat/completions": CHAT,
        "/v1/completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                            "temperature": 0},
        "/v1/responses": {"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 12,
                          "temperature": 0, "store": False},
    }
    stream = {**CHAT, "stream": True}
    bad = {**CHAT, "temperature": -1}

    def answers(url: str) -> dict:
        out = {}
        for path, body in bodies.items():
            r = httpx.post(url + path, json=body, timeout=120)
            assert r.status_code == 200, r.text
            out[path] = r.json()
        out["/v1/chat/completions"] = out["/v1/chat/completions"]["choices"][0]["message"]["content"]
        out["/v1/completions"] = out["/v1/completions"]["choices"][0]["text"]
        out["/v1/responses"] = out["/v1/responses"]["output"][0]["content"][0]["text"]
        with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=120) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]"
        out["stream"] = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                                for x in lines[:-1])
        out["models"] = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
        r = httpx.post(url + "/v1/chat/completions", json=bad, timeout=30)
        out["bad"] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"])
        return out

    via_ray = answers(app)
    assert wait_for(lambda: httpx.get(direct.url + "/health", timeout=5).status_code == 200, 120)
    assert via_ray == answers(direct.url)
    assert via_ray["stream"] == via_ray["/v1/chat/completions"] and via_ray["bad"][0] == 400


def test_scale_up_under_load(app):
    stop, codes = threading.Event(), []
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0}

    def client() -> None:
        while not stop.is_set():
            codes.append(httpx.post(app + "/v1/completions", json=body, timeout=180).status_code)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        reached = wait_for(lambda: replicas().get("RUNNING", 0) >= 2, 120)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert reached, replicas()
    assert codes and set(codes) == {200}, codes


def test_scale_to_zero_when_idle(cluster, app):
    idle = wait_for(lambda: replicas().get("RUNNING", 0) == 0 and not replicas().get("STOPPING"), 90)
    assert idle, replicas()
    # each node that ran a replica keeps a zygote for the next one (and no engine, no forkserver)
    left = hotstart_procs(cluster)
    assert any("hotstart.forkserver.zygote" in cmd for _, cmd in left), left
    assert all("zygote" in cmd or "NodeZygote" in cmd for _, cmd in left), left


def test_node_killed_mid_stream(cluster, app):
    from hotstart.procs import descendants

    def has_replica(node) -> bool:
        import psutil

        for pid in descendants(node.all_processes["raylet"][0].process.pid):
            try:
                if "ServeReplica" in " ".join(psutil.Process(pid).cmdline()):
                    return True
            except psutil.Error:
                pass
        return False

    lines, errors = [], []
    # as long as the fixture's context allows (512): it has to outlast the waits below (the kill ends it)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 500, "ignore_eos": True,
            "temperature": 0, "stream": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", app + "/v1/completions", json=body, timeout=120) as resp:
                lines.extend(x for x in resp.iter_lines() if x)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(repr(e))

    # the stream is the request that scales from zero again: while it runs, its replica is the only one (an
    # earlier request's replica could be scaled down meanwhile and another started on the other node)
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert wait_for(lambda: len(lines) >= 3 or not t.is_alive(), 180)
    assert t.is_alive() and not errors, (lines, errors)
    # through Ray's proxy to the replica that is streaming, on a machine that may be busy with other tests
    asked = time.monotonic()
    phases = {p["name"]: p for p in httpx.get(app + "/startup", timeout=90).json()["phases"]}
    print(f"/startup answered in {time.monotonic() - asked:.2f} s beside the stream")
    # the node's zygote (no torch import on this start), where that node ran a replica before: the
    # scheduler may place this one on a node that never did (then it has none yet, and says so)
    if "zygote used" not in phases:
        assert phases["zygote not used"]["detail"].startswith("none running"), phases["zygote not used"]
    # a replica the scale from zero started beside this one can still be stopping (Serve reported
    # {'STOPPING': 1, 'RUNNING': 1} here on a loaded machine): wait until one node holds a replica
    def serving_nodes() -> list:
        return [n for n in cluster.nodes if has_replica(n)]

    waited = time.monotonic()
    wait_for(lambda: not replicas().get("STOPPING") and len(serving_nodes()) == 1, 30)
    serving = serving_nodes()
    print(f"one node serving after {time.monotonic() - waited:.2f} s, {len(lines)} lines streamed")
    assert len(serving) == 1, (replicas(), [n.node_id for n in serving])
    assert t.is_alive(), "the stream ended before the node's kill"
    cluster.kill_node(serving[0])
    killed = time.monotonic()
    t.join(60)
    assert not t.is_alive() and not errors, (errors, len(lines), replicas())
    print(f"stream ended {time.monotonic() - killed:.2f} s after the node's kill, {len(lines)} lines")
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    t = time.monotonic()
    r = httpx.post(app + "/v1/chat/completions", json=CHAT, timeout=180)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    print(f"next request answered {time.monotonic() - t:.1f} s later, on the other node")


def test_replica_logs_are_ray_s(cluster):
    import glob

    logs = glob.glob(f"{cluster.tmp}/**/logs/serve/replica_{APP}_hotstart_*.log", recursive=True)
    assert logs, sorted(glob.glob(f"{cluster.tmp}/**/logs/serve/*", recursive=True))[:20]
    text = "".join(open(f, errors="replace").read() for f in logs)
    assert "hotstart: replica" in text and "ready in" in text, logs


def test_nothing_left_after_serve_shutdown_and_cluster_stop(cluster):
    from ray import serve

    serve.shutdown()
    left = wait_for(lambda: not hotstart_procs(cluster), 30) or hotstart_procs(cluster)
    assert left is True, left  # no replica, forkserver, engine or zygote once Serve is shut down
    assert cluster.stop() == []
