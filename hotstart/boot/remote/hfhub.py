"""The Hugging Face Hub backend of the download pipeline, and the standard cache layout it fills.

Requests (the routes huggingface_hub uses; HF_ENDPOINT, default https://huggingface.co):
  GET /api/models/{id}/revision/{rev}   -> the commit (skipped when REV is one: a commit never changes)
  GET /api/models/{id}/tree/{commit}    -> the root's files: size, git blob id, LFS sha256
  GET /{id}/resolve/{commit}/{file}     ranged, the commit pinned in the URL (obstore; redirects to the
                                        Hub's CDN followed without the token)
Token, as huggingface_hub finds it: HF_TOKEN, HUGGING_FACE_HUB_TOKEN, else the file HF_TOKEN_PATH
(default $HF_HOME/token); none with HF_HUB_DISABLE_IMPLICIT_TOKEN. Sent as `Authorization: Bearer` to
the endpoint only; never logged.

Cache (huggingface_hub's layout, so it, transformers and vLLM find the files offline afterwards):
  models--{org}--{name}/blobs/{etag}        the bytes; etag = LFS sha256, else the git blob id
  models--{org}--{name}/snapshots/{commit}/{file} -> ../../blobs/{etag}   a relative symlink
  models--{org}--{name}/refs/{revision}     the commit, written once every needed file is in place
While downloading, a weight file is snapshots/{commit}/{file}.partial + .arrival; verified, it is
renamed to its blob after its link is made, so a final name never points at partial bytes. No
trees/{commit}.json is written: it would list files hotstart never fetches (original/, *.bin), and
huggingface_hub 2.x would then call the snapshot incomplete offline.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote

from hotstart.boot import hubcache
from hotstart.boot.remote import hubhttp
from hotstart.boot.remote.snapshot import RemoteObject
from hotstart.boot.remote.source import Listing, StoreError, have, model_complete
from hotstart.diskio import write_atomic
from hotstart.errors import HotstartError

COMMIT = re.compile(r"^[0-9a-f]{40}$")
GIT_OID, SHA256 = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$"), re.compile(r"^[0-9a-f]{64}$")
# beyond the loader's sidecars: what transformers' and vLLM's tokenizers read from a model folder
EXTRA_SIDECARS = ("chat_template.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")
CHECK_RETRIES, CHECK_TIMEOUT_S = 1, 5  # the revision request when a cached copy may stand in: fail fast


def hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hf_token() -> tuple[str | None, str]:
    """(token or None, where it came from, for messages)."""
    if hubcache.env_true("HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        return None, "nowhere (HF_HUB_DISABLE_IMPLICIT_TOKEN)"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if (value := os.environ.get(var, "").strip()):
            return value, var
    path = Path(os.path.expandvars(os.environ.get("HF_TOKEN_PATH") or str(hubcache.hf_home() / "token")))
    try:
        value = path.expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None, "nowhere"
    return (value or None), f"the token file {path}"


class HfLayout:
    def __init__(self, repo_dir: Path, commit: str, revision: str):
        self.repo_dir, self.commit, self.revision = repo_dir, commit, revision
        self.snap = repo_dir / "snapshots" / commit
        self.blobs = repo_dir / "blobs"
        self.lock_path = repo_dir.parent / ".locks" / repo_dir.name / f"hotstart-{commit}.lock"

    def prepare(self) -> None:
        self.snap.mkdir(parents=True, exist_ok=True)
        self.blobs.mkdir(parents=True, exist_ok=True)

    def _link(self, obj: RemoteObject) -> None:
        """snapshots/{commit}/{name} -> ../../blobs/{etag}, made under a temp name and renamed over."""
        link = self.snap / obj.name
        tmp = self.snap / f".{obj.name}.link{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("../../blobs") / obj.etag, tmp)
        os.replace(tmp, link)

    def have(self, obj: RemoteObject) -> bool:
        """In place; a blob another revision shares is linked now."""
        if have(self.snap / obj.name, obj.size):
            return True
        if obj.etag and have(self.blobs / obj.etag, obj.size):
            try:
                self.snap.mkdir(parents=True, exist_ok=True)
                self._link(obj)
                return True
            except OSError:
                return False
        return False

    def write(self, obj: RemoteObject, data: bytes) -> None:
        write_atomic(self.blobs / obj.etag, data)
        self._link(obj)

    def place(self, obj: RemoteObject, partial: Path) -> None:
        self._link(obj)  # dangling until the rename below: never a link to partial bytes
        os.replace(partial, self.blobs / obj.etag)

    def complete(self, sidecars, weights) -> bool:
        return all(self.have(o) for o in sidecars + weights)

    def finish(self, objects) -> None:
        write_ref(self.repo_dir, self.revision, self.commit)


def write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    """refs/{revision} = commit (as huggingface_hub writes it: no newline), unless REVISION is a commit."""
    if revision == commit or COMMIT.match(revision):
        return
    ref = repo_dir / "refs" / revision
    try:
        if ref.read_text() == commit:
            return
    except OSError:
        pass
    ref.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(ref, commit.encode())


def cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The complete snapshot REVISION names in the local cache (refs/{revision}, or the commit), else None."""
    repo_dir = hubcache.hf_repo_dir(repo_id)
    commit = revision
    try:
        commit = (repo_dir / "refs" / revision).read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    snap = repo_dir / "snapshots" / commit
    return snap if commit and snap.is_dir() and model_complete(snap) is None else None


class HfSource:
    kind = "hf"
    extra_sidecars = EXTRA_SIDECARS
    place = "at the repository's root"

    def __init__(self, repo_id: str, revision: str | None):
        self.repo_id, self.revision = repo_id, revision or "main"
        self.name = repo_id
        self.endpoint = hf_endpoint()
        self.token, self.token_from = hf_token()
        self.headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.url = f"{self.endpoint}/{repo_id}" + (f" (revision {self.revision})" if revision else "")
        self.repo_dir = hubcache.hf_repo_dir(repo_id)
        self.commit: str | None = None
        self._store = None

    # ---- listing -------------------------------------------------------------------------------
    def _what(self) -> str:
        return f"model '{self.repo_id}'"

    def describe_http(self, status: int, headers, body: bytes) -> str:
        """The Hub's error for people (its X-Error-Code / X-Error-Message, as huggingface_hub reads them)."""
        code, message = headers.get("X-Error-Code"), headers.get("X-Error-Message") or ""
        page = f"{self.endpoint}/{self.repo_id}"
        if code == "RevisionNotFound":
            return (f"revision '{self.revision}' was not found on {self.endpoint} (give a branch, tag or "
                    "commit of the repository)")
        if message == "Invalid credentials in Authorization header":
            return (f"{self.endpoint} rejected the token from {self.token_from} (invalid credentials): fix "
                    "or unset it")
        if code == "GatedRepo":
            if self.token is None:
                return (f"the repository is gated: set HF_TOKEN (or run `hf auth login`) to a token of an "
                        f"account that was granted access at {page}")
            return (f"the repository is gated and the token from {self.token_from} has no access: ask "
                    f"at {page}")
        if code == "RepoNotFound" or status in (401, 404):
            if self.token is None:
                return (f"not found on {self.endpoint}; if it is private or gated, set HF_TOKEN (or run "
                        "`hf auth login`) to a token that can read it")
            return (f"not found on {self.endpoint} (check the id; the token from {self.token_from} cannot "
                    "see it)")
        if status == 403:
            return f"access denied by {self.endpoint} (HTTP 403{': ' + message if message else ''})"
        return f"HTTP {status}{': ' + message[:200] if message else ''} from {self.endpoint}"

    def _get(self, path: str, retries: int, timeout_s: float = 10):
        return hubhttp.get_json(f"{self.endpoint}{path}", self.headers, self._what(), retries=retries,
                                timeout_s=timeout_s, describe=self.describe_http)

    def list(self) -> Listing:
        rid = self.repo_id
        commit = self.revision if COMMIT.match(self.revision) else None
        if commit is None:
            has_copy = cached_snapshot(rid, self.revision) is not None
            info = self._get(f"/api/models/{rid}/revision/{quote(self.revision, safe='')}",
                             *((CHECK_RETRIES, CHECK_TIMEOUT_S) if has_copy else (hubhttp.RETRIES,)))
            commit = info.get("sha") if isinstance(info, dict) else None
            if not isinstance(commit, str) or not COMMIT.match(commit):
                raise StoreError(f"{self._what()}: {self.endpoint} gave no commit for revision "
                                 f"'{self.revision}'")
        self.commit = commit
        snap = self.repo_dir / "snapshots" / commit
        if snap.is_dir() and model_complete(snap) is None:
            try:
                write_ref(self.repo_dir, self.revision, commit)
            except OSError:
                pass
            return Listing([], commit, f"revision {self.revision}: commit {commit[:12]}, cached", cached=snap)
        entries = self._get(f"/api/models/{rid}/tree/{commit}", hubhttp.RETRIES)
        if not isinstance(entries, list):
            raise StoreError(f"{self._what()}: {self.endpoint} answered the file listing with no list")
        objects = []
        for e in entries:
            if not isinstance(e, dict) or e.get("type") != "file" or "/" in str(e.get("path", "")):
                continue
            lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else None
            sha256 = str(lfs.get("oid") or "").lower() if lfs else None
            oid = str(e.get("oid") or "").lower()
            digest = sha256 if lfs else oid  # also the blob's file name: hex only, never a path
            if not (SHA256.match(digest) if lfs else GIT_OID.match(digest)):
                raise StoreError(f"{self._what()}: {self.endpoint} listed {e.get('path')!r} with an invalid "
                                 f"digest {digest[:80]!r}")
            objects.append(RemoteObject(str(e["path"]), int(e.get("size") or 0), digest,
                                        sha256=sha256, git_oid=None if lfs else oid))
        detail = f"revision {self.revision}: commit {commit[:12]}, {len(objects)} files"
        return Listing(objects, commit, f"{detail}, token from {self.token_from}")

    def layout(self, listing: Listing, sidecars, tensors) -> HfLayout:
        return HfLayout(self.repo_dir, listing.key, self.revision)

    def cached(self) -> Path | None:
        return cached_snapshot(self.repo_id, self.revision)

    def where_cached(self) -> str:
        return f"{self.repo_dir} (revision '{self.revision}')"

    # ---- bytes ---------------------------------------------------------------------------------
    def open(self) -> None:
        import obstore  # noqa: PLC0415 - on the main thread: the download threads only call it

        self._obget = obstore.get
        self._store = hubhttp.open_http_store(self.endpoint, self.headers)

    def get_range(self, obj: RemoteObject, start: int, end: int):
        path = f"{self.repo_id}/resolve/{self.commit}/{obj.name}"
        try:
            return self._obget(self._store, path, options={"range": (start, end)}).bytes()
        except Exception as e:  # noqa: BLE001 - obstore's errors, already retried where transient
            status = hubhttp.status_of(e)
            reason = f"HTTP {status}" if status else ("timed out" if "timed out" in str(e).lower()
                                                      else "cannot reach it")
            raise StoreError(f"{self.url}/{obj.name}: {reason} (after retries)", status) from None

    def explain(self, e: HotstartError) -> HotstartError:
        """A 401/403/404 on a file (obstore does not give the headers): asked once more, here, for the
        Hub's reason (a gated repository answers its listing but not its files)."""
        if not isinstance(e, StoreError) or e.status not in (401, 403, 404):
            return e
        try:
            self._get(f"/{self.repo_id}/resolve/{self.commit}/config.json", 0)
        except StoreError as better:
            return better
        return e

    def integrity_error(self, e) -> bool:
        return False

    def fallback_on(self, e: StoreError) -> bool:
        """As huggingface_hub: an HTTP error other than an unknown revision lets a complete cached copy
        stand in (with a warning line naming it)."""
        return e.code != "RevisionNotFound" and e.status in (401, 403, 404)
