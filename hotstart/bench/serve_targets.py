"""The servers `hotstart bench serve` measures: built from the command line, started (or, for --url,
found running), asked for their model name, and stopped.

  --hotstart LABEL=FLAGS   `hotstart serve` from this checkout with FLAGS ("hotstart[LABEL]"; leading
                           VAR=value words are its environment: PYTHONPATH=DIR runs another checkout)
  --peers vllm,llamacpp,transformers   the command lines `make peers` wrote (servers.peer_spec)
  --peer CMD [--peer-name NAME]        any server's command line with {port} and {model} / {gguf}
  --url URL [--url-name NAME]          a server that is already running (never started or stopped here)

Each start of a hotstart target gets an empty folder of its own for the prefix cache on disk
(HOTSTART_KV_DIR, removed when it stops): prompts seeded alike in an earlier run would otherwise be read
back instead of computed, a head start no peer has. A VAR=value word of the target's sets it otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass, field
from urllib.error import URLError

from hotstart.bench import peers, roofline
from hotstart.bench import servers as sv
from hotstart.bench.process import Server, free_port
from hotstart.errors import HotstartError


@dataclass
class ServeTarget:
    label: str
    kind: str  # hotstart | vllm | llamacpp | transformers | peer | url
    spec: sv.Spec | None = None  # what to launch (None: --url)
    url: str | None = None
    srv: Server | None = None
    pid: int | None = None  # the server's process (CPU noise accounting)
    model_id: str | None = None
    weights: str = ""
    mb: roofline.ModelBytes | None = None
    info: dict = field(default_factory=dict)  # ready_s, fast path, served dtype... (results.json)
    kv_dir: str | None = None  # this start's empty prefix-cache folder (removed at stop)

    def get_json(self, path: str, headers: dict | None = None, timeout: float = 5.0) -> dict | None:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback / the user's URL
                return json.loads(r.read())
        except (OSError, URLError, ValueError):
            return None


def _hotstart(value: str, model: str, args, label_suffix: str | None) -> ServeTarget:
    label, sep, flags = value.partition("=")
    if not sep:
        raise HotstartError(f"--hotstart {value!r}: must be LABEL=FLAGS (either may be empty: --hotstart =)")
    label = (label_suffix or label).strip()
    extra = shlex.split(flags) + shlex.split(args.hotstart_args or "")
    spec = sv.hotstart_spec(model, args.dtype, extra, max(args.concurrency), label)
    return ServeTarget(spec.name, "hotstart", spec, weights=spec.weights)


def _peer(cmd: str, name: str | None, model: str) -> ServeTarget:
    env, words = peers.split_command(cmd, "--peer")
    if not any("{port}" in w for w in words):
        raise HotstartError(f"--peer {cmd!r}: must contain {{port}} (the benchmark picks a free port)")
    port = free_port()
    gguf = peers.default_gguf() if peers.needs_gguf(words) else None
    label = name or os.path.basename(words[0])
    program = os.path.basename(words[0])
    kind = ("vllm" if peers.is_vllm(words) else
            "transformers" if program == "transformers" and "serve" in words[1:2] else "peer")
    named = next((w for w in words if w.lower().endswith(".gguf")), None)  # a GGUF file it is given
    spec = sv.Spec(label, kind, peers.fill(words, port, model, gguf), env, url=f"http://127.0.0.1:{port}",
                   weights=sv.weights_label(gguf or named, "") if gguf or named else "")
    return ServeTarget(label, kind, spec, weights=spec.weights)


def build_targets(args, model: str) -> list[ServeTarget]:
    """The targets in command-line order (default: one plain hotstart); labels made unique."""
    out: list[ServeTarget] = []
    for kind, value, name in args.targets or [("hotstart", "=", None)]:
        if kind == "hotstart":
            out.append(_hotstart(value, model, args, name))
        elif kind == "peer":
            out.append(_peer(value, name, model))
        elif kind == "peers":
            for key in filter(None, (k.strip() for k in value.split(","))):
                if key not in peers.KNOWN:
                    raise HotstartError(f"--peers {key}: unknown peer (known: {', '.join(peers.KNOWN)})")
                spec = sv.peer_spec(key, model, args.dtype, shlex.split(args.peer_args or ""),
                                    args.llamacpp_threads)
                if name:
                    spec.name = name
                out.append(ServeTarget(spec.name, key, spec, weights=spec.weights))
        else:
            url = value.rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise HotstartError(f"--url {value!r}: must start with http:// or https://")
            out.append(ServeTarget(name or url, "url", url=url))
    seen: dict[str, int] = {}
    for t in out:
        n = seen[t.label] = seen.get(t.label, 0) + 1
        if n > 1:
            t.label = f"{t.label} #{n}"
    return out


def start(t: ServeTarget, args, model: str, headers: dict | None) -> None:
    """Launch T (or check that a --url answers), wait for hotstart's fast path, learn its model name,
    pid and served dtype, and what a decode step of it reads (for the roofline fraction)."""
    if t.spec is not None:
        env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else {}
        if t.kind == "hotstart" and "HOTSTART_KV_DIR" not in t.spec.env:
            t.kv_dir = tempfile.mkdtemp(prefix="hotstart-bench-kv-")
            env["HOTSTART_KV_DIR"] = t.info["kv_dir"] = t.kv_dir
        try:
            t.srv = sv.spawn(t.spec, args.ready_timeout, env)
        except BaseException:
            stop(t)
            raise
        t.url, t.pid = t.srv.url, t.srv.pid
        t.info["ready_s"] = round(t.srv.t_health, 2)
        if t.kind == "hotstart":
            t.info.update(sv.wait_fast_path(t.srv.get_json, args.fast_path_timeout))
    else:
        if t.get_json("/v1/models", headers, timeout=10) is None:
            raise HotstartError(f"--url {t.url}: GET /v1/models did not answer with JSON (is it running? "
                                "an API key: --api-key or OPENAI_API_KEY)")
        t.pid = sv.server_pid_for(t.url)
        t.info.update(sv.wait_fast_path(lambda p: t.get_json(p, headers), args.fast_path_timeout))
    if args.served_model_name:
        t.model_id = args.served_model_name
    elif not t.kind.startswith("transformers"):
        models = (t.get_json("/v1/models", headers, timeout=30) or {}).get("data") or []
        t.model_id = models[0].get("id") if models and isinstance(models[0], dict) else None
    dtype = None
    if t.srv is not None and "GGUF" not in t.weights:  # as the server logged it, else the checkpoint's
        served = sv.served_dtype(t.kind, t.srv.output, model)
        t.weights = f"{served} safetensors"
        dtype = served if served in roofline.ELEMENT_BYTES else None
    t.info["weights"] = t.weights
    if "GGUF" not in t.weights:  # a quantised file reads other bytes than the checkpoint: no fraction
        try:
            t.mb = roofline.model_bytes(model, dtype)
        except (OSError, ValueError, HotstartError):
            t.mb = None


def stop(t: ServeTarget) -> dict | None:
    out = t.srv.stop() if t.srv is not None else None
    t.srv = None
    if t.kv_dir:
        shutil.rmtree(t.kv_dir, ignore_errors=True)
        t.kv_dir = None
    return out
