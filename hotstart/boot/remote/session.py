"""open_remote(): from `s3://BUCKET/PREFIX` to a local folder whose weights are arriving (or are there).

Steps, on the caller's (main) thread, all bounded: list the prefix (one request, few retries, so an
unreachable store falls back to the cached copy quickly); a complete snapshot of that listing is
served at once; otherwise take the snapshot's lock, fetch the sidecars (a thread each, whole-object
GETs), order the weights as the engine loads them, and start the weight download (download.py).
A snapshot locked by another live process is followed: its sidecars are awaited, its weights arrive
through that process's download (the engine waits on the same arrival files).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotstart.boot.remote import download, snapshot
from hotstart.boot.remote import store as s3
from hotstart.boot.remote.url import RemoteSpec, parse_remote
from hotstart.errors import HotstartError
from hotstart.messages import Span
from hotstart.model import arrival
from hotstart.system import hotstart_home

LIST_RETRIES, LIST_RETRY_TIMEOUT_S = 2, 10
SIDECAR_TIMEOUT_S = 120
FOLLOW_WAIT_S = 60


@dataclass
class RemoteModel:
    """A resolved s3:// model. source: "s3" (downloading now), "s3-cache" (complete copy, listing
    agrees), "s3-offline" (store unreachable: the last complete copy), "s3-follow" (another process
    downloads it)."""

    spec: RemoteSpec
    path: Path
    source: str
    endpoint: str
    downloader: download.Downloader | None = None
    spans: list[Span] = field(default_factory=list)
    lock_fd: int | None = None

    @property
    def downloading(self) -> bool:
        return self.downloader is not None and self.downloader.state == "running"

    def attach(self, on_span) -> None:
        """Send the spans so far, and the download's later ones, to ON_SPAN (thread-safe callable)."""
        for span in self.spans:
            on_span(span)
        if self.downloader is not None:
            self.downloader.on_span = on_span

    def stats(self) -> dict:
        if self.downloader is not None:
            return {**self.downloader.stats(), "source": self.source, "path": str(self.path)}
        return {
            "state": {"s3-follow": "following"}.get(self.source, "cached"),
            "source": self.source,
            "url": self.spec.url,
            "endpoint": self.endpoint,
            "path": str(self.path),
        }

    def stop(self) -> None:
        if self.downloader is not None:
            self.downloader.stop()


def _warn(message: str) -> None:
    print(f"hotstart: WARNING: {message}", file=sys.stderr, flush=True)


def open_remote(text: str, home: Path | None = None) -> RemoteModel:
    """Resolve the remote spec TEXT (see the module docstring). HotstartError with one line on failure."""
    spec = parse_remote(text)
    list_store, shown, how = s3.open_store(
        spec.bucket, retries=LIST_RETRIES, retry_timeout_s=LIST_RETRY_TIMEOUT_S
    )
    loc = snapshot.location_dir(home or hotstart_home(), shown, spec)
    t = time.time()
    try:
        listing = s3.list_prefix(list_store, spec.prefix)
    except Exception as e:  # noqa: BLE001 - obstore's errors, as one line
        err = s3.describe(e, f"listing {spec.url}", shown)
        if err.status is not None and err.status < 500:
            raise err from None
        cached = snapshot.current_snapshot(loc)
        if cached is None:
            raise HotstartError(f"{err}; no complete copy cached in {loc}") from None
        _warn(f"{err}; serving the cached copy in {cached}")
        return RemoteModel(
            spec,
            cached,
            "s3-offline",
            shown,
            spans=[Span("s3 unreachable", t, time.time(), "download", "cached copy served")],
        )
    spans = [Span("s3 listed", t, time.time(), "download", f"{len(listing)} objects, credentials: {how}")]
    sidecars, tensors = snapshot.candidates(spec, listing, shown)
    snap = loc / snapshot.snapshot_key(sidecars, tensors)
    if snapshot.complete(snap) is not None:
        return RemoteModel(spec, snap, "s3-cache", shown, spans=spans)
    try:
        snap.mkdir(parents=True, exist_ok=True)
        snapshot.describe_location(loc, spec, shown)
        lock_fd = _lock(snap)
    except OSError as e:
        raise HotstartError(f"cannot create the download cache {snap}: {e.strerror or e}") from None
    if lock_fd is None:
        return _follow(spec, snap, shown, sidecars, tensors, spans, home)
    model = RemoteModel(spec, snap, "s3", shown, spans=spans, lock_fd=lock_fd)
    try:
        store, _, _ = s3.open_store(spec.bucket)
        t = time.time()
        _fetch_sidecars(store, spec, snap, sidecars, shown)
        spans.append(
            Span(
                "sidecars downloaded",
                t,
                time.time(),
                "download",
                f"{len(sidecars)} files, {sum(o.size for o in sidecars) / 1e6:.1f} MB",
            )
        )
        index = snap / snapshot.INDEX
        weights = snapshot.weight_order(spec, tensors, index.read_text() if index.is_file() else None)
        todo = [o for o in weights if not _have(snap / o.name, o.size)]
        files = [download.prepare(snap, o) for o in todo]
        kept = sum(min(f.obj.size, f.resumed * download.CHUNK_BYTES) for f in files)
        download.free_space_check(snap, sum(o.size for o in todo) - kept)
        objects = sidecars + weights
        on_done = lambda: snapshot.write_manifest(snap, spec, shown, objects)  # noqa: E731
        model.downloader = download.Downloader(store, spec, shown, files, on_done=on_done).start()
    except OSError as e:
        os.close(lock_fd)
        raise HotstartError(f"cannot write the download cache {snap}: {e.strerror or e}") from None
    except BaseException:
        os.close(lock_fd)
        raise
    return model


def _have(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _lock(snap: Path) -> int | None:
    """The snapshot's lock fd (held until the process exits), or None if another process holds it."""
    fd = os.open(f"{snap}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _fetch_sidecars(store, spec: RemoteSpec, snap: Path, sidecars: list, shown: str) -> None:
    """Each sidecar whole, in parallel (a thread each: I/O only), each written to a temp name and renamed."""
    errors: list[HotstartError] = []

    def fetch(obj) -> None:
        try:
            if _have(snap / obj.name, obj.size):
                return
            try:
                key = spec.key(obj.name)
                data = s3.get_range(store, key, 0, obj.size, obj.etag) if obj.size else b""
            except Exception as e:  # noqa: BLE001 - obstore's errors, as one line
                raise s3.describe(e, f"{spec.url}/{obj.name}", shown) from None
            if len(data) != obj.size:
                raise HotstartError(
                    f"{spec.url}/{obj.name}: got {len(data)} bytes, the listing gives {obj.size}"
                )
            snapshot.write_atomic(snap / obj.name, bytes(data))
        except HotstartError as e:
            errors.append(e)
        except OSError as e:
            errors.append(HotstartError(f"cannot write {snap / obj.name}: {e.strerror or e}"))

    threads = [
        threading.Thread(target=fetch, args=(o,), name=f"hotstart-s3-sidecar-{i}", daemon=True)
        for i, o in enumerate(sidecars)
    ]
    for th in threads:
        th.start()
    deadline = time.monotonic() + SIDECAR_TIMEOUT_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(th.is_alive() for th in threads):
        raise HotstartError(
            f"{spec.url}: the config and tokenizer files did not arrive within {SIDECAR_TIMEOUT_S} s"
        )


def _follow(spec, snap: Path, shown: str, sidecars: list, tensors: list, spans: list, home) -> RemoteModel:
    """Another process holds SNAP's lock: wait until its sidecars are in and its weights complete or
    arriving (then the engine waits on them), or take over if it lets go."""
    deadline = time.monotonic() + FOLLOW_WAIT_S
    while time.monotonic() < deadline:
        if snapshot.complete(snap) is not None:
            return RemoteModel(spec, snap, "s3-cache", shown, spans=spans)
        if all(_have(snap / o.name, o.size) for o in sidecars):
            index = snap / snapshot.INDEX
            weights = snapshot.weight_order(spec, tensors, index.read_text() if index.is_file() else None)
            if all(_have(snap / o.name, o.size) or arrival.arriving(snap / o.name) for o in weights):
                spans.append(
                    Span(
                        "following a download",
                        time.time(),
                        time.time(),
                        "download",
                        "another hotstart process is downloading this snapshot",
                    )
                )
                return RemoteModel(spec, snap, "s3-follow", shown, spans=spans)
        fd = _lock(snap)
        if fd is not None:  # it let go before finishing: this process downloads (and resumes) it
            os.close(fd)
            return open_remote(f"{spec.name}={spec.url}", home)
        time.sleep(0.05)
    raise HotstartError(
        f"{spec.url}: another hotstart process holds {snap}.lock and its download made no "
        f"progress in {FOLLOW_WAIT_S} s"
    )
