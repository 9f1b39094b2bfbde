"""deploy/: every Kubernetes manifest validates against the Kubernetes schemas (kubernetes-validate, offline;
the KEDA CRD has no schema there and gets structural checks), the probes use real paths on the CLI's
default port, the container's command line parses with the CLI, the grace period covers the drain, every
metric name deploy/ uses exists in /metrics, and the systemd units pass `systemd-analyze verify`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.server import deploy_metric_names

from hotstart.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
UVICORN_GRACE_S = 3  # server/launch.py GRACEFUL_SHUTDOWN_S


def docs() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def kind(k: str) -> dict:
    found = [d for d in docs() if d["kind"] == k]
    assert len(found) == 1, k
    return found[0]


def test_every_manifest_validates():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    from kubernetes_validate.utils import SchemaNotFoundError, latest_version

    assert len(MANIFESTS) >= 3
    for d in docs():
        try:
            kv.validate(d, latest_version(), strict=True)
        except SchemaNotFoundError:  # a CRD (KEDA): no schema in the Kubernetes set
            assert d["apiVersion"].startswith("keda.sh/"), d["kind"]


def test_scaledobject_scales_from_zero_on_waiting_requests():
    so = kind("ScaledObject")
    assert so["spec"]["minReplicaCount"] == 0
    assert so["spec"]["scaleTargetRef"]["name"] == kind("Deployment")["metadata"]["name"]
    queries = [t["metadata"]["query"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    assert any("vllm:num_requests_waiting" in q for q in queries)


def serve_defaults():
    return build_parser().parse_args(["serve"])


def test_probes_hit_real_paths_on_the_cli_default_port():
    from hotstart.server.api import ApiSettings
    from hotstart.server.routes import build_app

    class Tok:
        vocab_size = 10

    app = build_app(object(), Tok(), ApiSettings(served_model_names=["m"]))
    paths = {getattr(r, "path", None) for r in app.routes}
    (c,) = kind("Deployment")["spec"]["template"]["spec"]["containers"]
    port = serve_defaults().port
    assert {p["containerPort"] for p in c["ports"] if p["name"] == "http"} == {port}  # metrics: its own
    probes = {name: c[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["path"] in paths and probe["port"] == port, probe
    assert probes["readinessProbe"]["path"] == "/health" and probes["livenessProbe"]["path"] == "/live"
    svc = kind("Service")
    assert svc["spec"]["selector"] == kind("Deployment")["spec"]["selector"]["matchLabels"]


def test_container_command_line_parses_and_the_grace_period_covers_the_drain():
    spec = kind("Deployment")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["hotstart"]
    args = build_parser().parse_args(c["args"])
    assert args.host == "0.0.0.0" and args.port == serve_defaults().port
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop + args.shutdown_timeout + UVICORN_GRACE_S < spec["terminationGracePeriodSeconds"]
    assert serve_defaults().shutdown_timeout + UVICORN_GRACE_S < 30  # Kubernetes' default grace
    from hotstart.flags import byte_size

    limit = byte_size(c["resources"]["limits"]["memory"])  # the KV cache leaves room in the container
    assert args.kv_cache_memory is not None and args.kv_cache_memory <= limit // 2


def test_systemd_server_command_line_parses():
    unit = (DEPLOY / "systemd" / "hotstart.service").read_text()
    exec_start = re.search(r"^ExecStart=\S+ (.*)$", unit, re.M)[1].split()
    args = build_parser().parse_args(exec_start)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M)[1])
    assert args.shutdown_timeout + UVICORN_GRACE_S < stop and "KillMode=mixed" in unit


def live_metric_names() -> set[str]:
    """Names in a /metrics body of a server that served a request (histogram and counter suffixes kept)."""
    from hotstart.frontend.metrics import Metrics
    from hotstart.messages import EngineStats

    m = Metrics("SmolLM2-135M-Instruct")
    m.update_engine(EngineStats(), True)
    return {line.split("{")[0].split(" ")[0] for line in m.render().decode().splitlines()
            if line and not line.startswith("#")}


def test_every_metric_deploy_uses_exists():
    used = deploy_metric_names()
    assert "vllm:num_requests_waiting" in used
    assert used <= live_metric_names(), used - live_metric_names()


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path):
    venv = Path(sys.executable).parent.parent
    for unit in (DEPLOY / "systemd").glob("*.service"):  # the installed path: this checkout's venv
        text = unit.read_text().replace("/opt/hotstart/.venv", str(venv))
        text = re.sub(r"^(User|Group)=.*$", "", text, flags=re.M)  # no `hotstart` user on a test machine
        (tmp_path / unit.name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, tmp_path.glob("*.service")))],
                         capture_output=True, text=True, timeout=60)
    problems = [line for line in out.stderr.splitlines() if str(tmp_path) in line]
    assert out.returncode == 0, out.stderr
    assert not problems, problems
