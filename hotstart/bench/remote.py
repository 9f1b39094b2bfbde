"""`hotstart bench remote`: starting from object storage (see remote_args.py for the flags).

Per round, in this order (the first two alternate which goes first, as do the last two):
  s3 cold      `hotstart serve s3://BUCKET/PREFIX` with an empty $HOTSTART_HOME: launch -> first correct
               answer; its /startup gives the downloader's bytes, rate and CPU-seconds, and when the
               weights were downloaded and loaded
  serial       `python -m hotstart.bench.s3_fetch` (boto3's transfer manager) into an empty folder, then
               `hotstart serve FOLDER`: the download's wall time + launch -> first correct answer
  runai        the Run:ai Model Streamer's load of the same safetensors objects (--runai-python)
  s3 warm      `hotstart serve s3://...` again on the cache of this round's cold run
  local warm   `hotstart serve` of that cached folder itself
Every server's process group is stopped and checked after its run. The endpoint is --endpoint, or a
moto server this command starts on loopback (moto re-reads a whole object for every ranged GET, so its
absolute figures measure moto: docs/remote.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hotstart.bench.kernel_cache import built_library, seed_home
from hotstart.bench.process import RunFailed, Server
from hotstart.errors import HotstartError

RUNAI = Path(__file__).with_name("runai_load.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:
        raise HotstartError(f"cannot start moto: {e}") from None
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise HotstartError(
                    "moto did not start (pip install 'moto[server]', or give --endpoint)"
                ) from None
            time.sleep(0.1)


def _upload(env: dict, bucket: str, prefix: str, folder: Path, names: list[str]) -> None:
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    try:
        s3.create_bucket(Bucket=bucket)
    except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        pass
    there = {
        o["Key"]: o["Size"]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    }
    for name in names:
        path = folder / name
        if there.get(f"{prefix}/{name}") != path.stat().st_size:
            s3.upload_file(str(path), bucket, f"{prefix}/{name}")


class Bench:
    def __init__(
        self, args: argparse.Namespace, env: dict, url: str, folder: Path, weights: list[str], out: Path
    ):
        self.args, self.env, self.url, self.folder, self.weights, self.out = (
            args,
            env,
            url,
            folder,
            weights,
            out,
        )
        self.runs: list[dict] = []
        self.extra = shlex.split(args.hotstart_args or "")
        self.tmp = Path(tempfile.mkdtemp(prefix="hotstart-bench-remote-"))
        self.library = built_library() if args.kernels == "seeded" else None

    def save(self, meta: dict) -> None:
        (self.out / "results.json").write_text(json.dumps({"meta": meta, "runs": self.runs}, indent=1))

    def serve(self, model: str, home: Path, tag: str) -> tuple[float, dict]:
        """Launch -> first answer of `hotstart serve MODEL` (seconds) and its /startup."""
        argv = [sys.executable, "-m", "hotstart", "serve", model, "--port", "0", *self.extra]
        env = {**os.environ, **self.env, "HOTSTART_HOME": str(home)}
        seed_home(home, self.library)  # --kernels cold: the cold and serial homes are fresh, both build
        server = Server.launch(argv, env=env, log_dir=self.out / "logs", tag=tag)
        try:
            deadline = server.t_launch + self.args.timeout
            server.wait_url(deadline)
            _, t = server.ask(self.args.prompt, self.args.max_tokens, self.args.expect or None, deadline)
            body = server.get_json("/startup") or {}
        finally:
            server.stop()
        return t, body

    def run(self, config: str, rnd: int, home: Path) -> None:
        rec: dict = {"config": config, "round": rnd, "ok": False}
        try:
            if config == "s3 cold":
                shutil.rmtree(home, ignore_errors=True)
                rec["seconds"], body = self.serve(self.url, home, f"s3-cold-{rnd}")
                d = body.get("download") or {}
                ends = {p["name"]: p["end_s"] for p in body.get("phases", [])}
                rec.update(
                    download=d,
                    t_downloaded=ends.get("weights downloaded"),
                    t_weights_loaded=ends.get("weights loaded"),
                    t_ready=ends.get("engine ready"),
                )
            elif config == "serial":
                folder = self.tmp / f"serial-{rnd}"
                shutil.rmtree(folder, ignore_errors=True)
                bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
                fetch = subprocess.run(
                    [sys.executable, "-m", "hotstart.bench.s3_fetch", bucket, prefix, str(folder)],
                    env={**os.environ, **self.env},
                    capture_output=True,
                    text=True,
                    timeout=self.args.timeout,
                )
                if fetch.returncode != 0:
                    raise RunFailed(f"boto3 download failed: {fetch.stderr.strip()[-300:]}")
                got = json.loads(fetch.stdout.strip().splitlines()[-1])
                t, _ = self.serve(str(folder), self.tmp / f"serial-home-{rnd}", f"serial-{rnd}")
                rec.update(download_s=got["seconds"], serve_s=t, seconds=got["seconds"] + t)
                shutil.rmtree(folder, ignore_errors=True)
            elif config == "runai":
                env = {
                    **os.environ,
                    **self.env,
                    "AWS_EC2_METADATA_DISABLED": "true",
                    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                }
                argv = [self.args.runai_python, str(RUNAI), *[f"{self.url}/{w}" for w in self.weights]]
                done = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=self.args.timeout
                )
                if done.returncode != 0:
                    raise RunFailed(f"runai streamer failed: {done.stderr.strip()[-300:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                rec.update(got, seconds=got["load_s"])
            elif config == "s3 warm":
                rec["seconds"], body = self.serve(self.url, home, f"s3-warm-{rnd}")
                rec["source"] = (body.get("download") or {}).get("source")
            elif config == "local warm":
                cached = next(p.parent for p in (home / "s3").rglob(".hotstart-s3.json"))
                rec["seconds"], _ = self.serve(str(cached), home, f"local-warm-{rnd}")
            rec["ok"] = True
        except (RunFailed, OSError, subprocess.TimeoutExpired, StopIteration, ValueError, KeyError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        self.runs.append(rec)
        shown = f"{rec['seconds']:.2f} s" if rec["ok"] else rec["error"]
        print(f"hotstart bench remote: round {rnd} {config:<10} {shown}", file=sys.stderr, flush=True)


def _median(runs: list[dict], config: str, key: str = "seconds"):
    xs = [r[key] for r in runs if r["config"] == config and r["ok"] and r.get(key) is not None]
    return statistics.median(xs) if xs else None


def table(runs: list[dict], meta: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    cold, serial = _median(runs, "s3 cold"), _median(runs, "serial")
    dl = [r for r in runs if r["config"] == "s3 cold" and r["ok"]]
    gb = meta["weights_bytes"] / 1e9
    cpu = statistics.median([r["download"]["cpu_s"] / gb for r in dl]) if dl else None
    runai, downloaded = _median(runs, "runai"), _median(runs, "s3 cold", "t_downloaded")
    warm, local = _median(runs, "s3 warm"), _median(runs, "local warm")
    rows = [
        ("launch -> first correct answer, `serve s3://` (empty cache)", f(cold)),
        (
            "serial: boto3 download, then `serve FOLDER`",
            f"{f(serial)} ({f(_median(runs, 'serial', 'download_s'))} + "
            f"{f(_median(runs, 'serial', 'serve_s'))})",
        ),
        ("ratio s3 / serial (goal <= 0.85)", f(cold / serial) if cold and serial else "-"),
        (
            "hotstart: launch -> weights downloaded / loaded",
            f"{f(downloaded)} / {f(_median(runs, 's3 cold', 't_weights_loaded'))}",
        ),
        ("Run:ai Model Streamer load (its import apart)", f(runai)),
        (
            "ratio hotstart downloaded / Run:ai (goal <= 1.0)",
            f(downloaded / runai) if downloaded and runai else "-",
        ),
        ("restart, warm cache: `serve s3://` / `serve FOLDER`", f"{f(warm)} / {f(local)}"),
        ("warm difference (goal <= 0.5 s)", f(warm - local) if warm and local else "-"),
        ("downloader CPU-seconds per GB", f(cpu)),
    ]
    head = (
        f"model {meta['model']} ({gb:.2f} GB of weights), endpoint {meta['endpoint']}, "
        f"medians of {meta['runs']} rounds\n\n| what | seconds |\n|---|---:|\n"
    )
    return head + "".join(f"| {a} | {b} |\n" for a, b in rows)


def run_remote_bench(args: argparse.Namespace) -> int:
    from hotstart.boot.resolve import resolve_model
    from hotstart.model.files import sidecar_files, weight_files

    model = resolve_model(args.model)
    if model.source not in ("local", "default", "hf-cache", "modelscope"):
        raise HotstartError("bench remote: MODEL must be a local folder (it is uploaded to the endpoint)")
    folder = model.path
    if not folder.is_dir():  # a GGUF file: the stores serve safetensors folders
        if model.source != "default":
            raise HotstartError(f"bench remote: {folder} is a file: give a safetensors model folder")
        from hotstart.bench.default_hf import ensure_default_model  # noqa: PLC0415

        folder = ensure_default_model()  # the default model's bf16 safetensors copy
    model = dataclasses.replace(model, path=folder)
    weights = [p.name for p in weight_files(folder)]
    names = weights + [p.name for p in sidecar_files(folder)]
    out = Path(args.out or f"bench-results/remote-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.store != "s3":
        from hotstart.bench.remote_hub import run_hub_bench

        return run_hub_bench(args, model.path, sum((model.path / w).stat().st_size for w in weights), out)
    moto = None
    if args.endpoint:
        env = {"AWS_ENDPOINT_URL": args.endpoint, "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1")}
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env[k] = os.environ.get(k, "")
    else:
        moto, url = _start_moto()
        env = {
            "AWS_ENDPOINT_URL": url,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
        }
    prefix = (args.prefix or f"bench/{model.path.name}").strip("/")
    meta = {
        "model": str(model.path),
        "endpoint": args.endpoint or "moto (started here)",
        "runs": args.runs,
        "weights_bytes": sum((model.path / w).stat().st_size for w in weights),
        "bucket": args.bucket,
        "prefix": prefix,
    }
    bench = Bench(args, env, f"s3://{args.bucket}/{prefix}", model.path, weights, out)
    try:
        print(
            f"hotstart bench remote: uploading {model.path} to s3://{args.bucket}/{prefix}", file=sys.stderr
        )
        _upload(env, args.bucket, prefix, model.path, names)
        for rnd in range(args.runs):
            home = bench.tmp / f"home-{rnd}"
            first = ["s3 cold", "serial"] if rnd % 2 == 0 else ["serial", "s3 cold"]
            last = ["s3 warm", "local warm"] if rnd % 2 == 0 else ["local warm", "s3 warm"]
            for config in first + (["runai"] if args.runai_python else []) + last:
                bench.run(config, rnd, home)
                bench.save(meta)
    except KeyboardInterrupt:
        print("hotstart bench remote: interrupted; keeping the finished runs", file=sys.stderr)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
        shutil.rmtree(bench.tmp, ignore_errors=True)
        bench.save(meta)
    text = table(bench.runs, meta)
    (out / "table.md").write_text(text)
    print(text)
    return 0 if bench.runs and all(r["ok"] for r in bench.runs) else 1
