"""The Ray application's arguments (stdlib only: no ray, no torch): what `serve run hotstart.ray:app
KEY=VALUE ...`, a config file's `args:` and `hotstart.ray.build(...)` accept, read into hotstart's own
configs and Ray's deployment options.

  model=MODEL                one model, as `hotstart serve MODEL` takes it (NAME=PATH names it); none: the
  default any `hotstart serve` flag  by its name, - or _ (max_model_len=1024, api_key=..., prefetch=false):
  read by the
                             same flags as the CLI's (hotstart/flags.py), so they are checked the same way
  Ray's own                  RAY_KEYS below: replicas, autoscaling, resources, shutdown, health checks

Values may be strings (the command line's) or Python values; a bad one is a ValueError naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hotstart.config import EngineConfig, ServeConfig, serial_baseline
from hotstart.flags import add_options, values

# Ray's options and their defaults. target_ongoing_requests is per replica, counted in hotstart's own terms:
# the engine's running + waiting requests plus those Ray holds before any replica took them
# (ray/autoscale.py).
RAY_DEFAULTS: dict[str, Any] = {
    "name": "hotstart",  # the deployment's name (`serve status`, the replica log files)
    "num_replicas": None,  # a fixed count (no autoscaling); default: autoscaled between min and max_replicas
    "min_replicas": 1,  # 0: scale to zero when idle (the first request then waits for a replica's start)
    "max_replicas": None,  # default: min_replicas, at least 1
    "initial_replicas": None,
    "target_ongoing_requests": 16,
    "max_ongoing_requests": None,  # default: 2 x max_num_seqs (Ray holds the rest at the proxy)
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 60.0,
    "downscale_to_zero_delay_s": None,
    "look_back_period_s": 15.0,
    # the replica's CPUs: Ray places it by them and sets the engine's threads from them (OMP_NUM_THREADS)
    "num_cpus": 1.0,
    "num_gpus": 0.0,
    "memory": None,  # bytes Ray reserves for the replica (placement only)
    "resources": None,  # custom resources, JSON: '{"hotstart": 1}' places replicas on nodes that offer them
    "max_replicas_per_node": None,
    # default: --shutdown-timeout (25 s): the streams in flight of a replica Ray stops run to their end
    "graceful_shutdown_timeout_s": None,
    "health_check_period_s": 5.0,
    "health_check_timeout_s": 30.0,
    "node_zygote": True,  # replicas on a node fork their engines from one zygote there (ray/zygote.py)
    "startup_timeout_s": 600.0,  # a replica whose engine is not ready by then fails (Ray starts another)
}
_FLOATS = {k for k, v in RAY_DEFAULTS.items() if isinstance(v, float)} | {"downscale_to_zero_delay_s"}
_INTS = {"num_replicas", "min_replicas", "max_replicas", "initial_replicas", "max_ongoing_requests", "memory",
         "max_replicas_per_node"}
_BOOLS = {"node_zygote"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# hotstart serve flags that mean nothing here: Ray's proxy owns the socket and the connection limits
_NOT_HERE = ("host", "port", "max_connections", "header_timeout", "body_timeout", "startup_trace", "zygote")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hotstart.ray:app", add_help=False)
    p.add_argument("--revision", default=None)
    add_options(p, ServeConfig)
    add_options(p, EngineConfig)
    return p


def _option_meta(key: str) -> dict | None:
    for cls in (ServeConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            if f.name == key and "option" in f.metadata:
                return f.metadata["option"]
    return None


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def _argv(key: str, value: Any) -> list[str]:
    """The command-line words of one hotstart flag."""
    meta = _option_meta(key)
    if meta is None or key in _NOT_HERE:
        raise ValueError(f"unknown argument {key!r} (any `hotstart serve` flag but --host, --port and the "
                         f"connection limits, or one of: model, revision, {', '.join(sorted(RAY_DEFAULTS))})")
    flag = meta["flag"] or "--" + key.replace("_", "-")
    if meta["action"] == "store_false":  # --no-prefetch ...: given only to switch the default off
        return [] if _bool(key, value) else [flag]
    if meta["action"] == "boolean":
        return [flag if _bool(key, value) else "--no-" + key.replace("_", "-")]
    if meta["action"] == "append":
        items = value if isinstance(value, (list, tuple)) else [value]
        return [w for item in items for w in (flag, str(item))]
    return [f"{flag}={value}"]


def _ray_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    try:
        if key in _BOOLS:
            return _bool(key, value)
        if key in _INTS:
            n = int(value)
            if n < 0:
                raise ValueError
            return n
        if key in _FLOATS:
            x = float(value)
            if not 0 <= x < float("inf"):
                raise ValueError
            return x
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number >= 0, got {value!r}") from None
    if key == "resources":
        res = json.loads(value) if isinstance(value, str) else dict(value)
        if not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in res.items()):
            raise ValueError(f"resources: expected a JSON object of names to amounts, got {value!r}")
        return res
    return str(value)


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica starts from: the model as given, the serve and engine flags."""

    model: str | None
    revision: str | None
    serve: ServeConfig
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig's option fields

    def engine_config(self, **derived: Any) -> EngineConfig:
        return EngineConfig(**self.engine, **derived)


@dataclass(frozen=True)
class AppOptions:
    spec: ReplicaSpec
    ray: dict[str, Any]


def parse(args: dict[str, Any] | None) -> AppOptions:
    """ARGS (keys with - or _) -> the replica's spec and Ray's options, checked; ValueError otherwise."""
    args = {str(k).replace("-", "_"): v for k, v in (args or {}).items()}
    model = args.pop("model", None)
    if isinstance(model, (list, tuple)):
        if len(model) > 1:
            raise ValueError("model: one model per application (deploy one application per model)")
        model = model[0] if model else None
    ray = dict(RAY_DEFAULTS)
    argv = []
    for key, value in args.items():
        if key in RAY_DEFAULTS:
            ray[key] = _ray_value(key, value)
        elif key == "revision":
            argv += [f"--revision={value}"]
        else:
            argv += _argv(key, value)
    ns = _parser().parse_args(argv)
    serve = ServeConfig(**values(ServeConfig, ns))
    if serial_baseline():
        serve = dataclasses.replace(serve, prespawn=False, prefetch=False, import_prefetch=False)
    engine = values(EngineConfig, ns)
    ray["max_replicas"] = ray["max_replicas"] or max(1, ray["min_replicas"])
    if ray["max_replicas"] < ray["min_replicas"]:
        raise ValueError(f"max_replicas ({ray['max_replicas']}) is below min_replicas "
                         f"({ray['min_replicas']})")
    if ray["max_ongoing_requests"] is None:
        ray["max_ongoing_requests"] = 2 * engine["max_num_seqs"]
    if ray["graceful_shutdown_timeout_s"] is None:
        ray["graceful_shutdown_timeout_s"] = float(serve.shutdown_timeout)
    return AppOptions(ReplicaSpec(str(model) if model else None, ns.revision, serve, engine), ray)
