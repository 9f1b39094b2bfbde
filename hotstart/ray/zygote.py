"""One hotstart zygote per Ray node and replica environment, shared by the replicas on that node (torch-free
here: the zygote process imports torch, not this actor).

A replica's engine needs torch imported in a process that has run no torch op: the replica's own forkserver
does that (~1-2.5 s, every time a replica starts), or a zygote that did it once for the node (a fork: ms).
The first replica on a node starts its own forkserver (no wait on anything), and once its engine is READY
(the CPU idle again) asks for the node's zygote: a detached actor named for the application, the node and the
replica's import-time environment (OMP_NUM_THREADS, which Ray sets from num_cpus, ...), pinned to the node by
NodeAffinitySchedulingStrategy, owning no CPU, watching its application from a thread. It runs `python -m
hotstart.forkserver.zygote` on a private socket folder of that node (HOTSTART_RUNTIME_DIR, under this user's
runtime folder), which every later replica of the application on the node finds at its t=0 (a scale from
zero, a scale up, a replacement).

Engines forked by it run as the zygote's children, with the replica's environment and output, and die with the
replica (its lifeline), with the zygote and with the node. The actor ends itself (and its zygote) within
WATCH_S once its Serve application is gone (`serve shutdown`, `serve delete`); `ray stop` ends it with the
node. Cost: one idle Ray worker and one zygote (~240 MB RSS, shared copy-on-write with the engines) per node.
"""

from __future__ import annotations

import binascii
import json
import logging
import os
import threading
import time

import ray

from hotstart.forkserver import control
from hotstart.forkserver.runtime import ensure_private_dir, import_env, paths, runtime_dir

log = logging.getLogger("hotstart")
WATCH_S = 2.0
NAMESPACE = "hotstart"


def node_runtime_dir(app: str, node_id: str, env: dict[str, str]) -> str:
    """This node's zygote folder for APP and import environment ENV, in this user's runtime folder (a loopback
    cluster's nodes share a machine but not a zygote: each node's replicas die with that node)."""
    key = binascii.crc32(json.dumps([app, sorted(env.items())]).encode())
    return os.path.join(runtime_dir(), f"ray-{node_id[:12]}-{key:08x}")


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class NodeZygote:
    """The zygote of one node (see the module docstring); RUN_DIR: its socket folder, ENV: its import env."""

    def __init__(self, app: str, run_dir: str, env: dict[str, str]) -> None:
        self.app, self.run_dir = app, run_dir
        problem = ensure_private_dir(os.path.dirname(run_dir)) or ensure_private_dir(run_dir)
        if problem is not None:
            raise RuntimeError(f"hotstart zygote folder not usable: {problem}")
        p = paths(run_dir)
        keep = {k: v for k, v in os.environ.items() if k not in import_env()}
        self.proc = control.spawn(p, [], detach=False, env={**keep, **env, "HOTSTART_RUNTIME_DIR": run_dir})
        self.info = control.wait_ready(p, self.proc)
        from ray import serve  # noqa: PLC0415 - Serve's client, in this actor only
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: PLC0415

        serve.status()  # its lazy imports, here on the actor's thread: the watcher below only calls
        threading.Thread(target=self._watch, args=(serve, SERVE_CONTROLLER_NAME, SERVE_NAMESPACE),
                         daemon=True, name="hotstart-zygote-watch").start()
        log.info("hotstart: node zygote pid %d for %s in %s", self.info.pid, app, run_dir)

    def pid(self) -> int:
        return self.info.pid

    def _watch(self, serve, controller: str, namespace: str) -> None:
        """A daemon thread (RPCs only: its imports were made by the constructor): once the application is
        gone,
        stop the zygote and end this actor."""
        while self.proc.poll() is None:
            time.sleep(WATCH_S)
            try:  # a GCS lookup first: a Serve client cached for a killed controller would wait on it
                ray.get_actor(controller, namespace=namespace)
                apps = serve.status().applications  # one call to the controller (ms)
            except Exception:  # noqa: BLE001 - no controller: Serve is shut down
                apps = {}
            if self.app not in apps:
                break
        self.stop()
        ray.kill(ray.get_runtime_context().current_actor)

    def stop(self) -> None:
        from hotstart.procs import terminate_then_kill  # noqa: PLC0415 - stdlib only

        terminate_then_kill([self.proc], control.STOP_TIMEOUT_S)


def ensure(run_dir: str, app: str, node_id: str, env: dict[str, str]) -> None:
    """Ask for the node's zygote in RUN_DIR (node_runtime_dir; non-blocking: the actor starts in the
    background,
    an existing one is kept)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    name = f"zygote:{os.path.basename(run_dir)}"
    actor = NodeZygote.options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": env},
    ).remote(app, run_dir, env)
    del actor  # detached: it lives on without this handle
