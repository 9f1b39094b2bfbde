"""The prefix cache on disk (torch-free: the engine writes and reads blocks, the API process counts them):
where blocks live, what keys them, the file format, the size budget.

  ROOT/<snapshot>/<layout>/<block hash hex>.kv      ROOT: $HOTSTART_KV_DIR, else $HOTSTART_HOME/kv
  snapshot  what the weights are: config.json's bytes and each weight file's name, size, mtime and
            safetensors header; a GGUF file's name, size, mtime and first GGUF_HEAD bytes (its metadata)
            (another checkpoint, or this one rewritten, never shares a folder)
  layout    what else decides a block's bytes: the KV tensor's shape per block, dtype, device type, the
            context length (RoPE variants scale by it), the format version
  a file    HEADER (magic, layout key, block hash, payload bytes, crc32 of the payload) + the payload: one
            block's K and V, [layers, 2, KV heads, block size, head dim] in the engine's dtype

A block's hash is the prefix cache's own (engine/block_manager.py: sha256 chained over the token ids),
so a file names a whole prefix. Files are written under a unique temporary name and renamed into place
(a reader never sees a partial file under a final name; no fsync: a torn file fails its checksum). A
file is used only if this user owns it, nobody else may write it or its folder, its header names this
layout and the hash it is named by, its size is the layout's and its checksum holds; anything else is
deleted, never loaded. The root is bounded by a size budget, least recently used first (a read touches
the file's mtime). Everything here is plain file I/O: the engine's writer thread calls it (no imports).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import stat
import struct
import time
import zlib
from pathlib import Path

from hotstart.system import hotstart_home

VERSION = 1
MAGIC = b"HSKV\x00\x01\x00\x00"
HEADER = struct.Struct("<8s32s32sQI4x")  # magic, layout key, block hash, payload bytes, crc32 of the payload
SUFFIX = ".kv"
TEMP_STALE_S = 600.0  # a temporary file this old is a dead writer's
HEADER_CAP = 64 << 20  # safetensors headers above this are not read into the key (size and mtime still are)
GGUF_HEAD = 4 << 20  # a GGUF's first bytes in the key: its metadata (a large vocabulary's tail aside)
_temp_ids = itertools.count()


def kv_root() -> Path:
    return Path(os.environ.get("HOTSTART_KV_DIR") or hotstart_home() / "kv")


def snapshot_key(model_path: str | Path, weight_files: list[str | Path]) -> str:
    """What the weights are, as a folder name (hex): config.json's bytes, then per weight file (by name)
    its name, size, mtime and safetensors header. OSError when a file is missing. Computed once per
    version of the files (their size, mtime and inode) in a process: an engine forked by a forkserver
    that computed it already (forkserver/server.py, while idle) does not hash a GGUF's first 4 MiB again."""
    files = tuple(map(str, weight_files))
    gguf = Path(model_path).is_file()  # a GGUF file: no config.json beside it
    versions = tuple(_version(p) for p in (files if gguf else (*files, Path(model_path) / "config.json")))
    return _snapshot_key(str(model_path), files, gguf, versions)


def _version(path: str | Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=16)
def _snapshot_key(model_path: str, weight_files: tuple[str, ...], gguf: bool,
                  versions: tuple) -> str:  # noqa: ARG001 - VERSIONS: the cache's key
    h = hashlib.sha256(b"hotstart-kv-snapshot\0")
    if not gguf:  # a GGUF file: its metadata (in its first bytes) is its config
        h.update((Path(model_path) / "config.json").read_bytes())
    for path in sorted(map(Path, weight_files), key=lambda p: p.name):
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            h.update(f"\0{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if gguf:
                h.update(f.read(GGUF_HEAD))
                continue
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + (f.read(n) if 0 < n <= HEADER_CAP else b""))
    return h.hexdigest()[:32]


def layout_key(snapshot: str, block_shape: tuple[int, ...], dtype: str, device: str,
               max_model_len: int) -> bytes:
    """The 32-byte key of what decides a block's bytes besides the weights (see the module docstring)."""
    text = f"v{VERSION}|{snapshot}|{'x'.join(map(str, block_shape))}|{dtype}|{device}|{max_model_len}"
    return hashlib.sha256(text.encode()).digest()


def layout_folder(root: Path, snapshot: str, layout: bytes) -> Path:
    return root / snapshot / layout.hex()[:32]


def block_path(folder: Path, block: bytes) -> Path:
    return folder / f"{block.hex()}{SUFFIX}"


def _private_dir(path: Path) -> bool:
    """PATH exists as a folder of ours that nobody else may write (created so where missing)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def usable_folder(folder: Path) -> bool:
    """FOLDER and its two parents (snapshot, root) are private folders of ours (made so if missing)."""
    return all(_private_dir(p) for p in (folder.parent.parent, folder.parent, folder))


def write_block(folder: Path, layout: bytes, block: bytes, payload) -> int:
    """Write one block file atomically; PAYLOAD is a bytes-like buffer. Returns the bytes written."""
    data = memoryview(payload).cast("B")
    head = HEADER.pack(MAGIC, layout, block, data.nbytes, zlib.crc32(data))
    final = block_path(folder, block)
    tmp = folder / f".{final.name}.{os.getpid()}.{next(_temp_ids)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER.size + data.nbytes


def read_block(folder: Path, layout: bytes, block: bytes, nbytes: int) -> memoryview | None:
    """The payload of BLOCK's file, verified (owner, mode, header, size, checksum); None where it is
    missing. A file that fails a check is deleted. A read touches the file (LRU)."""
    buf = bytearray(nbytes)
    return memoryview(buf) if read_block_into(folder, layout, block, memoryview(buf)) else None


def read_block_into(folder: Path, layout: bytes, block: bytes, out: memoryview) -> bool:
    """read_block's checks, the payload read straight into OUT (a writable buffer of the payload's size:
    a slice of one buffer for a whole prefix, so that nothing is copied again to put the blocks side by
    side); False where the file is missing or fails a check (then deleted, OUT's bytes undefined)."""
    path = block_path(folder, block)
    out = out.cast("B")
    nbytes = out.nbytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        ok = (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
              and st.st_size == HEADER.size + nbytes)
        if ok:
            head = os.pread(fd, HEADER.size, 0)
            got = 0
            while len(head) == HEADER.size and got < nbytes:
                n = os.preadv(fd, [out[got:]], HEADER.size + got)
                if n <= 0:
                    break
                got += n
            ok = len(head) == HEADER.size and got == nbytes
        if ok:
            magic, lay, blk, size, crc = HEADER.unpack(head)
            ok = (magic, lay, blk, size) == (MAGIC, layout, block, nbytes) and zlib.crc32(out) == crc
    except OSError:
        ok = False
    finally:
        os.close(fd)
    if not ok:
        path.unlink(missing_ok=True)
        return False
    try:
        os.utime(path)
    except OSError:
        pass
    return True


def list_blocks(folder: Path) -> set[bytes]:
    """The block hashes with a file in FOLDER (named so: contents are checked when read)."""
    out = set()
    try:
        with os.scandir(folder) as it:
            for e in it:
                name = e.name
                if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                    try:
                        out.add(bytes.fromhex(name[:64]))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def recent_blocks(folder: Path) -> list[bytes]:
    """The block hashes with a file in FOLDER, the most recently used first (a read touches its file)."""
    found = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                name = e.name
                if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                    try:
                        found.append((e.stat(follow_symlinks=False).st_mtime_ns, bytes.fromhex(name[:64])))
                    except (ValueError, OSError):
                        pass
    except OSError:
        pass
    return [h for _, h in sorted(found, reverse=True)]


def count_blocks(root: Path, snapshot: str) -> int:
    """Block files of a snapshot, in every layout (the API process's /v1/models and /metrics)."""
    total = 0
    try:
        with os.scandir(root / snapshot) as layouts:
            for lay in layouts:
                if lay.is_dir(follow_symlinks=False):
                    total += len(list_blocks(Path(lay.path)))
    except OSError:
        pass
    return total


def enforce_budget(root: Path, budget: int, reserve: float = 0.1) -> int:
    """Delete block files, least recently used first, until ROOT holds at most BUDGET bytes and its
    filesystem keeps RESERVE of its size free; and temporary files of dead writers. Returns the bytes
    left."""
    files, now = [], time.time()
    for path in root.glob(f"*/*/*{SUFFIX}"):
        try:
            st = path.stat(follow_symlinks=False)
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    for path in root.glob("*/*/.*.tmp"):
        try:
            if now - path.stat(follow_symlinks=False).st_mtime > TEMP_STALE_S:
                path.unlink(missing_ok=True)
        except OSError:
            pass
    total = sum(size for _, size, _ in files)
    try:
        vfs = os.statvfs(root)
        free, size = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        budget = min(budget, total + max(0, free - int(reserve * size)))
    except OSError:
        pass
    for _, size, path in sorted(files):
        if total <= budget:
            break
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
        total -= size
    return total
