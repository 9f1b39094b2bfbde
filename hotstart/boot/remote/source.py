"""What the one download pipeline (session.py, download.py) asks of a store, and where files land.

A Source is one store's small backend: s3 (s3source.py), the Hugging Face Hub (hfhub.py), ModelScope
(mshub.py). It lists the model's root (`list`), GETs byte ranges of one file (`get_range`, from any
thread: obstore's Rust client), turns a failure into one line (`describe`), and knows the last complete
local copy (`cached`, what an unreachable store falls back to). A Layout is where one listing's files
land in that store's own cache: sidecars written whole (`write`), weights renamed into place when
complete and verified (`place`), and the mark that makes the copy count (`finish`). Partial files are
always NAME.partial + NAME.arrival inside `snap` (hotstart/model/arrival.py): never a final name.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hotstart import diskio
from hotstart.boot.remote.snapshot import RemoteObject
from hotstart.errors import HotstartError, WeightsError
from hotstart.model import arrival


class StoreError(HotstartError):
    """A failed request: `status` is its HTTP status when the store answered (else None), `code` the
    store's error code (S3's <Code>, the Hub's X-Error-Code)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code

    @property
    def unreachable(self) -> bool:
        """No answer, or a server error after retries: the case a cached copy may stand in for."""
        return self.status is None or self.status >= 500 or self.status == 429


@dataclass
class Listing:
    """A store's answer: the files at the model's root, and KEY, what names this state of them (S3: a
    hash of names, sizes and ETags; the Hub: the commit)."""

    objects: list[RemoteObject]
    key: str
    detail: str = ""
    cached: Path | None = None  # the store named a state whose local copy is complete: serve it as is


def have(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def model_complete(folder: Path) -> str | None:
    """None if FOLDER holds a servable model (config.json, every weight file the loader would read, no
    download in progress), else what is missing. The offline test of a cache entry nobody listed."""
    from hotstart.model.files import weight_files  # noqa: PLC0415 - stdlib only

    if not (folder / "config.json").is_file():
        return "no config.json"
    try:
        files = weight_files(folder)
    except WeightsError as e:
        return str(e)
    for f in files:
        if not f.is_file() or arrival.arriving(f):
            return f"{f.name} is not complete"
    return None


class FolderLayout:
    """Files renamed into one folder, complete once FINISH writes its mark (S3's snapshots; ModelScope's
    snapshots/REV). Subclasses say what the mark is."""

    def __init__(self, snap: Path, lock_path: Path):
        self.snap, self.lock_path = snap, lock_path

    def prepare(self) -> None:
        self.snap.mkdir(parents=True, exist_ok=True)

    def have(self, obj: RemoteObject) -> bool:
        return have(self.snap / obj.name, obj.size)

    def write(self, obj: RemoteObject, data: bytes) -> None:
        diskio.write_atomic(self.snap / obj.name, data)

    def place(self, obj: RemoteObject, partial: Path) -> None:
        os.replace(partial, self.snap / obj.name)

    def complete(self, sidecars: list[RemoteObject], weights: list[RemoteObject] | None) -> bool:
        raise NotImplementedError

    def finish(self, objects: list[RemoteObject]) -> None:
        raise NotImplementedError


def free_space_check(snap: Path, needed: int) -> None:
    """HotstartError if SNAP's filesystem cannot hold NEEDED more bytes."""
    free = shutil.disk_usage(snap).free
    if free < needed:
        raise HotstartError(
            f"not enough disk space for the download in {snap}: {needed / 1e9:.2f} GB "
            "needed, "
            f"{free / 1e9:.2f} GB free (set HOTSTART_HOME to a larger disk)"
        )
