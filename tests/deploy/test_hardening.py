"""deploy/ is hardened (docs/security.md), checked by a policy of our own over the manifests (Kubernetes'
"restricted" Pod Security Standard and more: non-root, no privilege escalation, read-only root filesystem,
no capabilities, RuntimeDefault seccomp, no service-account token, a pinned image, the API key required,
Prometheus on the metrics port, a NetworkPolicy) and over the systemd units (their directives, and
`systemd-analyze security --offline` where systemd has it). kubernetes-validate checks the schemas:
tests/deploy/test_deploy.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hotstart
from hotstart.cli import build_parser
from hotstart.errors import HotstartError
from hotstart.server.access import check_bind

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
# each unit's [Service] must say so (value, or None: any value but empty)
UNIT_POLICY = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
               "CapabilityBoundingSet": "", "UMask": "0077", "StateDirectoryMode": "0700",
               "RestrictSUIDSGID": "yes", "ProtectKernelModules": "yes", "SystemCallArchitectures": "native",
               "LimitNOFILE": None}


def manifests() -> dict[str, dict]:
    files = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    return {d["kind"]: d for f in files for d in yaml.safe_load_all(f.read_text()) if d}


def pod() -> dict:
    return manifests()["Deployment"]["spec"]["template"]


def container() -> dict:
    (c,) = pod()["spec"]["containers"]
    return c


def policy_problems(template: dict) -> list[str]:
    """What breaks the policy in a pod template: [] when nothing does."""
    spec, out = template["spec"], []
    pod_sc = spec.get("securityContext") or {}
    if spec.get("automountServiceAccountToken") is not False:
        out.append("automountServiceAccountToken is not false")
    out += [f"{k} is on" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    out += [f"volume {v['name']} is a hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc, name = c.get("securityContext") or {}, c["name"]

        def either(key, sc=sc):
            return sc.get(key, pod_sc.get(key))

        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: the root filesystem is writable")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or caps.get("add"):
            out.append(f"{name}: capabilities are not drop [ALL], add none")
        if either("runAsNonRoot") is not True or either("runAsUser") in (0, None):
            out.append(f"{name}: may run as root")
        if (either("seccompProfile") or {}).get("type") != "RuntimeDefault":
            out.append(f"{name}: seccomp is not RuntimeDefault")
        image = c["image"]
        if "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
            out.append(f"{name}: image {image} is not pinned (a release tag or a digest)")
    return out


def test_the_pod_passes_the_policy_and_the_policy_catches_each_field():
    assert policy_problems(pod()) == []
    assert container()["image"].endswith(":" + hotstart.__version__) or "@sha256:" in container()["image"]
    import copy

    for path, value, found in [(("securityContext", "allowPrivilegeEscalation"), True, "PrivilegeEscalation"),
                               (("securityContext", "readOnlyRootFilesystem"), False, "root filesystem"),
                               (("securityContext", "capabilities"), {"drop": ["NET_RAW"]}, "capabilities"),
                               (("securityContext", "seccompProfile"), {"type": "Unconfined"}, "seccomp"),
                               (("securityContext", "runAsUser"), 0, "root"),
                               (("image",), "ghcr.io/example/hotstart:latest", "not pinned"),
                               (("image",), "ghcr.io/example/hotstart", "not pinned")]:
        bad = copy.deepcopy(pod())
        target = bad["spec"]["containers"][0]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert any(found in p for p in policy_problems(bad)), (path, value, policy_problems(bad))
    bad = copy.deepcopy(pod())
    bad["spec"]["automountServiceAccountToken"] = True
    assert policy_problems(bad) == ["automountServiceAccountToken is not false"]


def test_every_path_the_server_writes_is_a_writable_volume():
    c = container()
    env = {e["name"]: e.get("value") for e in c["env"]}
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    for name in ("HOTSTART_HOME", "HOTSTART_RUNTIME_DIR", "TMPDIR", "HOME"):
        assert any(env[name] == m or env[name].startswith(m + "/") for m in writable), (name, env[name])
    # the cache volume's root is group-writable (fsGroup): $HOTSTART_HOME is a folder of its own inside
    assert env["HOTSTART_HOME"] not in writable


def test_the_api_key_is_required_and_prometheus_scrapes_the_metrics_port():
    c = container()
    (key,) = [e for e in c["env"] if e["name"] == "HOTSTART_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"].get("optional") in (None, False)  # no Secret: the pod waits
    args = build_parser().parse_args(c["args"])
    assert not args.allow_no_api_key and not args.api_key  # the key never sits in the manifest
    with pytest.raises(HotstartError):  # what the server would say without it
        check_bind(args.host, False, args.allow_no_api_key)
    check_bind(args.host, True, args.allow_no_api_key)
    notes = pod()["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(notes["prometheus.io/port"]) == args.metrics_port == ports["metrics"] != ports["http"]
    assert notes["prometheus.io/path"] == "/metrics"


def test_a_network_policy_opens_the_two_ports_and_nothing_else():
    np = manifests()["NetworkPolicy"]["spec"]
    assert np["podSelector"]["matchLabels"] == manifests()["Deployment"]["spec"]["selector"]["matchLabels"]
    assert set(np["policyTypes"]) == {"Ingress", "Egress"} and np["egress"] == []
    opened = {p["port"] for rule in np["ingress"] for p in rule["ports"]}
    assert opened == {"http", "metrics"} == {p["name"] for p in container()["ports"]}
    (metrics_rule,) = [r for r in np["ingress"] if {p["port"] for p in r["ports"]} == {"metrics"}]
    assert all("namespaceSelector" in f and "podSelector" not in f for f in metrics_rule["from"])


def directives(unit: Path) -> dict[str, str]:
    out = {}
    for line in unit.read_text().splitlines():
        m = re.match(r"^(\w+)=(.*)$", line)
        if m:
            out[m[1]] = m[2].strip()
    return out


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_systemd_units_are_hardened(unit):
    d = directives(unit)
    for key, want in UNIT_POLICY.items():
        assert key in d, f"{unit.name}: {key}= missing"
        assert want is None and d[key] or d[key] == want, f"{unit.name}: {key}={d[key]}, wants {want!r}"
    assert int(d["LimitNOFILE"].split(":")[-1]) >= 65536
    assert d.get("MemoryDenyWriteExecute", "no") == "no"  # oneDNN writes its kernels at run time
    assert d["StateDirectory"] == "hotstart" and d["Environment"].endswith("/run/hotstart")
    if unit.name == "hotstart.service":  # its engines, forked by the zygote, share the zygote's /tmp
        assert d["JoinsNamespaceOf"] == "hotstart-zygote.service"


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_security_rates_the_units_ok(tmp_path):
    helps = subprocess.run(["systemd-analyze", "security", "--help"], capture_output=True, text=True,
                           timeout=30)
    if "--offline" not in helps.stdout:
        pytest.skip("this systemd-analyze cannot rate a unit file offline (systemd < 250)")
    venv = Path(sys.executable).parent.parent
    for unit in UNITS:
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/hotstart/.venv", str(venv)))
        # --threshold on systemd's 0-100 scale: 30 is an exposure of 3.0 (the units before: 9.6, UNSAFE)
        out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=30", str(copy)],
                             capture_output=True, text=True, timeout=60)
        level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
        assert out.returncode == 0 and level and float(level[1]) <= 3.0, out.stdout[-2000:] + out.stderr
