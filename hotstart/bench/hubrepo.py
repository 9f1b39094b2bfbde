"""The repositories a loopback hub serves (hubserver.py): local folders described as the Hugging Face Hub
and ModelScope describe theirs: a commit per revision, every file's git blob id (sha1 of
"blob SIZE\\0" + bytes) and, for LFS files, its sha256. Hashes of large files are remembered in a JSON
file keyed by path, size and mtime, so a 3 GB checkpoint is hashed once per machine, not per start."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

# what a repository's .gitattributes puts in LFS on the Hub by default, and anything over 10 MB
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".model",
                ".tar", ".zip", ".npy")
LFS_MIN_BYTES = 10 * 1000 * 1000
BLOCK = 16 << 20


@dataclass(frozen=True)
class RepoFile:
    path: str  # relative, '/'-separated
    size: int
    oid: str  # git blob sha1
    sha256: str
    lfs: bool


@dataclass
class Repo:
    """ACCESS: public | gated | private; GRANTED: tokens that may read it when gated or private."""

    repo_id: str
    folder: Path
    access: str = "public"
    granted: set[str] = field(default_factory=set)
    files: dict[str, RepoFile] = field(default_factory=dict)
    revisions: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    @property
    def commit(self) -> str:
        return self.revisions["main"]

    def resolve(self, rev: str) -> str | None:
        """The commit of REV (a branch, a tag or the commit itself), else None."""
        if rev in self.revisions:
            return self.revisions[rev]
        return rev if rev in self.revisions.values() else None


def _hashes(path: Path, memo: dict, lock: threading.Lock) -> tuple[str, str]:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    with lock:
        if key in memo:
            return tuple(memo[key])
    sha1 = hashlib.sha1(f"blob {st.st_size}\0".encode())  # noqa: S324 - git's object id, not security
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            sha1.update(block)
            sha256.update(block)
    out = (sha1.hexdigest(), sha256.hexdigest())
    with lock:
        memo[key] = list(out)
    return out


def load_repo(repo_id: str, folder: str | Path, access: str = "public", granted: set[str] | None = None,
              memo_path: Path | None = None, extra_revisions: dict[str, str] | None = None) -> Repo:
    """A Repo of every file under FOLDER (hidden ones aside). Its main commit is a sha1 of the file ids,
    so the same content gives the same commit; EXTRA_REVISIONS maps more names (tags) to main's commit
    or to other 40-hex ids."""
    folder = Path(folder)
    memo: dict = {}
    if memo_path is not None and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except ValueError:
            memo = {}
    lock = threading.Lock()
    paths = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    files: dict[str, RepoFile] = {}
    for p in paths:
        rel = p.relative_to(folder).as_posix()
        oid, sha256 = _hashes(p, memo, lock)
        size = p.stat().st_size
        lfs = rel.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES
        files[rel] = RepoFile(rel, size, oid, sha256, lfs)
    if memo_path is not None:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    commit = hashlib.sha1(json.dumps([repo_id, *[[f.path, f.oid] for f in files.values()]]).encode())  # noqa: S324
    revisions = {"main": commit.hexdigest(), "master": commit.hexdigest()}
    for name, target in (extra_revisions or {}).items():
        revisions[name] = revisions.get(target, target)
    return Repo(repo_id, folder, access, set(granted or ()), files, revisions)


def tree(repo: Repo, path: str = "", recursive: bool = False) -> list[dict]:
    """The Hub's /tree entries under PATH: files (with `lfs` for LFS files) and folders."""
    prefix = f"{path.strip('/')}/" if path.strip("/") else ""
    out: list[dict] = []
    dirs: set[str] = set()
    for f in repo.files.values():
        if not f.path.startswith(prefix):
            continue
        rest = f.path[len(prefix):]
        if "/" in rest and not recursive:
            dirs.add(prefix + rest.split("/")[0])
            continue
        if recursive:
            parts = rest.split("/")[:-1]
            dirs.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
        entry = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        out.append(entry)
    dir_oid = lambda d: hashlib.sha1(d.encode()).hexdigest()  # noqa: E731, S324
    out += [{"type": "directory", "oid": dir_oid(d), "size": 0, "path": d} for d in sorted(dirs)]
    return out
