"""A real multi-node Ray cluster on loopback for the hotstart.ray tests: a head node (no `hotstart` resource:
the proxy and the controller) and worker nodes offering {"hotstart": 1} each, every node 1 CPU and a small
object store, as `ray.cluster_utils.Cluster` starts them (separate raylets, as on separate machines). Every
process of it carries HOTSTART_TEST_TAG (helpers/procs.py tagged), so a test can kill a node's processes and
prove that nothing is left after the cluster's stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import time
import uuid

from helpers.procs import tagged

# Ray's defaults push autoscaling metrics every 10 s: a test of scaling would wait on them
CLUSTER_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "hotstart.ray.proxy:middlewares",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # the suite runs beside other tests on 2 cores: a node's zygote may take longer to answer its probe
    # than the few ms a replica waits by default (then the replica imports torch itself)
    "HOTSTART_ZYGOTE_ANSWER_MS": "3000",
    # a node whose raylet died is declared dead after ~2 s instead of ~30 s
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
NODE_OBJECT_STORE = 80 << 20


def ray_unavailable() -> str | None:
    """Why Ray cannot run here (one line), or None."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        return f"Ray Serve is not installed ({e}): pip install 'hotstart[ray]'"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster:
    def __init__(self, workers: int = 2, cpus: int = 1) -> None:
        self.workers, self.cpus = workers, cpus  # CPUS: each worker node's
        self.tag = f"ray-{uuid.uuid4().hex[:8]}"
        self.tmp = tempfile.mkdtemp(prefix="hsr-", dir="/tmp")  # short: Ray's socket paths live under it
        self.runtime = os.path.join(self.tmp, "rt")
        os.mkdir(self.runtime, 0o700)
        self.port = free_port()
        self.cluster = None
        self.nodes: list = []  # worker nodes (ray._private.node.Node)
        self._saved: dict[str, str | None] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> LoopbackCluster:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        env = {**CLUSTER_ENV, "HOTSTART_TEST_TAG": self.tag, "RAY_TMPDIR": self.tmp,
               "HOTSTART_RUNTIME_DIR": self.runtime}
        for k, v in env.items():  # the nodes inherit this process's environment
            self._saved[k] = os.environ.get(k)
            os.environ[k] = v
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"head": 1}, "object_store_memory": NODE_OBJECT_STORE,
            "include_dashboard": False})
        for i in range(self.workers):
            self.nodes.append(self.cluster.add_node(
                num_cpus=self.cpus, resources={"hotstart": 1, f"node{i + 1}": 1},
                object_store_memory=NODE_OBJECT_STORE))
        self.cluster.wait_for_nodes(timeout)
        ray.init(address=self.cluster.address, log_to_driver=False, namespace="hotstart-tests")
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def node_of(self, node_id: str):
        return next(n for n in self.nodes if n.node_id == node_id)

    def kill_node(self, node) -> list[int]:
        """SIGKILL NODE's raylet and every process under it (its workers, their forkservers and engines) at
        once,
        as a machine's loss would; the pids killed."""
        from hotstart.procs import descendants

        roots = [p.process.pid for procs in node.all_processes.values() for p in procs]
        pids = sorted({pid for root in roots for pid in [root, *descendants(root)]})
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.nodes.remove(node)
        self.cluster.worker_nodes.discard(node)
        return pids

    def leftovers(self) -> list:
        """Live processes of this cluster (the test process itself excepted)."""
        return [p for p in tagged(self.tag) if p.pid != os.getpid()]

    def stop(self, timeout: float = 30.0) -> list:
        """serve shutdown, the driver's disconnect, every node stopped; kills (and returns) what is still
        alive
        after TIMEOUT."""
        import ray
        from ray import serve

        if self.cluster is None and not self._saved:
            return []  # stopped already
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
            self.cluster = None
        deadline = time.monotonic() + timeout
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.leftovers()
        for p in left:
            with contextlib.suppress(Exception):
                p.kill()
        for k, v in self._saved.items():  # (a second stop changes nothing)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved = {}
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)
        return left
