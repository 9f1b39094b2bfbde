"""Content checks of downloaded files against the digests a hub lists: the LFS sha256 of large files, the
git blob id (sha1 of "blob SIZE\\0" + bytes) of small ones; ModelScope lists a sha256 for each.

A weight file is hashed in order while it arrives: one thread (`Verifier`) reads each file's bytes below
its written prefix back from the page cache (pread; they were written a moment ago) and feeds them to
hashlib, which releases the GIL on large updates. Until the digest matches, the file's watermark stays one
byte short of its end, so the engine cannot finish loading a file that is not verified, and the file is
not renamed into place: a mismatch fails the download and nothing of the file is kept.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

BLOCK = 16 << 20


@dataclass(frozen=True)
class Digest:
    algo: str
    expected: str
    prefix: bytes = b""

    def new(self):
        h = hashlib.new(self.algo)
        h.update(self.prefix)
        return h


def digest_of(obj) -> Digest | None:
    """What OBJ (a RemoteObject) is checked against, or None (S3: no content digest is listed)."""
    if obj.sha256:
        return Digest("sha256", obj.sha256.lower())
    if obj.git_oid:
        return Digest("sha1", obj.git_oid.lower(), f"blob {obj.size}\0".encode())
    return None


def check_bytes(obj, data: bytes) -> str | None:
    """None if DATA matches OBJ's digest (or it has none), else the mismatch as text."""
    d = digest_of(obj)
    if d is None:
        return None
    h = d.new()
    h.update(data)
    got = h.hexdigest()
    return None if got == d.expected else f"{d.algo} {got[:16]}... instead of {d.expected[:16]}..."


class Verifier:
    """Hashes FILES (download._File, in load order) as their written prefix grows. `poke()` after every
    write; ON_VERIFIED(f) once a file's digest matched, ON_MISMATCH(f, text) when it did not."""

    def __init__(self, files: list, lock: threading.Lock, chunk: int,
                 on_verified: Callable, on_mismatch: Callable):
        self.files = [f for f in files if f.digest is not None]
        self.lock, self.chunk = lock, chunk
        self.on_verified, self.on_mismatch = on_verified, on_mismatch
        self.cond = threading.Condition(threading.Lock())
        self.stopped = False
        self._h = {id(f): f.digest.new() for f in self.files}

    def poke(self) -> None:
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def run(self) -> None:
        """The thread's body: returns once every file is verified, one failed, or stop()."""
        pending = list(self.files)
        while pending and not self.stopped:
            progressed = False
            for f in list(pending):
                with self.lock:
                    ready = min(f.obj.size, f.low * self.chunk)
                    fd = os.dup(f.fd) if f.fd >= 0 and f.hashed < ready else -1
                if fd >= 0:
                    try:
                        h = self._h[id(f)]
                        while f.hashed < ready and not self.stopped:
                            block = os.pread(fd, min(BLOCK, ready - f.hashed), f.hashed)
                            if not block:
                                break
                            h.update(block)
                            f.hashed += len(block)
                            progressed = True
                    finally:
                        os.close(fd)
                if f.hashed >= f.obj.size:
                    pending.remove(f)
                    got = self._h[id(f)].hexdigest()
                    if got == f.digest.expected:
                        self.on_verified(f)
                    else:
                        self.on_mismatch(f, f"{f.digest.algo} {got[:16]}... instead of the listed "
                                            f"{f.digest.expected[:16]}...")
                        return
                if self.stopped:
                    return
            if not progressed and pending:
                with self.cond:
                    if not self.stopped:
                        self.cond.wait(0.5)
