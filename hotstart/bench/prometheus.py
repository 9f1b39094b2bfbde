"""The one reader of a /metrics body (Prometheus text exposition) on the client side: the benchmarks,
their tests and benchmarks/ read samples with it. Stdlib only."""

from __future__ import annotations

import re
from collections.abc import Iterator

# name{labels} value [timestamp]; a label value may hold any character, "}" and escaped quotes included
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line in TEXT, in order; comments and lines that are no
    sample are skipped. Label values are as written (escapes kept)."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), value


def metric_values(text: str, name: str, label: str = "model") -> dict[str, float]:
    """The samples of metric NAME keyed by their LABEL's value ("" for the one without it); where two
    share a key, the last wins."""
    return {labels.get(label, ""): v for n, labels, v in samples(text) if n == name}


def metric_value(text: str, name: str) -> float | None:
    """NAME's unlabelled sample (a server-wide gauge or counter), None if it has none."""
    for n, labels, v in samples(text):
        if n == name and not labels:
            return v
    return None
