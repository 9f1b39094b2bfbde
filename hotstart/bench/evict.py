"""Cold modes of the startup benchmark: which files to drop from the page cache, and proof that they are gone.

  none     nothing is evicted (warm start: the warm-up runs have read everything once)
  weights  the model's safetensors and sidecars (config, tokenizer, template), and the model files only
           peers read (llama.cpp's GGUF)
  all      weights + every file of the launched programs' environments: the site-packages of each
           program's interpreter, the stdlib folder of its base prefix, hotstart's own source, and a
           peer's LD_PRELOAD libraries and executables (never vLLM's compile cache: `keep`)

Eviction is posix_fadvise(DONTNEED) per file (no root needed) and is checked with mincore. Pages that a
live process maps (e.g. the harness's own libpython) cannot be dropped; that is why the residency is
recorded instead of assumed. The same union of files is evicted before every run of every config, so
each run starts from the same cache state; and when the modes switch from `all` to another, the whole
environment is read back first (warm_sets), so `weights` means the weights alone are cold.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotstart.residency import evict, resident_bytes

MODES = ("none", "weights", "all")

# Asked of a program's interpreter: where its imports come from.
_PATHS_CODE = (
    "import json, site, sysconfig; p = sysconfig.get_paths(); "
    "print(json.dumps([[p['stdlib'], p['platstdlib']], "
    "sorted({p['purelib'], p['platlib'], *site.getsitepackages()})]))"
)


@dataclass
class FileSet:
    """A named set of regular files (real paths, no duplicates) with their total size."""

    name: str
    paths: list[str] = field(default_factory=list)
    nbytes: int = 0
    _seen: set[str] = field(default_factory=set, repr=False)

    def add_file(self, path: str | os.PathLike) -> None:
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            return  # a dangling link or a file that vanished: nothing to evict
        if os.path.isfile(real) and real not in self._seen:
            self.paths.append(real)
            self._seen.add(real)
            self.nbytes += st.st_size

    def add_tree(self, folder: str | os.PathLike, skip: frozenset[str] = frozenset()) -> None:
        """Add every file under `folder`, except under the folders in `skip` (real paths)."""
        # os.walk does not follow folder links, so a venv linking back into itself cannot loop.
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
            for name in files:
                self.add_file(os.path.join(root, name))


def python_of(argv0: str) -> str | None:
    """The interpreter a command runs on: argv0 itself if it is a python, else its script's shebang."""
    exe = shutil.which(argv0)
    if exe is None:
        return None
    if os.path.basename(exe).startswith("python"):
        return exe
    try:
        with open(exe, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None  # a binary or a script without shebang: its environment is unknown
    words = first[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])  # "#!/usr/bin/env python3"
    return words[0] if words and "python" in os.path.basename(words[0]) else None


def python_env_dirs(python: str) -> tuple[list[str], list[str]]:
    """(stdlib folders, site-packages folders) of an interpreter, asked of it once before any eviction."""
    try:
        out = subprocess.run([python, "-c", _PATHS_CODE], capture_output=True, text=True, timeout=60,
                             check=False)
        stdlib, sites = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return [], []
    return [d for d in stdlib if os.path.isdir(d)], [d for d in sites if os.path.isdir(d)]


@dataclass
class ColdSets:
    """The files each cold mode evicts: `weights` (the model), `peer_weights` (model files only peers
    read, e.g. llama.cpp's GGUF) and `env` (the programs' environments, the union over every config)."""

    weights: FileSet
    env: FileSet
    env_dirs: list[str]
    notes: list[str]
    peer_weights: FileSet = field(default_factory=lambda: FileSet("peer_weights"))
    per_config: dict[str, dict] = field(default_factory=dict)  # label -> {"dirs", "files"} it needs evicted
    kept: list[str] = field(default_factory=list)  # folders never evicted (vLLM's compile cache)

    def for_mode(self, mode: str) -> list[FileSet]:
        models = [self.weights] + ([self.peer_weights] if self.peer_weights.paths else [])
        return {"none": [], "weights": models, "all": models + [self.env]}[mode]


def build_cold_sets(weight_paths: list[Path], programs: dict[str, tuple[str | None, list[str], list[str]]],
                    peer_weight_paths: list[Path] = (), keep: list[str] = ()) -> ColdSets:
    """Collect the file sets once. `programs`: config label -> (its interpreter or None if unknown,
    extra folders, extra files: e.g. hotstart's source, an LD_PRELOAD library). `keep`: folders whose
    files are never evicted, even where they lie under an evicted folder."""
    weights, peer_weights = FileSet("weights"), FileSet("peer_weights")
    for p in weight_paths:
        weights.add_file(p)
    for p in peer_weight_paths:
        if os.path.realpath(p) not in weights._seen:
            peer_weights.add_file(p)
    asked: dict[str, tuple[list[str], list[str]]] = {}
    dirs: list[str] = []
    files: list[str] = []
    sites: set[str] = set()
    notes: list[str] = []
    per_config: dict[str, dict] = {}
    for label, (py, extra_dirs, extra_files) in programs.items():
        mine = list(extra_dirs)
        if py is None:
            notes.append(
                f"{label}: its interpreter is unknown: only its model files and "
                f"{extra_files or 'nothing else'}"
                " are evicted"
            )
        else:
            if py not in asked:
                asked[py] = python_env_dirs(py)
                if not asked[py][1]:
                    notes.append(f"could not ask {py} for its site-packages")
            stdlib, site_dirs = asked[py]
            mine += stdlib + site_dirs
            sites.update(os.path.realpath(d) for d in site_dirs)
        per_config[label] = {
            "python": py,
            "dirs": sorted({os.path.realpath(d) for d in mine if os.path.isdir(d)}),
            "files": list(extra_files),
        }
        dirs += mine
        files += extra_files
    # Keep only outermost folders: a venv's site-packages may lie under another listed folder.
    dirs = sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})
    outer = [d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs)]
    # The base interpreter's own site-packages (under its stdlib folder) is not on a venv's path.
    skip = {os.path.join(d, sub) for d in outer for sub in ("site-packages", "dist-packages")
            if os.path.join(d, sub) not in sites}
    kept = sorted({os.path.realpath(k) for k in keep})
    env = FileSet("env")
    for d in outer:
        env.add_tree(d, frozenset(skip | set(kept)))
    for f in files:
        if not any(os.path.realpath(f).startswith(k + os.sep) for k in kept):
            env.add_file(f)
    return ColdSets(weights=weights, env=env, env_dirs=outer, notes=notes, peer_weights=peer_weights,
                    per_config=per_config, kept=kept)


def evict_sets(sets: list[FileSet]) -> float:
    """Evict every file of `sets`; returns the seconds it took."""
    t = time.perf_counter()
    for s in sets:
        for path in s.paths:
            try:
                evict(path, sync=s.name != "env")
            except OSError:
                pass  # unreadable or vanished: residency below shows whatever stayed
    return time.perf_counter() - t


def warm_sets(sets: list[FileSet], chunk: int = 1 << 20) -> float:
    """Read every file of `sets` into the page cache; returns the seconds it took. After an `all`-mode run,
    a `weights` or `none` run must not find the environment half evicted (only what the last `all` run
    happened to re-read is back): that would be charged to whichever config runs first."""
    t = time.perf_counter()
    buf = bytearray(chunk)
    for s in sets:
        for path in s.paths:
            try:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buf) == chunk:
                        pass
            except OSError:
                pass  # unreadable or vanished: it cannot be warm or cold for the server either
    return time.perf_counter() - t


def residency(s: FileSet) -> float:
    """Percent of the set's bytes in the page cache now (mincore)."""
    resident = total = 0
    for path in s.paths:
        try:
            r, n = resident_bytes(path)
        except OSError:
            continue
        resident += r
        total += n
    return 100.0 * resident / total if total else 0.0


def mapped_by(paths: list[str]) -> dict[int, str]:
    """Processes (pid -> command) that map any of `paths`: their pages cannot be evicted."""
    wanted = set(paths)
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as f:
                if not any(line.rstrip("\n").split(maxsplit=5)[-1] in wanted for line in f if "/" in line):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            continue  # gone, or not ours to read
    return found
