"""The Ray Serve application: `serve run hotstart.ray:app model=...`, a config file's `import_path:
hotstart.ray:app`, or `serve.run(hotstart.ray.build(model=...))` from Python (ray/options.py lists the
arguments)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from hotstart.ray.options import parse
from hotstart.ray.replica import HotstartReplica

POLICY = "hotstart.ray.autoscale:policy"


def deployment_options(ray: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve's deployment options from ray/options.py's Ray keys."""
    actor: dict[str, Any] = {"num_cpus": ray["num_cpus"], "num_gpus": ray["num_gpus"]}
    if ray["memory"]:
        actor["memory"] = ray["memory"]
    if ray["resources"]:
        actor["resources"] = ray["resources"]
    out: dict[str, Any] = {
        "name": ray["name"],
        "ray_actor_options": actor,
        "max_ongoing_requests": ray["max_ongoing_requests"],
        "graceful_shutdown_timeout_s": ray["graceful_shutdown_timeout_s"],
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": ray["health_check_period_s"],
        "health_check_timeout_s": ray["health_check_timeout_s"],
    }
    if ray["max_replicas_per_node"]:
        out["max_replicas_per_node"] = ray["max_replicas_per_node"]
    if ray["num_replicas"] is not None:
        out["num_replicas"] = ray["num_replicas"]
        return out
    out["autoscaling_config"] = {
        "min_replicas": ray["min_replicas"],
        "max_replicas": ray["max_replicas"],
        "initial_replicas": ray["initial_replicas"],
        "target_ongoing_requests": ray["target_ongoing_requests"],
        "upscale_delay_s": ray["upscale_delay_s"],
        "downscale_delay_s": ray["downscale_delay_s"],
        "downscale_to_zero_delay_s": ray["downscale_to_zero_delay_s"],
        "look_back_period_s": ray["look_back_period_s"],
        "policy": {"policy_function": POLICY},
    }
    return out


def build(model: str | None = None, **kwargs: Any) -> Application:
    """The application for MODEL (None: the default model) with KWARGS (ray/options.py); ValueError if one is
    bad."""
    opts = parse({"model": model, **kwargs} if model is not None else kwargs)
    dep = serve.deployment(HotstartReplica, **deployment_options(opts.ray))
    keep = ("node_zygote", "startup_timeout_s", "graceful_shutdown_timeout_s")
    return dep.bind(opts.spec, {k: opts.ray[k] for k in keep})


def app(args: dict[str, Any] | None = None) -> Application:
    """Ray Serve's application builder: ARGS from `serve run hotstart.ray:app KEY=VALUE ...` or a config's
    `args`."""
    return build(**dict(args or {}))
