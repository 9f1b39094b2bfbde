"""Command-line flags derived from config dataclass fields, so names, defaults and help live once.

A field declared with `option(default, help, ...)` becomes `--field-name` (or the flag given);
`add_options(parser, Cls)` adds them, `values(Cls, args)` reads them back. Argparse value types used
by the options live here too. Stdlib only: `hotstart --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [LOW, HIGH]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {value}")
        return value
    parse.metavar = "N"
    return parse


non_negative = int_in(0)  # 0 allowed: --port 0, --max-tokens 0 ...
at_least_one = int_in(1)
port = int_in(0, 65535)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


fraction.metavar = "F"


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text}")
    return value


seconds.metavar = "SECONDS"


def bucket_list(text: str) -> str:
    """Comma-separated positive integers, e.g. 1,2,4,8 (kept as text: configs travel as plain data)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return ",".join(parts)


bucket_list.metavar = "N,N,..."


_AMOUNT = re.compile(r"(?:auto|(\d+(?:\.\d+)?)%|\d+(?:\.\d+)?(?:[kmgt]i?b?)?)", re.IGNORECASE)


def memory_amount(text: str) -> str:
    """An amount of memory: bytes (512M, 1.5GiB, 0), a percentage of MemTotal (5%), or auto (kept as
    text; frontend/memory.py's min_free_bytes reads it)."""
    m = _AMOUNT.fullmatch(text.strip())
    if m is None or (m.group(1) is not None and float(m.group(1)) > 100):
        raise argparse.ArgumentTypeError(f"expected bytes (512M, 2G), a percentage (5%) or auto, got "
                                         f"{text!r}")
    return text.strip()


memory_amount.metavar = "SIZE"


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:ib|i|b)?", re.IGNORECASE)


def byte_size(text: str) -> int:
    """An argparse type: a positive number of bytes, plain or with a binary unit (512M, 1.5GiB, 8Gi, 2G:
    K/M/G/T are powers of 1024, as in --min-free-memory)."""
    m = _SIZE.fullmatch(str(text).strip())
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes (1073741824, 512M, 2G), got {text!r}")
    return value


_BYTES_OR_AUTO = re.compile(r"auto|\d+(?:\.\d+)?(?:[kmgt]i?b?)?", re.IGNORECASE)


def byte_size_or_auto(text: str) -> str:
    """A size in bytes (4G, 512M, 0) or auto, kept as text (configs travel as plain data; the engine reads
    it when it knows what auto means)."""
    if _BYTES_OR_AUTO.fullmatch(text.strip()) is None:
        raise argparse.ArgumentTypeError(f"expected bytes (512M, 4G, 0) or auto, got {text!r}")
    return text.strip()


byte_size.metavar = "SIZE"


def name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty name")
    return text


name.metavar = "NAME"


def option(default: Any, help: str, *, flag: str | None = None, short: str | None = None,  # noqa: A002
           type: Any = None, choices: Any = None, action: str | None = None, env: str | None = None,  # noqa: A002
           metavar: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a command-line flag. ACTION "store_false" makes FLAG (e.g.
    --no-prefetch) switch a True default off; "boolean" makes --NAME / --no-NAME pairs (vLLM's style);
    ENV names an environment variable for the default; ALIASES are other spellings of the flag (vLLM's)."""
    meta = {"help": help, "flag": flag, "short": short, "type": type, "choices": choices, "action": action,
            "env": env, "metavar": metavar, "aliases": aliases}
    return dataclasses.field(default=default, metadata={"option": meta})


def _options(cls) -> list[tuple[dataclasses.Field, dict]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def add_options(parser: argparse.ArgumentParser | Any, cls, exclude: tuple[str, ...] = ()) -> None:
    """Add a flag for every option field of CLS (but those in EXCLUDE)."""
    for f, o in _options(cls):
        if f.name in exclude:
            continue
        flags = [o["flag"] or "--" + f.name.replace("_", "-"), *o.get("aliases", ())]
        flags += [o["short"]] if o["short"] else []
        default = f.default
        if o["env"] and os.environ.get(o["env"]):
            default = os.environ[o["env"]]
        kwargs: dict[str, Any] = {"dest": f.name, "help": o["help"]}
        if o["action"] == "store_false":
            kwargs.update(action="store_false")
        elif o["action"] == "boolean":
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif o["action"] == "append":
            kwargs.update(action="append", type=o["type"], default=None)
        else:
            metavar = o["metavar"] or (getattr(o["type"], "metavar", None) if not o["choices"] else None)
            kwargs.update(default=default, type=o["type"], choices=o["choices"], metavar=metavar)
            if o["env"]:
                kwargs["help"] = f"{o['help']} (environment: {o['env']})"
            elif default is not None:  # an env default may be a secret: never print it
                kwargs["help"] = f"{o['help']} (default: {default})"
        parser.add_argument(*flags, **kwargs)


def values(cls, args: argparse.Namespace, exclude: tuple[str, ...] = (), **overrides: Any) -> dict[str, Any]:
    """{field: value} for the option fields of CLS present in ARGS (but EXCLUDE: names that ARGS uses
    for something else), then OVERRIDES; appended lists become tuples (configs are frozen)."""
    out: dict[str, Any] = {}
    for f, _ in _options(cls):
        if hasattr(args, f.name) and f.name not in exclude:
            v = getattr(args, f.name)
            out[f.name] = tuple(v) if isinstance(v, list) else v
    out.update(overrides)
    return out
