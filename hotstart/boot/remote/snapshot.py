"""What to download from a prefix, in which order, and where it lives in the local cache.

Cache layout, under $HOTSTART_HOME/s3/:
  LOC/            one per (endpoint, bucket, prefix): LOC = sha256 of the three, 16 hex digits
    location.json the endpoint, bucket and prefix (for people)
    current       the name of the last complete snapshot (what an offline start serves)
    SNAP/         one per listing state: SNAP = sha256 of the selected objects' names, sizes and ETags
      config.json, tokenizer.json, ...   sidecars, each written to a temp name and renamed
      model-0000N-of-0000M.safetensors   weights; while downloading NAME.partial + NAME.arrival
      .hotstart-s3.json                  the manifest, written last: the snapshot is complete
    SNAP.lock     held (flock) by the process downloading SNAP
A changed object (new ETag or size) makes a new SNAP; nothing but a manifest marks a snapshot complete.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from hotstart import diskio
from hotstart.boot.remote.url import RemoteSpec
from hotstart.errors import HotstartError
from hotstart.model.files import SIDECAR_NAMES

MANIFEST = ".hotstart-s3.json"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class RemoteObject:
    """A file of a remote model. ETAG: what pins its version (S3's ETag; a hub's blob id: the LFS sha256
    or the git blob sha1). SHA256 / GIT_OID: the digests it is checked against before it counts as
    complete (hubs give them; S3 does not)."""

    name: str  # file name under the prefix or repository root (no '/')
    size: int
    etag: str
    sha256: str | None = None
    git_oid: str | None = None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def location_dir(home: Path, endpoint: str, spec: RemoteSpec) -> Path:
    return home / "s3" / _sha(json.dumps([endpoint, spec.bucket, spec.prefix]))


def candidates(
    where: str, objects: list[RemoteObject], endpoint: str, *, place: str = "under this prefix",
    extra: tuple[str, ...] = (),
) -> tuple[list[RemoteObject], list[RemoteObject]]:
    """(sidecars, safetensors files) among OBJECTS (the files at the model's root; EXTRA: more sidecar
    names worth fetching); HotstartError naming WHERE for a place without a model."""
    if not objects:
        raise HotstartError(f"{where}: no objects {place} (endpoint {endpoint})")
    by_name = {o.name: o for o in objects if o.name not in ("", ".", "..") and not set(o.name) & {"/", "\0"}}
    if "config.json" not in by_name:
        shown = ", ".join(sorted(by_name)[:5]) + (", ..." if len(by_name) > 5 else "")
        raise HotstartError(f"{where}: no config.json {place} (found: {shown})")
    sidecars = [by_name[n] for n in (*SIDECAR_NAMES, *extra) if n in by_name]
    tensors = sorted((o for n, o in by_name.items() if n.endswith(".safetensors")), key=lambda o: o.name)
    if not tensors:
        other = sorted(n for n in by_name if n.endswith((".bin", ".pt", ".pth", ".gguf")))[:3]
        hint = (f" (found {', '.join(other)}: hotstart loads safetensors only, never pickle or GGUF from a "
                "remote store)") if other else ""
        raise HotstartError(f"{where}: no safetensors weights {place}{hint}")
    return sidecars, tensors


def snapshot_key(sidecars: list[RemoteObject], tensors: list[RemoteObject]) -> str:
    return _sha(json.dumps([[o.name, o.size, o.etag] for o in sidecars + tensors]))


def weight_order(where: str, tensors: list[RemoteObject], index_text: str | None) -> list[RemoteObject]:
    """The weights in the engine's load order (hotstart.model.files.weight_files' rules): the index's
    shards sorted, else model.safetensors, else every *.safetensors by name. HotstartError if the
    index names a shard the listing lacks."""
    by_name = {o.name: o for o in tensors}
    if index_text is not None:
        try:
            data = json.loads(index_text)
        except ValueError as e:
            raise HotstartError(f"{where}/{INDEX}: invalid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HotstartError(f"{where}/{INDEX}: has no weight_map")
        names = sorted(set(map(str, weight_map.values())))
        missing = [n for n in names if n not in by_name]
        if missing:
            raise HotstartError(
                f"{where}/{INDEX} names shard {missing[0]}, which the listing of {where} does not have"
            )
        return [by_name[n] for n in names]
    if "model.safetensors" in by_name:
        return [by_name["model.safetensors"]]
    return sorted(tensors, key=lambda o: o.name)


def header_size_check(url: str, obj: RemoteObject, head: bytes) -> int | None:
    """Bytes of the safetensors header (8 + its length) if HEAD holds all of it and it agrees with the
    listed size, None if HEAD is too short to tell; HotstartError if they disagree."""
    where = f"{url}/{obj.name}"
    if len(head) < 8:
        return None
    n = int.from_bytes(head[:8], "little")
    if obj.size < 8 + n or n > 100 * 1024 * 1024:
        raise HotstartError(
            f"{where}: its safetensors header length ({n}) does not fit in the {obj.size} "
            "bytes the listing gives (a truncated or corrupt object)"
        )
    if len(head) < 8 + n:
        return None
    try:
        meta = json.loads(bytes(head[8 : 8 + n]))
        ends = [v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError):
        raise HotstartError(f"{where}: corrupt safetensors header") from None
    described = 8 + n + max(ends, default=0)
    if described != obj.size:
        what = "a truncated object" if described > obj.size else "trailing bytes"
        raise HotstartError(
            f"{where}: the listing gives {obj.size} bytes but its safetensors header "
            f"describes {described} ({what})"
        )
    return 8 + n


def write_atomic(path: Path, data: bytes) -> None:
    """Temp name, fsync, rename, folder fsync; a failed write (a full disk) leaves no temp file."""
    diskio.write_atomic(path, data)


def write_manifest(snap: Path, spec: RemoteSpec, endpoint: str, objects: list[RemoteObject]) -> None:
    """Mark SNAP complete (after every file is in place), and make it the location's current one."""
    body = {
        "url": spec.url,
        "endpoint": endpoint,
        "completed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "objects": [{"name": o.name, "size": o.size, "etag": o.etag} for o in objects],
    }
    write_atomic(snap / MANIFEST, json.dumps(body, indent=1).encode())
    write_atomic(snap.parent / "current", snap.name.encode())


def complete(snap: Path) -> list[RemoteObject] | None:
    """The objects of a complete snapshot whose files are all there at their sizes, else None."""
    try:
        body = json.loads((snap / MANIFEST).read_text())
        objects = [RemoteObject(o["name"], int(o["size"]), str(o["etag"])) for o in body["objects"]]
        for o in objects:
            if (snap / o.name).stat().st_size != o.size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return objects


def current_snapshot(loc: Path) -> Path | None:
    """The last complete snapshot of a location (what an offline start may serve), or None."""
    try:
        snap = loc / (loc / "current").read_text().strip()
    except OSError:
        return None
    return snap if snap.name and complete(snap) is not None else None


def describe_location(loc: Path, spec: RemoteSpec, endpoint: str) -> None:
    if not (loc / "location.json").exists():
        where = {"endpoint": endpoint, "bucket": spec.bucket, "prefix": spec.prefix}
        write_atomic(loc / "location.json", json.dumps(where).encode())
