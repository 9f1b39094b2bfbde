"""The ModelScope backend of the download pipeline (`modelscope://ORG/NAME`, or any hub id with
VLLM_USE_MODELSCOPE=true), and ModelScope's own cache layout.

Requests (modelscope's /api/v1 surface; MODELSCOPE_ENDPOINT, else MODELSCOPE_DOMAIN, else
https://modelscope.cn, or https://www.modelscope.ai with MODELSCOPE_PREFER_AI_SITE):
  GET /api/v1/models/{id}/repo/files?Revision={rev}&Recursive=False   the root's files: Size, Sha256
  GET /api/v1/models/{id}/repo?Revision={rev}&FilePath={file}         ranged
Token: MODELSCOPE_API_TOKEN, sent as `Authorization: Bearer` and as the `m_session_id` cookie, as
modelscope sends it (its saved login is a pickled cookie jar: hotstart never unpickles anything).

Cache (modelscope >= 1.38): {MODELSCOPE_CACHE}/models/{org}--{name}/snapshots/{revision}/{file}, plain
files, or the folder of an older modelscope when one exists (it reuses that too). ModelScope records no
commits: a copy counts as current when every listed file is there at its listed size and, where
hotstart fetched it, its listed sha256 ($HOTSTART_HOME/hub/modelscope/{org}--{name}@{rev}.json).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import quote

from hotstart.boot import hubcache
from hotstart.boot.remote import hubhttp
from hotstart.boot.remote.hfhub import EXTRA_SIDECARS
from hotstart.boot.remote.snapshot import RemoteObject
from hotstart.boot.remote.source import FolderLayout, Listing, StoreError, have, model_complete
from hotstart.diskio import write_atomic
from hotstart.errors import HotstartError
from hotstart.system import hotstart_home


def ms_endpoint() -> str:
    if (value := os.environ.get("MODELSCOPE_ENDPOINT", "").strip()):
        return value.rstrip("/") if "://" in value else f"https://{value.rstrip('/')}"
    if (domain := os.environ.get("MODELSCOPE_DOMAIN", "").strip()):
        return domain.rstrip("/") if "://" in domain else f"https://{domain.rstrip('/')}"
    return "https://www.modelscope.ai" if hubcache.env_true("MODELSCOPE_PREFER_AI_SITE") else "https://modelscope.cn"


class MsLayout(FolderLayout):
    def __init__(self, snap: Path, record: Path):
        super().__init__(snap, record.with_suffix(".lock"))
        self.record = record

    def _recorded(self) -> dict:
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}

    def have(self, obj: RemoteObject) -> bool:
        """There at its size, and not recorded by hotstart with another sha256 (the branch moved)."""
        seen = self._recorded().get(obj.name)
        return have(self.snap / obj.name, obj.size) and (not seen or not obj.sha256 or seen == obj.sha256)

    def complete(self, sidecars, weights) -> bool:
        return all(self.have(o) for o in sidecars + weights)

    def finish(self, objects) -> None:
        body = {**self._recorded(), **{o.name: o.sha256 for o in objects if o.sha256}}
        self.record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.record, json.dumps(body, indent=1).encode())


class MsSource:
    kind = "modelscope"
    extra_sidecars = EXTRA_SIDECARS
    place = "at the repository's root"

    def __init__(self, repo_id: str, revision: str | None):
        self.repo_id, self.revision = repo_id, revision or "master"
        self.name = repo_id
        self.endpoint = ms_endpoint()
        self.token = os.environ.get("MODELSCOPE_API_TOKEN", "").strip() or None
        self.headers = ({"Authorization": f"Bearer {self.token}", "Cookie": f"m_session_id={self.token}"}
                        if self.token else {})
        self.url = f"modelscope://{repo_id}" + (f" (revision {self.revision})" if revision else "")
        legacy = hubcache.modelscope_legacy(repo_id)
        self.snap = legacy or hubcache.modelscope_snapshot(repo_id, self.revision)
        safe = repo_id.replace("/", "--")
        self.record = hotstart_home() / "hub" / "modelscope" / f"{safe}@{quote(self.revision, safe='')}.json"
        self._stores: dict = {}
        self._names: list[str] = []

    def describe_http(self, status: int, headers, body: bytes) -> str:
        try:
            message = str(json.loads(body).get("Message") or "")[:200]
        except (ValueError, AttributeError):
            message = ""
        if status == 404 and "revision" in message.lower():
            return f"revision '{self.revision}' was not found on {self.endpoint} ({message})"
        if status == 404:
            return (f"not found on {self.endpoint} ({message or 'no such model'}); if it is private, set "
                    "MODELSCOPE_API_TOKEN to a token that can read it")
        if status == 401:
            return (f"{self.endpoint} wants a valid token ({message or 'unauthorized'}): set "
                    "MODELSCOPE_API_TOKEN" + (" to a valid one" if self.token else ""))
        if status == 403:
            return f"access denied by {self.endpoint} ({message or 'forbidden'}): the token has no access"
        return f"HTTP {status}{': ' + message if message else ''} from {self.endpoint}"

    def list(self) -> Listing:
        q = f"Revision={quote(self.revision, safe='')}&Recursive=False"
        body = hubhttp.get_json(f"{self.endpoint}/api/v1/models/{self.repo_id}/repo/files?{q}", self.headers,
                                f"model '{self.repo_id}' (ModelScope)", retries=hubhttp.RETRIES,
                                describe=self.describe_http)
        data = body.get("Data") if isinstance(body, dict) else None
        files = data.get("Files") if isinstance(data, dict) else None
        if not isinstance(files, list):
            raise StoreError(f"model '{self.repo_id}': {self.endpoint} answered the file listing without "
                             f"Data.Files ({str(body)[:200]})")
        objects = []
        for f in files:
            path = str(f.get("Path") or f.get("Name") or "") if isinstance(f, dict) else ""
            if not path or "/" in path or (f.get("Type") or "blob") != "blob":
                continue
            sha = str(f.get("Sha256") or "").lower() or None
            if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise StoreError(f"model '{self.repo_id}': {self.endpoint} listed {path!r} with an invalid "
                                 f"Sha256 {sha[:80]!r}")
            objects.append(RemoteObject(path, int(f.get("Size") or 0), sha or "", sha256=sha))
        self._names = [o.name for o in objects]
        return Listing(objects, self.revision, f"revision {self.revision}: {len(objects)} files")

    def layout(self, listing: Listing, sidecars, tensors) -> MsLayout:
        return MsLayout(self.snap, self.record)

    def cached(self) -> Path | None:
        return self.snap if self.snap.is_dir() and model_complete(self.snap) is None else None

    def where_cached(self) -> str:
        return str(self.snap)

    def open(self) -> None:
        """A store per file: the file is named in the query, and obstore would escape a '?' in a path."""
        import obstore  # noqa: PLC0415 - on the main thread: the download threads only call it

        self._get = obstore.get
        for name in self._names:
            query = f"Revision={quote(self.revision, safe='')}&FilePath={quote(name, safe='')}"
            url = f"{self.endpoint}/api/v1/models/{self.repo_id}/repo?{query}"
            self._stores[name] = hubhttp.open_http_store(url, self.headers, exact=True)

    def get_range(self, obj: RemoteObject, start: int, end: int):
        try:
            return self._get(self._stores[obj.name], "", options={"range": (start, end)}).bytes()
        except Exception as e:  # noqa: BLE001 - obstore's errors, already retried where transient
            status = hubhttp.status_of(e)
            raise StoreError(f"{self.url}/{obj.name}: {f'HTTP {status}' if status else 'cannot reach it'}"
                             " (after retries)", status) from None

    def explain(self, e: HotstartError) -> HotstartError:
        return e

    def integrity_error(self, e) -> bool:
        return False

    def fallback_on(self, e: StoreError) -> bool:
        return e.status in (401, 403)
