"""The s3:// backend of the download pipeline: obstore's S3 client (store.py), the $HOTSTART_HOME/s3/ cache
(snapshot.py: one folder per listing state, complete once its manifest is written)."""

from __future__ import annotations

from pathlib import Path

from hotstart.boot.remote import snapshot
from hotstart.boot.remote import store as s3
from hotstart.boot.remote.snapshot import RemoteObject
from hotstart.boot.remote.source import FolderLayout, Listing
from hotstart.boot.remote.url import RemoteSpec
from hotstart.errors import HotstartError

LIST_RETRIES, LIST_RETRY_TIMEOUT_S = 2, 10


class S3Layout(FolderLayout):
    def __init__(self, source: S3Source, snap: Path):
        super().__init__(snap, Path(f"{snap}.lock"))
        self.source = source

    def prepare(self) -> None:
        super().prepare()
        snapshot.describe_location(self.snap.parent, self.source.spec, self.source.endpoint)

    def complete(self, sidecars, weights) -> bool:
        return snapshot.complete(self.snap) is not None

    def finish(self, objects: list[RemoteObject]) -> None:
        snapshot.write_manifest(self.snap, self.source.spec, self.source.endpoint, objects)


class S3Source:
    kind = "s3"
    extra_sidecars: tuple[str, ...] = ()
    place = "under this prefix"

    def __init__(self, spec: RemoteSpec, home: Path):
        self.spec = spec
        self.url, self.name = spec.url, spec.name
        self.list_store, self.endpoint, self.how = s3.open_store(
            spec.bucket, retries=LIST_RETRIES, retry_timeout_s=LIST_RETRY_TIMEOUT_S)
        self.loc = snapshot.location_dir(home, self.endpoint, spec)
        self._store = None

    def list(self) -> Listing:
        try:
            listing = s3.list_prefix(self.list_store, self.spec.prefix)
        except Exception as e:  # noqa: BLE001 - obstore's errors, as one line
            raise s3.describe(e, f"listing {self.url}", self.endpoint) from None
        objects = [RemoteObject(o["name"], o["size"], o["etag"]) for o in listing]
        return Listing(objects, "", f"{len(objects)} objects, credentials: {self.how}")

    def layout(self, listing: Listing, sidecars, tensors) -> S3Layout:
        return S3Layout(self, self.loc / snapshot.snapshot_key(sidecars, tensors))

    def cached(self) -> Path | None:
        return snapshot.current_snapshot(self.loc)

    def where_cached(self) -> str:
        return str(self.loc)

    def open(self) -> None:
        """The store the downloads use (full retries), made on the caller's thread."""
        self._store, _, _ = s3.open_store(self.spec.bucket)

    def get_range(self, obj: RemoteObject, start: int, end: int):
        try:
            return s3.get_range(self._store, self.spec.key(obj.name), start, end, obj.etag)
        except Exception as e:  # noqa: BLE001 - obstore's errors, already retried where transient
            raise s3.describe(e, f"{self.url}/{obj.name}", self.endpoint) from None

    def explain(self, e: HotstartError) -> HotstartError:
        return e

    def fallback_on(self, e) -> bool:
        return False  # a 403 or 404 is an error, never a fallback

    def integrity_error(self, e) -> bool:
        """A failure that makes the bytes written so far suspect (the object changed: 412)."""
        return e.status == 412
