"""open_remote(): from a remote model (s3://BUCKET/PREFIX, a hub id) to a local folder whose weights are
arriving (or are there). One pipeline; the store's backend is a Source (source.py).

Steps, on the caller's (main) thread, all bounded: list the model's root (few retries, so an
unreachable store falls back to the cached copy quickly); a complete copy of that listing is served at
once; otherwise take the copy's lock, fetch the sidecars (a thread each, whole-file GETs, checked
against the listed digests), order the weights as the engine loads them, and start the weight download
(download.py). A copy locked by another live process is followed: its sidecars are awaited, its weights
arrive through that process's download (the engine waits on the same arrival files).
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
from hotstart.boot.remote.source import StoreError, free_space_check
from hotstart.boot.remote.verify import check_bytes
from hotstart.errors import HotstartError
from hotstart.messages import Span
from hotstart.model import arrival
from hotstart.system import hotstart_home

SIDECAR_TIMEOUT_S = 120
FOLLOW_WAIT_S = 60


@dataclass
class RemoteModel:
    """A resolved remote model. source: KIND (downloading now), KIND-cache (a complete copy, the listing
    agrees), KIND-offline (store unreachable: the last complete copy), KIND-follow (another process
    downloads it); KIND is s3, hf or modelscope."""

    spec: object  # the Source (its url, name, endpoint)
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
            "state": "following" if self.source.endswith("-follow") else "cached",
            "source": self.source,
            "url": self.spec.url,
            "endpoint": self.endpoint,
            "path": str(self.path),
        }

    def stop(self) -> None:
        if self.downloader is not None:
            self.downloader.stop()

    def release(self) -> None:
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)


def warn(message: str) -> None:
    print(f"hotstart: WARNING: {message}", file=sys.stderr, flush=True)


def open_remote(text: str, home: Path | None = None) -> RemoteModel:
    """Resolve the s3:// spec TEXT (see the module docstring). HotstartError with one line on failure."""
    from hotstart.boot.remote.s3source import S3Source  # noqa: PLC0415 - imports obstore
    from hotstart.boot.remote.url import parse_remote  # noqa: PLC0415

    return open_source(S3Source(parse_remote(text), home or hotstart_home()))


def offline_model(source, err: HotstartError, t: float) -> RemoteModel:
    """The store did not answer: its last complete local copy with a warning line, else the error."""
    cached = source.cached()
    if cached is None:
        raise HotstartError(f"{err}; no complete copy cached in {source.where_cached()}") from None
    warn(f"{err}; serving the cached copy in {cached}")
    return RemoteModel(source, cached, f"{source.kind}-offline", source.endpoint,
                       spans=[Span(f"{source.kind} unreachable", t, time.time(), "download",
                                   "cached copy served")])


def open_source(source) -> RemoteModel:
    """SOURCE listed, its sidecars in place, its weights complete or arriving."""
    t = time.time()
    try:
        listing = source.list()
    except StoreError as err:
        if not err.unreachable and not (source.fallback_on(err) and source.cached() is not None):
            raise
        return offline_model(source, err, t)
    if listing.cached is not None:  # the store answered that the local copy is current
        return RemoteModel(source, listing.cached, f"{source.kind}-cache", source.endpoint,
                           spans=[Span(f"{source.kind} listed", t, time.time(), "download", listing.detail)])
    spans = [Span(f"{source.kind} listed", t, time.time(), "download", listing.detail)]
    sidecars, tensors = snapshot.candidates(source.url, listing.objects, source.endpoint,
                                            place=source.place, extra=source.extra_sidecars)
    layout = source.layout(listing, sidecars, tensors)
    if layout.complete(sidecars, tensors):
        return RemoteModel(source, layout.snap, f"{source.kind}-cache", source.endpoint, spans=spans)
    try:
        layout.prepare()
        lock_fd = _lock(layout.lock_path)
    except OSError as e:
        raise HotstartError(f"cannot create the download cache {layout.snap}: {e.strerror or e}") from None
    if lock_fd is None:
        return _follow(source, layout, sidecars, tensors, spans)
    snap = layout.snap
    model = RemoteModel(source, snap, source.kind, source.endpoint, spans=spans, lock_fd=lock_fd)
    try:
        source.open()
        t = time.time()
        _fetch_sidecars(source, layout, sidecars)
        spans.append(Span("sidecars downloaded", t, time.time(), "download",
                          f"{len(sidecars)} files, {sum(o.size for o in sidecars) / 1e6:.1f} MB"))
        index = snap / snapshot.INDEX
        weights = snapshot.weight_order(source.url, tensors, index.read_text() if index.is_file() else None)
        todo = [o for o in weights if not layout.have(o)]
        files = [download.prepare(snap, o) for o in todo]
        kept = sum(min(f.obj.size, f.resumed * download.CHUNK_BYTES) for f in files)
        free_space_check(snap, sum(o.size for o in todo) - kept)
        objects = sidecars + weights
        on_done = lambda: layout.finish(objects)  # noqa: E731
        dl = download.Downloader(source, layout, files, on_done=on_done)
        dl.on_exit = model.release  # done: no lock needed; stopped: resumed by the next one to lock it
        model.downloader = dl.start()
    except OSError as e:
        model.release()
        raise HotstartError(f"cannot write the download cache {snap}: {e.strerror or e}") from None
    except BaseException:
        model.release()
        raise
    return model


def _lock(path: Path) -> int | None:
    """The copy's lock fd (held until the process exits), or None if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _fetch_sidecars(source, layout, sidecars: list) -> None:
    """Each sidecar whole, in parallel (a thread each: I/O only), checked against its listed digest and
    put into place by the layout (temp name, rename)."""
    errors: list[HotstartError] = []

    def fetch(obj) -> None:
        try:
            if layout.have(obj):
                return
            data = bytes(source.get_range(obj, 0, obj.size)) if obj.size else b""
            if len(data) != obj.size:
                raise HotstartError(
                    f"{source.url}/{obj.name}: got {len(data)} bytes, the listing gives {obj.size}"
                )
            if (bad := check_bytes(obj, data)) is not None:
                raise HotstartError(f"{source.url}/{obj.name}: the downloaded bytes do not match the listed "
                                    f"digest ({bad})")
            layout.write(obj, data)
        except HotstartError as e:
            errors.append(e)
        except OSError as e:
            errors.append(HotstartError(f"cannot write {layout.snap / obj.name}: {e.strerror or e}"))

    threads = [
        threading.Thread(target=fetch, args=(o,), name=f"hotstart-dl-sidecar-{i}", daemon=True)
        for i, o in enumerate(sidecars)
    ]
    for th in threads:
        th.start()
    deadline = time.monotonic() + SIDECAR_TIMEOUT_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise source.explain(errors[0])
    if any(th.is_alive() for th in threads):
        raise HotstartError(
            f"{source.url}: the config and tokenizer files did not arrive within {SIDECAR_TIMEOUT_S} s"
        )


def _follow(source, layout, sidecars: list, tensors: list, spans: list) -> RemoteModel:
    """Another process holds the copy's lock: wait until its sidecars are in and its weights complete or
    arriving (then the engine waits on them), or take over if it lets go."""
    snap = layout.snap
    deadline = time.monotonic() + FOLLOW_WAIT_S
    while time.monotonic() < deadline:
        if layout.complete(sidecars, tensors):
            return RemoteModel(source, snap, f"{source.kind}-cache", source.endpoint, spans=spans)
        if all(layout.have(o) for o in sidecars):
            index = snap / snapshot.INDEX
            text = index.read_text() if index.is_file() else None
            weights = snapshot.weight_order(source.url, tensors, text)
            if all(layout.have(o) or arrival.arriving(snap / o.name) for o in weights):
                spans.append(Span("following a download", time.time(), time.time(), "download",
                                  "another hotstart process is downloading this copy"))
                return RemoteModel(source, snap, f"{source.kind}-follow", source.endpoint, spans=spans)
        fd = _lock(layout.lock_path)
        if fd is not None:  # it let go before finishing: this process downloads (and resumes) it
            os.close(fd)
            return open_source(source)
        time.sleep(0.05)
    raise HotstartError(
        f"{source.url}: another hotstart process holds {layout.lock_path} and its download made no "
        f"progress in {FOLLOW_WAIT_S} s"
    )
