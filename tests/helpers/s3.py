"""A real S3 endpoint on loopback for the tests: moto's server in a subprocess, boto3 uploads, and a
fault-injecting HTTP proxy in front of it (5xx answers, cut bodies, stalls) for the retry paths."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEY = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """`python -m moto.server -H 127.0.0.1 -p PORT` (moto[server]); with `auth`, IAM is enforced after
    the first AUTH_FREE requests (moto's INITIAL_NO_AUTH_ACTION_COUNT), which set up the users."""

    AUTH_FREE = 6

    def __init__(self, auth: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": str(self.AUTH_FREE)} if auth else {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        self.keys = dict(KEY)
        self.users: dict[str, dict] = {}
        if auth:  # the AUTH_FREE unauthenticated requests: two users, their keys and policies
            iam = self.client("iam")
            for user, policy in (
                ("uploader", [{"Effect": "Allow", "Action": "*", "Resource": "*"}]),
                (
                    "nodata",
                    [
                        {"Effect": "Allow", "Action": "*", "Resource": "*"},
                        {
                            "Effect": "Deny",
                            "Action": "s3:GetObject",
                            "Resource": "arn:aws:s3:::*/*.safetensors",
                        },
                    ],
                ),
            ):
                iam.create_user(UserName=user)
                k = iam.create_access_key(UserName=user)["AccessKey"]
                iam.put_user_policy(
                    UserName=user,
                    PolicyName="p",
                    PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": policy}),
                )
                self.users[user] = {
                    **KEY,
                    "AWS_ACCESS_KEY_ID": k["AccessKeyId"],
                    "AWS_SECRET_ACCESS_KEY": k["SecretAccessKey"],
                }
            self.keys = self.users["uploader"]

    def client(self, service: str = "s3", keys: dict | None = None):
        import boto3

        k = keys or self.keys
        return boto3.client(
            service,
            endpoint_url=self.url,
            aws_access_key_id=k["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=k["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def env(self, url: str | None = None, keys: dict | None = None) -> dict[str, str]:
        """What a hotstart process needs to reach this endpoint (or URL, e.g. a proxy in front)."""
        return {**(keys or self.keys), "AWS_ENDPOINT_URL": url or self.url}

    def upload(self, bucket: str, prefix: str, folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
        """Every file of FOLDER under s3://BUCKET/PREFIX/ (the bucket is created if needed)."""
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        names = sorted(
            p.name
            for p in Path(folder).iterdir()
            if p.is_file() and p.name not in skip and not p.name.startswith(".")
        )
        for name in names:
            s3.upload_file(str(Path(folder) / name), bucket, f"{prefix}/{name}")
        return names

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class FaultProxy:
    """A loopback HTTP proxy to UPSTREAM that misbehaves on ranged GETs as told: `fail` answers 503 to
    that many, `cut` returns only half the body of that many (the connection then closes), `delay_s`
    holds each before forwarding. Counts what it saw in `gets`, `failed`, `cut_done`."""

    def __init__(self, upstream_port: int):
        self.fail = self.cut = 0
        self.delay_s = 0.0
        self.gets = self.failed = self.cut_done = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._forward("GET")

            def do_HEAD(self):
                self._forward("HEAD")

            def do_PUT(self):
                self._forward("PUT")

            def _forward(self, method: str) -> None:
                ranged = method == "GET" and "range" in {k.lower() for k in self.headers}
                with proxy.lock:
                    proxy.gets += ranged
                    fail = ranged and proxy.fail > 0
                    proxy.fail -= fail
                    cut = ranged and not fail and proxy.cut > 0
                    proxy.cut -= cut
                if ranged and proxy.delay_s:
                    time.sleep(proxy.delay_s)
                if fail:
                    with proxy.lock:
                        proxy.failed += 1
                    body = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = self.headers.get("Host", "")
                conn.request(method, self.path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                if cut:
                    self.send_header("Connection", "close")
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(payload[: len(payload) // 2] if cut else payload)
                if cut:
                    with proxy.lock:
                        proxy.cut_done += 1
                    self.close_connection = True
                conn.close()

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up (a killed server)
                pass

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault proxy", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
