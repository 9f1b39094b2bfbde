"""What a process's imports read from disk, recorded once per environment, so the next cold start can
read those bytes first, at full queue depth, before the weights (boot/iosched.py).

A manifest lists, in import order, every file the process's imports touched: the compiled module files
(.pyc, or the source where none is cached) whole, and of each mapped shared library only the pages this
process has in its page tables (/proc/self/pagemap's present bit: what the dynamic loader and the code
touched, whatever else the page cache holds), as runs of file offsets. A library that is not a module
(libtorch_cpu.so) goes just before the first extension module of its package. Each entry carries the
file's size and mtime: an entry whose file changed is dropped when loaded, and a manifest with more than
STALE_FRACTION of its entries changed (or none at all) is recorded again by that start.

Manifests live in $HOTSTART_HOME/io/KEY/ROLE.json, KEY naming the interpreter, the environment's prefix
and hotstart's version and folder; ROLE is "forkserver" (torch + the engine) or "api" (the web stack and
the tokenizer). Stdlib only, no imports at call time: load() may run on an I/O thread.
"""

from __future__ import annotations

import binascii
import importlib.util
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from hotstart.diskio import home_writable, write_atomic

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MERGE_GAP = 256 << 10  # page runs closer than this are read as one (a read beats another seek)
STALE_FRACTION = 0.1
PRESENT = 1 << 63


@dataclass
class Entry:
    path: str
    size: int
    mtime_ns: int
    runs: list[tuple[int, int]] | None  # (offset, length) of the pages to read; None: the whole file

    @property
    def nbytes(self) -> int:
        return self.size if self.runs is None else sum(n for _, n in self.runs)


def folder(home: Path) -> Path:
    """$HOTSTART_HOME/io/KEY: one per interpreter, environment and hotstart checkout."""
    import hotstart  # noqa: PLC0415 - already imported by whoever calls this

    key = json.dumps([os.path.realpath(sys.executable), sys.prefix, hotstart.__version__,
                      os.path.dirname(os.path.realpath(hotstart.__file__)), list(sys.version_info[:3])])
    return home / "io" / f"{binascii.crc32(key.encode()):08x}"  # a collision only costs a stale check


def _module_files() -> list[str]:
    out = []
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if not isinstance(f, str):
            continue
        if f.endswith(".py"):
            cached = importlib.util.cache_from_source(f)
            f = cached if os.path.exists(cached) else f
        out.append(os.path.realpath(f))  # as /proc/self/maps names a mapped one
    return out


def _mapped_runs() -> dict[str, list[tuple[int, int]]]:
    """path -> merged runs of file offsets whose pages this process has mapped (present)."""
    pages: dict[str, list[int]] = {}
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps, \
            open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].rstrip("\n")
            if path.endswith(" (deleted)") or not os.path.isfile(path):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            offset = int(parts[2], 16)
            n = (hi - lo) // PAGE
            pagemap.seek(lo // PAGE * 8)
            raw = pagemap.read(n * 8)
            present = [i for i, (v,) in enumerate(struct.iter_unpack("<Q", raw)) if v & PRESENT]
            pages.setdefault(path, []).extend(offset // PAGE + i for i in present)
    runs = {}
    for path, idx in pages.items():
        merged: list[list[int]] = []
        for p in sorted(set(idx)):
            start = p * PAGE
            if merged and start - (merged[-1][0] + merged[-1][1]) <= MERGE_GAP:
                merged[-1][1] = start + PAGE - merged[-1][0]
            else:
                merged.append([start, PAGE])
        runs[path] = [(a, b) for a, b in merged]
    return runs


def record(path: Path) -> int:
    """Write this process's manifest to PATH (atomically); returns the bytes it lists (0: not written, as
    $HOTSTART_HOME takes no writes this run: diskio.check_home)."""
    if not home_writable():
        return 0
    mapped = _mapped_runs()
    entries: list[Entry] = []
    seen: set[str] = set()

    def add(f: str, runs) -> None:
        if f in seen:
            return
        try:
            st = os.stat(f)
        except OSError:
            return
        seen.add(f)
        entries.append(Entry(f, st.st_size, st.st_mtime_ns, runs))

    libs = [f for f in mapped if not f.endswith((".py", ".pyc"))]
    for f in _module_files():
        if f in mapped:  # an extension module: first the libraries of its package it links to
            top = os.path.dirname(f)
            while os.path.basename(os.path.dirname(top)) not in ("site-packages", "dist-packages", "") and \
                    os.path.dirname(top) != top:
                top = os.path.dirname(top)
            for lib in libs:
                if lib.startswith(top) and lib not in seen and lib != f:  # torch/lib, numpy.libs
                    add(lib, mapped[lib])
        add(f, mapped.get(f))
    for lib in libs:  # the interpreter's own and the system's libraries
        add(lib, mapped[lib])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = {"entries": [[e.path, e.size, e.mtime_ns, e.runs] for e in entries]}
    write_atomic(path, json.dumps(body).encode())
    return sum(e.nbytes for e in entries)


def load(path: Path) -> tuple[list[Entry], bool]:
    """(the entries whose file is unchanged, whether the manifest should be recorded again). Never
    raises: a missing or unreadable manifest is ([], True)."""
    try:
        raw = json.loads(path.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return [], True
    fresh = []
    for item in raw:
        try:
            f, size, mtime, runs = item
            st = os.stat(f)
        except (OSError, ValueError, TypeError):
            continue
        if st.st_size == size and st.st_mtime_ns == mtime:
            fresh.append(Entry(f, size, mtime, [tuple(r) for r in runs] if runs is not None else None))
    return fresh, len(fresh) < (1 - STALE_FRACTION) * max(len(raw), 1)
