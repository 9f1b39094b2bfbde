"""Who may reach the server (torch-free): the rules the gate (server/gate.py) applies before the API key.

A keyless server (the default) serves this machine's users, so a web page must not reach it through them:
- Host: a name that is not this machine's is refused (DNS rebinding: a page of evil.example re-resolved to
  127.0.0.1 sends `Host: evil.example`), unless --allowed-hosts names it. Accepted without a flag: IP
  literals (a rebinding page cannot send one: its own name is what the browser sends), `localhost` and
  `*.localhost`, this machine's hostname. With an API key the key stands in for it (a rebinding page has
  no key); --allowed-hosts given turns the check on for a keyed server too; `*` turns it off.
- Origin / Sec-Fetch-Site: a browser request from another origin is refused (CSRF from any page), keyed
  or not, unless --allowed-origins names the origin; CORS is off unless that flag is given (then Starlette's
  CORSMiddleware answers preflights and adds its headers for those origins only). Clients that are not
  browsers (curl, SDKs) send neither header.
- Content-Type: a POST must say application/json (or +json): a cross-site HTML form cannot, and a page's
  fetch() that does needs a preflight, which is refused.
And at start, check_bind(): a non-loopback address without an API key is refused unless --allow-no-api-key.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
from collections.abc import Iterable

from hotstart.errors import HotstartError, RequestError

CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
CORS_HEADERS = ("Authorization", "Content-Type", "OpenAI-Organization", "OpenAI-Project", "X-Stainless-Lang",
                "X-Stainless-Package-Version", "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
                "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count", "X-Stainless-Timeout")


def split_list(values: Iterable[str] | None) -> tuple[str, ...]:
    """Repeated and comma-separated flag values as one tuple (empty entries dropped)."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether binding HOST listens on this machine only (an address, or localhost; other names: no)."""
    ip = _ip(host)
    return host.lower() == "localhost" if ip is None else ip.is_loopback


def check_bind(host: str, keyed: bool, allow_no_api_key: bool, bound: str | None = None) -> None:
    """HotstartError for a keyless server on a non-loopback address unless ALLOW_NO_API_KEY: HOST as given
    (before anything starts: an address or localhost), then BOUND, the address a name resolved to."""
    if keyed or allow_no_api_key:
        return
    if bound is None and _ip(host) is None and host.lower() != "localhost":
        return  # a name: decided once bound, on the address it resolved to
    if not is_loopback(bound if bound is not None else host):
        raise HotstartError(
            f"--host {host} listens beyond this machine without an API key: set HOTSTART_API_KEY (or "
            "--api-key), or pass --allow-no-api-key to serve everyone who can reach it")


def announce_metrics(sock: socket.socket | None) -> None:
    """One line naming the --metrics-port listener (after the "serving ... on URL" line tools read)."""
    if sock is not None:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"hotstart: GET /metrics without the key at http://{shown}:{port}/metrics", file=sys.stderr,
              flush=True)


def host_name(header: bytes) -> str:
    """The host of a Host header, lower case, without port or trailing dot ("[::1]:80" -> "[::1]")."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0].rstrip(".") if text.count(":") == 1 else text.rstrip(".")


class Access:
    """The gate's reach rules for one server: KEYED (an API key is set), ALLOWED_HOSTS (--allowed-hosts:
    names, `.suffix` for a domain and its subdomains, `*` for any; None: not given), ALLOWED_ORIGINS
    (--allowed-origins: `scheme://host[:port]`, `scheme://*` for every origin of a scheme, `*` for any)."""

    def __init__(self, keyed: bool = False, allowed_hosts: Iterable[str] | None = None,
                 allowed_origins: Iterable[str] | None = None) -> None:
        hosts = None if allowed_hosts is None else split_list(allowed_hosts)
        self.hosts = frozenset(h.lower().rstrip(".") for h in hosts or ())
        self.check_hosts = "*" not in self.hosts and (hosts is not None or not keyed)
        self.origins = frozenset(o.rstrip("/").lower() for o in split_list(allowed_origins))
        self.hostname = socket.gethostname().lower()

    def host_allowed(self, name: str) -> bool:
        if not self.check_hosts or _ip(name) is not None or name in self.hosts or name == self.hostname:
            return True
        if name == "localhost" or name.endswith(".localhost"):
            return True
        return any(h.startswith(".") and (name.endswith(h) or name == h[1:]) for h in self.hosts)

    def origin_allowed(self, origin: str) -> bool:
        """ORIGIN is listed, or its scheme is (`vscode-webview://*`), or `*` is."""
        origin = origin.rstrip("/").lower()
        scheme = origin.partition("://")[0]
        return "*" in self.origins or origin in self.origins or f"{scheme}://*" in self.origins

    def refusal(self, scope) -> RequestError | None:
        """Why SCOPE's request is refused before its key is looked at (403: Host, Origin), or None."""
        headers = dict(scope["headers"])  # the last of a repeated header: h11 joins none of these
        host = headers.get(b"host")
        if host is not None and not self.host_allowed(host_name(host)):
            return RequestError(403, f"Host `{host_name(host)[:100]}` is not served here (DNS rebinding is "
                                "refused): name it in --allowed-hosts", param="Host", code="host_not_allowed")
        origin, site = headers.get(b"origin"), headers.get(b"sec-fetch-site")
        if (origin is not None or site is not None) and not self.same_origin(origin, site, host):
            return RequestError(403, "cross-origin browser requests are refused: CORS is off unless "
                                "--allowed-origins names the page's origin", param="Origin",
                                code="cross_origin_refused")
        return None

    @staticmethod
    def content_refusal(scope) -> RequestError | None:
        """A POST whose Content-Type is not JSON (checked after the key: 401 before 415), or None."""
        if scope["method"] != "POST":
            return None
        ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype == b"application/json" or ctype.endswith(b"+json"):
            return None
        shown = ctype.decode("latin-1")[:80] or "none"
        return RequestError(415, f"Content-Type must be application/json, got `{shown}` (a POST without it "
                            "is refused: cross-site forms cannot send it)", param="Content-Type",
                            code="unsupported_media_type")

    def same_origin(self, origin: bytes | None, site: bytes | None, host: bytes | None) -> bool:
        """A browser request this server may answer: from an allowed origin, from its own pages, or typed
        in the address bar (Sec-Fetch-Site none); without Sec-Fetch-Site, Origin must be this Host's."""
        if origin is not None and self.origin_allowed(origin.decode("latin-1")):
            return True
        if site is not None:
            return site.strip().lower() in (b"same-origin", b"none")
        scheme, _, rest = origin.decode("latin-1").strip().lower().partition("://")
        own = host.decode("latin-1").strip().lower() if host is not None else None
        return scheme in ("http", "https") and rest == own

    @classmethod
    def of(cls, cfg) -> Access:
        """The rules of a ServeConfig: its key, --allowed-hosts, --allowed-origins."""
        return cls(bool(cfg.api_key), cfg.allowed_hosts, cfg.allowed_origins)

    def add_cors(self, app) -> None:
        """CORS for --allowed-origins, none without it (outermost: a preflight carries no key)."""
        if self.origins:
            app.add_middleware(Cors, access=self)


class Cors:
    """Starlette's CORSMiddleware for the requests of an allowed origin; any other request goes on to the
    gate, which refuses a cross-origin one in OpenAI's error shape."""

    def __init__(self, app, access: Access) -> None:
        from starlette.middleware.cors import CORSMiddleware  # noqa: PLC0415 - only with --allowed-origins

        self.app, self.access = app, access
        # only allowed origins get here (__call__): it echoes each one back, with Vary: Origin
        self.cors = CORSMiddleware(app, allow_origin_regex=".*", allow_methods=list(CORS_METHODS),
                                   allow_headers=list(CORS_HEADERS), max_age=600)

    async def __call__(self, scope, receive, send) -> None:
        origin = dict(scope.get("headers") or ()).get(b"origin") if scope["type"] == "http" else None
        if origin is not None and self.access.origin_allowed(origin.decode("latin-1")):
            return await self.cors(scope, receive, send)
        return await self.app(scope, receive, send)


async def metrics_only(app, scope, receive, send) -> None:
    """The --metrics-port listener: GET /metrics of APP (the gate lets it through without the key: it
    tells counts, never prompts), a 404 in OpenAI's shape for anything else."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
        return await app({**scope, "hotstart.listener": "metrics"}, receive, send)
    from starlette.responses import Response  # noqa: PLC0415 - loaded with the app

    err = RequestError(404, f"{scope['method']} {scope['path'][:200]}: this port serves GET /metrics only",
                       code="not_found")
    await Response(json.dumps(err.body()), 404, media_type="application/json")(scope, receive, send)
