"""The configs of `hotstart bench startup`: one launchable command each, with its label, model, check
and limit.

hotstart configs are built in startup.py (its VARIANTS); peers here: `--peer CMD [--peer-name NAME]`
and `--peers vllm,llamacpp,transformers` (commands.env of `make peers`, see peers.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from hotstart.bench import evict as ev
from hotstart.bench import peers
from hotstart.errors import HotstartError


@dataclass(frozen=True)
class Target:
    """One config: a command template ({port}, {model}, {gguf}) with extra environment."""

    label: str
    kind: str  # "hotstart" | "peer"
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict, hash=False)
    python: str | None = None  # its interpreter, whose environment "--cold all" evicts
    key: str | None = None  # the --peers key (vllm, llamacpp, transformers), if it came from there
    model: str | None = None  # what {model} stands for (None: the benchmark's model)
    expect: str | None = None  # the answer must contain this (None: any non-empty answer)
    timeout: float = 180.0  # seconds from launch to the verified answer
    first_start: bool = False  # vLLM with an empty cache (--vllm-first-start): run once, in round 1

    @property
    def vllm(self) -> bool:
        return self.key == "vllm" or peers.is_vllm(self.argv)

    def command(self, port: int, model: str, gguf: str | None = None) -> list[str]:
        return peers.fill(self.argv, port, self.model or model, gguf)

    def meta(self) -> dict:
        return {"label": self.label, "kind": self.kind, "argv": list(self.argv), "env": self.env,
                "key": self.key, "model": self.model, "expect": self.expect, "timeout": self.timeout,
                "first_start": self.first_start}


def peer_target(cmd: str, name: str | None = None, key: str | None = None) -> Target:
    env, words = peers.split_command(cmd, "--peer")
    if not any("{port}" in w for w in words):
        raise HotstartError(f"--peer {cmd!r}: must contain {{port}} (the harness picks a free port)")
    label = name
    if not label:
        label = os.path.basename(words[0])
        if len(words) > 2 and words[1] == "-m":  # "python -m http.server"
            label += " -m " + words[2]
        elif len(words) > 1 and words[1].isalpha():  # "transformers serve"; "sleep 600" stays "sleep"
            label += " " + words[1]
    return Target(label, "peer", tuple(words), env, ev.python_of(words[0]), key=key)


def peer_targets(kind: str, value: str, name: str | None) -> list[Target]:
    """--peer CMD (named by --peer-name) or --peers KEY[,KEY...]."""
    if kind == "peer":
        return [peer_target(value, name)]
    out = []
    for key in filter(None, (k.strip() for k in value.split(","))):
        label, cmd = peers.known_peer(key)
        out.append(peer_target(cmd, name or label, key))
    if not out:
        raise HotstartError(f"--peers {value!r}: give peers, e.g. vllm,llamacpp,transformers")
    return out


def _pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for v in values or []:
        label, sep, val = v.partition("=")
        if not sep or not label or not val:
            raise HotstartError(f"{flag} {v!r}: must be LABEL=VALUE")
        out[label.strip().lower()] = val
    return out


def finish(targets: list[Target], args: argparse.Namespace) -> list[Target]:
    """Unique labels; per config its {model}, expected answer and time limit; the vLLM first-start rows."""
    default, per = peers.parse_timeouts(args.timeout)
    models = _pairs(getattr(args, "peer_model", None), "--peer-model")
    out: list[Target] = []
    for t in targets:
        n = sum(1 for o in out if o.label.split(" #")[0] == t.label)
        label = f"{t.label} #{n + 1}" if n else t.label
        model = models.get(label.lower()) or (models.get(t.key) if t.key else None)
        if model is not None and not os.path.exists(model):
            raise HotstartError(f"--peer-model {label}={model}: not found")
        expect = args.expect if t.kind == "hotstart" else args.expect_peers
        out.append(dataclasses.replace(t, label=label, model=model, expect=expect,
                                       timeout=peers.timeout_for(label, t.key, t.vllm, default, per)))
    unknown = set(models) - {t.label.lower() for t in out} - {t.key for t in out if t.key}
    if unknown:
        raise HotstartError(f"--peer-model: no config named {', '.join(sorted(unknown))}")
    if getattr(args, "vllm_first_start", False):
        firsts = [dataclasses.replace(t, label=f"{t.label} (first start)", first_start=True)
                  for t in out if t.vllm]
        if not firsts:
            raise HotstartError("--vllm-first-start: no vLLM peer (add --peers vllm)")
        out += firsts
    return out
