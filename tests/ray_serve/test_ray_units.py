"""hotstart.ray's parts that need no cluster: the application's arguments, Ray's deployment options, the
autoscaling policy's arithmetic, the proxy's OpenAI-shaped errors (pure ASGI), and the import boundaries."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO
from helpers.ray_cluster import ray_unavailable

from hotstart.ray.options import parse
from hotstart.ray.proxy import OpenAIErrors


def test_arguments_are_hotstart_serve_s_flags_and_ray_s_options():
    opts = parse({"model": "small=/models/x", "max-model-len": "1024", "prefetch": "false", "api_key": "k",
                  "served_model_name": ["a", "b"], "enable_prefix_caching": False, "min_replicas": "0",
                  "max_replicas": 4, "resources": '{"hotstart": 1}', "node_zygote": "off"})
    assert opts.spec.model == "small=/models/x"
    assert opts.spec.engine["max_model_len"] == 1024 and opts.spec.engine["enable_prefix_caching"] is False
    assert opts.spec.serve.prefetch is False and opts.spec.serve.api_key == "k"
    assert opts.spec.serve.served_model_name == ("a", "b")
    assert (opts.ray["min_replicas"], opts.ray["max_replicas"]) == (0, 4)
    assert opts.ray["resources"] == {"hotstart": 1} and opts.ray["node_zygote"] is False
    assert opts.ray["max_ongoing_requests"] == 2 * opts.spec.engine["max_num_seqs"]
    assert opts.ray["graceful_shutdown_timeout_s"] == opts.spec.serve.shutdown_timeout
    defaults = parse({})
    assert defaults.spec.model is None
    assert (defaults.ray["min_replicas"], defaults.ray["max_replicas"]) == (1, 1)


@pytest.mark.parametrize("args, words", [
    ({"bogus": 1}, "unknown argument 'bogus'"),
    ({"port": 8000}, "unknown argument 'port'"),
    ({"max_model_len": "x"}, "--max-model-len"),
    ({"dtype": "int3"}, "--dtype"),
    ({"min_replicas": -1}, "min_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "below min_replicas"),
    ({"prefetch": "maybe"}, "prefetch"),
    ({"resources": '{"a": "b"}'}, "resources"),
    ({"model": ["a", "b"]}, "one model per application"),
])
def test_bad_arguments_are_one_clear_error(args, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse(args)


@pytest.mark.skipif(ray_unavailable() is not None, reason=str(ray_unavailable()))
def test_deployment_options_follow_ray_s_names():
    from hotstart.ray.builder import POLICY, deployment_options

    d = deployment_options(parse({"min_replicas": 0, "max_replicas": 3, "num_cpus": 4, "resources":
                                  {"hotstart": 1}, "downscale_to_zero_delay_s": 30}).ray)
    assert d["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 0.0, "resources": {"hotstart": 1}}
    auto = d["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["downscale_to_zero_delay_s"]) == (0, 3, 30.0)
    assert auto["policy"] == {"policy_function": POLICY}
    fixed = deployment_options(parse({"num_replicas": 2}).ray)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def _ctx(running=(), waiting=(), http=(), ray_running=0.0, queued=0.0, target=4):
    m = {"hotstart_running": dict(enumerate(running)), "hotstart_waiting": dict(enumerate(waiting)),
         "hotstart_http_in_flight": dict(enumerate(http))}
    return SimpleNamespace(aggregated_metrics=m, total_running_requests=ray_running,
                           total_queued_requests=queued,
                           config=SimpleNamespace(target_ongoing_requests=target))


@pytest.mark.parametrize("ctx, want", [
    (_ctx(), 0.0),  # idle: to zero (Ray applies min_replicas and the delay)
    (_ctx(running=[4, 4]), 2.0),
    (_ctx(running=[4, 4], waiting=[3, 0]), 3.0),  # the engine's queue counts: the batch is full
    (_ctx(queued=1), 1.0),  # at zero replicas: the request Ray holds
    (_ctx(running=[0], http=[2]), 1.0),  # a stream's last bytes still on its way out
    (_ctx(ray_running=9), 3.0),  # Ray's own count when hotstart's lags behind
])
def test_policy_counts_running_waiting_and_held_requests(ctx, want):
    from hotstart.ray.autoscale import policy

    assert policy(ctx) == (want, {})


def _run(inner, path="/v1/chat/completions"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(OpenAIErrors(inner)({"type": "http", "path": path, "method": "POST"}, receive, send))
    return sent


def test_proxy_ends_a_cut_stream_with_an_error_event_and_done():
    async def dies_mid_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise RuntimeError("ActorDiedError")  # Ray's proxy: the replica is gone

    sent = _run(dies_mid_stream)
    last = sent[-1]
    assert last["more_body"] is False and last["body"].endswith(b"data: [DONE]\n\n")
    event = json.loads(last["body"].split(b"\n\n")[0][6:])
    assert event["error"]["code"] == "replica_unavailable"


def test_proxy_answers_an_unanswered_request_503_openai_shaped():
    async def nothing(scope, receive, send):
        return None

    start, body = _run(nothing)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "replica_unavailable"


def test_proxy_rewrites_ray_s_plain_text_errors_and_passes_the_rest():
    async def plain(scope, receive, send):
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Deployment unavailable", "more_body": False})

    start, body = _run(plain)
    assert start["status"] == 503
    assert json.loads(body["body"])["error"] == {"message": "Deployment unavailable", "type": "server_error",
                                                "param": None, "code": "service_unavailable"}
    assert _run(plain, path="/other/app")[1]["body"] == b"Deployment unavailable"  # not an OpenAI path

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {}}', "more_body": False})

    assert _run(ok)[1]["body"] == b'{"error": {}}'  # hotstart's own errors untouched


def test_neither_the_cli_nor_the_api_path_imports_ray():
    code = ("import sys, hotstart.cli, hotstart.server.launch, hotstart.server.routes, hotstart.ray.proxy; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(ray_unavailable() is not None, reason=str(ray_unavailable()))
def test_serve_run_finds_the_builder_and_passes_its_arguments():
    """What `serve run hotstart.ray:app KEY=VALUE ...` does: import the attribute, call it with strings."""
    from ray._common.utils import import_attr
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as call

    builder = import_attr("hotstart.ray:app")
    assert isinstance(call(builder, {"model": "x", "min_replicas": "0", "max_replicas": "2"}), Application)
    with pytest.raises(ValueError, match="--max-model-len"):
        call(builder, {"max_model_len": "no"})
