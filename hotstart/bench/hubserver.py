"""A model hub on loopback: the HTTP routes the Hugging Face Hub and ModelScope clients use, over local
folders (hubrepo.py), with a bandwidth cap standing in for a network and faults for the retry paths.

Hugging Face (what huggingface_hub's snapshot_download / hf_hub_download send):
  GET  /api/models/{id}[/revision/{rev}][?blobs=true]   model info: sha, siblings (sizes, blobId, lfs)
  GET  /api/models/{id}/tree/{rev}[/{path}][?recursive=true]   files (oid, size, lfs.oid = sha256), folders
  HEAD|GET /{id}/resolve/{rev}/{path}   ETag, X-Repo-Commit, X-Linked-Etag / X-Linked-Size (LFS), Range
  errors: X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound) or X-Error-Message
  ("Invalid credentials in Authorization header") and a JSON {"error": ...}, as the Hub answers them
ModelScope (modelscope / modelscope_hub's legacy /api/v1 surface):
  GET  /api/v1/models/{owner}/{name}                    {"Code": 200, "Data": {...}, "Success": true}
  GET  /api/v1/models/{owner}/{name}/revisions          branches and tags
  GET  /api/v1/models/{owner}/{name}/repo/files?Revision=R&Recursive=True[&Root=DIR]   Data.Files
  GET  /api/v1/models/{owner}/{name}/repo?Revision=R&FilePath=F   the bytes, Range

`python -m hotstart.bench.hubserver --repo ORG/NAME=FOLDER [--cap-mbps 100] [--port P]` runs one (the
benchmark's endpoint); tests start HubServer in their process. Bodies go out with sendfile in 256 KiB
slices, each waiting for its share of the cap (one token bucket for every connection: a link).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from hotstart.bench.hubrepo import Repo, load_repo, tree

SLICE = 256 << 10
_INFO = re.compile(r"^/api/models/(?P<id>[^/]+(?:/[^/]+)?)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<id>[^/]+/[^/]+|[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE = re.compile(r"^/(?P<id>[^/]+/[^/]+|[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_MS = re.compile(r"^/api/v1/models/(?P<id>[^/]+/[^/]+)(?P<rest>/revisions|/repo/files|/repo)?$")


class Link:
    """A token bucket: at most RATE bytes per second across every connection (None: no cap)."""

    def __init__(self, rate: float | None):
        self.rate, self._next, self._lock = rate, 0.0, threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


class HubServer:
    """The server; attributes the tests steer: `fail` (answer that many data GETs with 503), `cut` (send
    half of that many bodies, then close), `stall_s` (hold each data GET), `cdn` (answer LFS resolves
    with a 302 to another host name of this server, as the Hub redirects to its CDN). `log` holds
    [method, path, range, status, had Authorization] per request."""

    def __init__(self, repos: list[Repo], cap_mbps: float | None = None, host: str = "127.0.0.1",
                 port: int = 0, tokens: set[str] | None = None):
        self.repos = {r.repo_id: r for r in repos}
        self.tokens = set(tokens or ()) | {t for r in repos for t in r.granted}
        self.link = Link(cap_mbps * 1e6 if cap_mbps else None)
        self.fail = self.cut = 0
        self.stall_s = 0.0
        self.cdn = False
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.httpd = _Quiet((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self.thread: threading.Thread | None = None

    def start(self) -> HubServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub server", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def requests(self, kind: str = "") -> list[tuple]:
        with self.lock:
            return [e for e in self.log if kind in e[1]]

    def take_fault(self, name: str) -> bool:
        with self.lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
            return left > 0


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that hung up (a killed server)
        pass


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        # ---- answers ------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self._entry[3] = status
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, obj, status: int = 200, headers: dict | None = None, head: bool = False):
            headers = {"Content-Type": "application/json", **(headers or {})}
            self._send(status, json.dumps(obj).encode(), headers, head)

        def _hf_error(self, status: int, code: str | None, message: str, head: bool):
            headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
            self._json({"error": message}, status, headers, head)

        def _ms_error(self, status: int, message: str, head: bool = False):
            self._json({"Code": status, "Message": message, "Success": False,
                        "RequestId": "hubserver"}, status, head=head)

        # ---- access -------------------------------------------------------------------------
        def _token(self) -> str | None:
            auth = self.headers.get("Authorization") or ""
            if auth.lower().startswith("bearer "):
                return auth[7:].strip()
            cookie = self.headers.get("Cookie") or ""
            m = re.search(r"m_session_id=([^;\s]+)", cookie)
            return m.group(1) if m else None

        def _repo(self, repo_id: str, head: bool, data: bool, ms: bool = False) -> Repo | None:
            """The repo if this request may see it (data: its files), else None after an error answer."""
            token = self._token()
            if token is not None and token not in hub.tokens:
                if ms:
                    self._ms_error(401, "AccessToken is invalid or expired", head)
                else:
                    self._hf_error(401, None, "Invalid credentials in Authorization header", head)
                return None
            repo = hub.repos.get(repo_id)
            allowed = repo is not None and (repo.access == "public" or token in repo.granted)
            if repo is None or (repo.access == "private" and not allowed):
                if ms:
                    self._ms_error(404, "Model does not exist", head)
                else:
                    status = 401 if token is None else 404
                    self._hf_error(status, "RepoNotFound", "Repository not found", head)
                return None
            if repo.access == "gated" and data and not allowed:
                if ms:
                    self._ms_error(401 if token is None else 403, "User not logged in" if token is None
                                   else "Permission denied", head)
                elif token is None:
                    msg = (f"Access to model {repo_id} is restricted. You must have access to it and be "
                           "authenticated to access it. Please log in.")
                    self._hf_error(401, "GatedRepo", msg, head)
                else:
                    msg = (f"Access to model {repo_id} is restricted and you are not in the authorized "
                           f"list. Visit {hub.url}/{repo_id} to ask for access.")
                    self._hf_error(403, "GatedRepo", msg, head)
                return None
            return repo

        # ---- routes -------------------------------------------------------------------------
        def _route(self, head: bool):
            # logged (the status too) before the answer is sent: a client that has it finds it in the log
            auth = "Authorization" in self.headers
            self._entry = [self.command, self.path, self.headers.get("Range"), 0, auth]
            with hub.lock:
                hub.log.append(self._entry)
            parts = urlsplit(self.path)
            path, query = unquote(parts.path), parse_qs(parts.query)
            if path.startswith("/_cdn/"):
                self._cdn(path[len("/_cdn/"):], head)
            elif m := _MS.match(path):
                self._modelscope(m["id"], m["rest"] or "", query, head)
            elif m := _TREE.match(path):
                self._tree(m["id"], m["rev"], m["path"] or "", query, head)
            elif m := _INFO.match(path):
                self._info(m["id"], m["rev"] or "main", query, head)
            elif m := _RESOLVE.match(path):
                self._resolve(m["id"], m["rev"], m["path"], head)
            else:
                self._hf_error(404, None, "Not Found", head)

        def _commit(self, repo: Repo, rev: str, head: bool) -> str | None:
            commit = repo.resolve(rev)
            if commit is None:
                self._hf_error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return commit

        def _info(self, repo_id: str, rev: str, query: dict, head: bool):
            if (repo := self._repo(repo_id, head, data=False)) is None:
                return
            if (commit := self._commit(repo, rev, head)) is None:
                return
            blobs = query.get("blobs", [""])[0].lower() in ("1", "true")
            siblings = []
            for f in repo.files.values():
                s = {"rfilename": f.path}
                if blobs:
                    s.update(size=f.size, blobId=f.oid)
                    if f.lfs:
                        s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
                siblings.append(s)
            self._json({"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit,
                        "private": repo.access == "private",
                        "gated": "manual" if repo.access == "gated" else False,
                        "disabled": False, "tags": [], "downloads": 0, "likes": 0,
                        "lastModified": "2026-12-01T00:00:00.000Z", "createdAt": "2026-12-01T00:00:00.000Z",
                        "siblings": siblings}, head=head)

        def _tree(self, repo_id: str, rev: str, sub: str, query: dict, head: bool):
            if (repo := self._repo(repo_id, head, data=False)) is None:
                return
            if self._commit(repo, unquote(rev), head) is None:
                return
            recursive = query.get("recursive", [""])[0].lower() in ("1", "true")
            entries = tree(repo, sub, recursive)
            if sub and not entries:
                self._hf_error(404, "EntryNotFound", f"{sub} does not exist on \"{rev}\"", head)
                return
            self._json(entries, head=head)

        def _resolve(self, repo_id: str, rev: str, path: str, head: bool):
            if (repo := self._repo(repo_id, head, data=True)) is None:
                return
            if (commit := self._commit(repo, rev, head)) is None:
                return
            f = repo.files.get(path)
            if f is None:
                self._hf_error(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"", head)
                return
            headers = {"X-Repo-Commit": commit, "ETag": f'"{f.oid}"', "Accept-Ranges": "bytes"}
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
                if hub.cdn:
                    host = "localhost" if self.headers.get("Host", "").startswith("127.") else "127.0.0.1"
                    headers["Location"] = f"http://{host}:{hub.port}/_cdn/{repo_id}/{path}"
                    self._send(302, b"", headers, head)
                    return
            self._file(repo, f, headers, head)

        def _cdn(self, rest: str, head: bool):
            for repo_id, repo in hub.repos.items():
                if rest.startswith(repo_id + "/") and (f := repo.files.get(rest[len(repo_id) + 1:])):
                    self._file(repo, f, {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}, head)
                    return
            self._send(404, b"NoSuchKey", head=head)

        def _modelscope(self, repo_id: str, rest: str, query: dict, head: bool):
            data = rest == "/repo"
            if (repo := self._repo(repo_id, head, data=data, ms=True)) is None:
                return
            rev = query.get("Revision", ["master"])[0] or "master"
            if rest and rest != "/revisions" and repo.resolve(rev) is None:
                self._ms_error(404, f"Revision {rev} does not exist", head)
                return
            ok = lambda d: self._json({"Code": 200, "Data": d, "Message": "success", "Success": True,  # noqa: E731
                                       "RequestId": "hubserver"}, head=head)
            if rest == "":
                ok({"Id": 1, "Name": repo_id.split("/")[1], "Path": repo_id.split("/")[0],
                    "ChineseName": "", "Visibility": 1 if repo.access == "private" else 5})
            elif rest == "/revisions":
                branches = [{"Revision": n, "CommitId": c} for n, c in repo.revisions.items() if n != "main"]
                ok({"RevisionMap": {"Branches": branches, "Tags": []}})
            elif rest == "/repo/files":
                root = (query.get("Root", [""])[0] or "").strip("/")
                recursive = query.get("Recursive", ["False"])[0].lower() in ("1", "true")
                files = [{"Name": e["path"].rsplit("/", 1)[-1], "Path": e["path"], "Type":
                          "blob" if e["type"] == "file" else "tree", "Size": e["size"],
                          "Sha256": repo.files[e["path"]].sha256 if e["type"] == "file" else "",
                          "IsLFS": bool(e.get("lfs")), "Revision": repo.resolve(rev)}
                         for e in tree(repo, root, recursive)]
                ok({"Files": files})
            else:
                f = repo.files.get(query.get("FilePath", [""])[0])
                if f is None:
                    self._ms_error(404, "File does not exist", head)
                    return
                self._file(repo, f, {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}, head)

        # ---- bodies -------------------------------------------------------------------------
        def _file(self, repo: Repo, f, headers: dict, head: bool):
            start, end = 0, f.size  # [start, end)
            status = 200
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())) and f.size:
                a, b = m.groups()
                if a:
                    start, end = int(a), min(f.size, int(b) + 1) if b else f.size
                else:
                    start, end = f.size - int(b), f.size
                if start >= f.size or start >= end:
                    self._send(416, b"", {"Content-Range": f"bytes */{f.size}"}, head)
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
            if not head:
                if hub.stall_s:
                    time.sleep(hub.stall_s)
                if hub.take_fault("fail"):
                    self._send(503, b'{"error": "injected"}', {"Content-Type": "application/json"})
                    return
            cut = not head and hub.take_fault("cut")
            self._entry[3] = status
            self.send_response(status)
            for k, v in {"Content-Type": "application/octet-stream", **headers}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(end - start))
            if cut:
                self.send_header("Connection", "close")
            self.end_headers()
            if head:
                return
            self.wfile.flush()
            stop = start + (end - start) // 2 if cut else end
            with open(repo.folder / f.path, "rb") as src:
                pos = start
                while pos < stop:
                    n = min(SLICE, stop - pos)
                    hub.link.take(n)
                    sent = self.connection.sendfile(src, pos, n)
                    if not sent:
                        break
                    pos += sent
            if cut:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hotstart.bench.hubserver", description=__doc__.split("\n")[0])
    p.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=FOLDER")
    p.add_argument("--cap-mbps", type=float, default=None, help="bandwidth cap in MB/s (all connections)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--hash-memo", default=None, help="JSON file remembering file hashes between runs")
    args = p.parse_args(argv)
    memo = Path(args.hash_memo) if args.hash_memo else None
    repos = [load_repo(*spec.split("=", 1), memo_path=memo) for spec in args.repo]
    hub = HubServer(repos, args.cap_mbps, args.host, args.port)
    print(json.dumps({"url": hub.url, "repos": {r.repo_id: r.commit for r in repos}}), flush=True)
    try:
        hub.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
