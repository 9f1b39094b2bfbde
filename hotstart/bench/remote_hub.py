"""`hotstart bench remote --store hf|modelscope`: starting by hub id from a capped loopback hub.

The hub is `python -m hotstart.bench.hubserver` serving MODEL as ORG/NAME (--repo, default bench/FOLDER)
at --cap-mbps (one token bucket for every connection: a link). Per round, with empty caches, in this
order (the first two alternate which goes first, as do the warm pair):
  hub cold     `hotstart serve ORG/NAME` (modelscope://ORG/NAME): launch -> first correct answer; its
               /startup gives the downloader's bytes, rate and CPU-seconds, when the weights were
               downloaded and loaded
  serial       `python -m hotstart.bench.hub_fetch` (the hub's own client: huggingface_hub's
               snapshot_download over plain HTTP, or modelscope's) into an empty cache, then
               `hotstart serve` of the snapshot folder
  vllm         the vLLM peer (`make peers`' VLLM_PEER, or --vllm-command) serving ORG/NAME from the same
               hub into an empty cache: launch -> first answer (any text: vLLM's answer on the default
               model is not "Paris", facts.md)
  hub warm     `hotstart serve ORG/NAME` again on the cold run's cache; local warm: `hotstart serve` of
               that snapshot folder
  hub down     `hotstart serve ORG/NAME` on that cache with the endpoint unreachable (warning lines counted)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hotstart.bench.kernel_cache import built_library, seed_home
from hotstart.bench.process import RunFailed, Server, free_port
from hotstart.errors import HotstartError

DEAD = "http://127.0.0.1:9"


def start_hub(repo_id: str, folder: Path, cap: float | None, memo: Path,
              log: Path) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "hotstart.bench.hubserver", "--repo", f"{repo_id}={folder}",
            "--hash-memo", str(memo)] + (["--cap-mbps", str(cap)] if cap else [])
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    line = proc.stdout.readline()  # after hashing the files (once per machine: --hash-memo)
    if not line:
        proc.kill()
        raise HotstartError(f"the loopback hub did not start: {log.read_text()[-500:]}")
    return proc, json.loads(line)["url"]


class HubBench:
    def __init__(self, args: argparse.Namespace, folder: Path, url: str, out: Path):
        self.args, self.folder, self.url, self.out = args, folder, url, out
        self.ms = args.store == "modelscope"
        self.repo = (args.prefix or f"bench/{folder.name}").strip("/")
        self.spec = f"modelscope://{self.repo}" if self.ms else self.repo
        self.extra = shlex.split(args.hotstart_args or "")
        self.tmp = Path(tempfile.mkdtemp(prefix="hotstart-bench-hub-"))
        self.runs: list[dict] = []
        self.cached: dict[int, Path] = {}
        self.library = built_library() if args.kernels == "seeded" else None

    def env(self, rnd: int, endpoint: str | None = None, offline: bool = False) -> dict[str, str]:
        root = self.tmp / f"round-{rnd}"
        url = endpoint or self.url
        return {**os.environ, "HF_ENDPOINT": url, "MODELSCOPE_ENDPOINT": url,
                "HF_HUB_CACHE": str(root / "hf"), "MODELSCOPE_CACHE": str(root / "ms"),
                "HOTSTART_HOME": str(root / "home"), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "",
                "HF_TOKEN_PATH": str(self.tmp / "no-token"), "HF_HUB_OFFLINE": "1" if offline else "0",
                "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_USE_MODELSCOPE": "True" if self.ms else ""}

    def serve(self, model: str, env: dict, tag: str) -> tuple[float, dict, str]:
        argv = [sys.executable, "-m", "hotstart", "serve", model, "--port", "0", *self.extra]
        home = Path(env["HOTSTART_HOME"])
        if self.library is None and tag.startswith(("hub-cold", "serial")):
            shutil.rmtree(home / "kernels", ignore_errors=True)  # --kernels cold: this run builds them
        seed_home(home, self.library)
        server = Server.launch(argv, env=env, log_dir=self.out / "logs", tag=tag)
        try:
            deadline = server.t_launch + self.args.timeout
            server.wait_url(deadline)
            _, t = server.ask(self.args.prompt, self.args.max_tokens, self.args.expect or None, deadline)
            body = server.get_json("/startup") or {}
        finally:
            server.stop()
        return t, body, server.stderr_path.read_text(errors="replace") if server.stderr_path else ""

    def vllm(self, rnd: int) -> float:
        from hotstart.bench.peers import known_peer, split_command

        cmd = self.args.vllm_command or known_peer("vllm")[1]
        port = free_port()
        filled = cmd.replace("{port}", str(port)).replace("{model}", self.repo)
        peer_env, words = split_command(filled, "vLLM")
        cache = self.tmp / f"vllm-{rnd}"
        env = {**self.env(rnd), **peer_env, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache / "hf"),
               "MODELSCOPE_CACHE": str(cache / "ms"), "HF_ENDPOINT": self.url,
               "MODELSCOPE_ENDPOINT": self.url}
        server = Server.launch(words, port=port, env=env, log_dir=self.out / "logs", tag=f"vllm-{rnd}")
        try:
            deadline = server.t_launch + max(self.args.timeout, 600)
            server.wait_healthy(deadline)
            _, t = server.ask(self.args.prompt, self.args.max_tokens, None, deadline)
        finally:
            server.stop()
            shutil.rmtree(cache, ignore_errors=True)
        return t

    def run(self, config: str, rnd: int) -> None:
        rec: dict = {"config": config, "round": rnd, "ok": False}
        try:
            if config == "hub cold":
                shutil.rmtree(self.tmp / f"round-{rnd}", ignore_errors=True)
                rec["seconds"], body, _ = self.serve(self.spec, self.env(rnd), f"hub-cold-{rnd}")
                d = body.get("download") or {}
                ends = {p["name"]: p["end_s"] for p in body.get("phases", [])}
                rec.update(download=d, t_downloaded=ends.get("weights downloaded"),
                           t_weights_loaded=ends.get("weights loaded"))
                self.cached[rnd] = Path(d["path"])
            elif config == "serial":
                cache = self.tmp / f"serial-{rnd}"
                shutil.rmtree(cache, ignore_errors=True)
                argv = [sys.executable, "-m", "hotstart.bench.hub_fetch",
                        *(["--modelscope"] if self.ms else []), self.repo, str(cache)]
                got = subprocess.run(argv, env=self.env(rnd), capture_output=True, text=True,
                                     timeout=self.args.timeout)
                if got.returncode != 0:
                    raise RunFailed(f"the hub client's download failed: {got.stderr.strip()[-300:]}")
                fetched = json.loads(got.stdout.strip().splitlines()[-1])
                t, _, _ = self.serve(fetched["path"], self.env(rnd, offline=True), f"serial-{rnd}")
                rec.update(download_s=fetched["seconds"], client_cpu_s=fetched["cpu_s"], serve_s=t,
                           seconds=fetched["seconds"] + t)
                shutil.rmtree(cache, ignore_errors=True)
            elif config == "vllm":
                rec["seconds"] = self.vllm(rnd)
            elif config == "hub warm":
                rec["seconds"], body, _ = self.serve(self.spec, self.env(rnd), f"hub-warm-{rnd}")
                rec["source"] = (body.get("download") or {}).get("source")
            elif config == "local warm":
                rec["seconds"], _, _ = self.serve(str(self.cached[rnd]), self.env(rnd), f"local-warm-{rnd}")
            elif config == "hub down":
                rec["seconds"], body, log = self.serve(self.spec, self.env(rnd, DEAD), f"hub-down-{rnd}")
                rec["source"] = (body.get("download") or {}).get("source")
                rec["warnings"] = log.count("hotstart: WARNING:")
            rec["ok"] = True
        except (RunFailed, HotstartError, OSError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        self.runs.append(rec)
        shown = f"{rec['seconds']:.2f} s" if rec["ok"] else rec["error"]
        print(f"hotstart bench remote: round {rnd} {config:<10} {shown}", file=sys.stderr, flush=True)


def _median(runs: list[dict], config: str, key: str = "seconds"):
    xs = [r[key] for r in runs if r["config"] == config and r["ok"] and r.get(key) is not None]
    return statistics.median(xs) if xs else None


def table(runs: list[dict], meta: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    gb = meta["weights_bytes"] / 1e9
    cold, serial, vllm = _median(runs, "hub cold"), _median(runs, "serial"), _median(runs, "vllm")
    warm, local, down = _median(runs, "hub warm"), _median(runs, "local warm"), _median(runs, "hub down")
    cpu = [r["download"]["cpu_s"] / gb for r in runs if r["config"] == "hub cold" and r["ok"]]
    client = _median(runs, "serial", "client_cpu_s")
    warned = sorted({r.get("warnings") for r in runs if r["config"] == "hub down" and r["ok"]})
    rows = [
        (f"launch -> first correct answer, `serve {meta['spec']}` (empty cache)", f(cold)),
        ("serial: the hub's client downloads, then `serve FOLDER`",
         f"{f(serial)} ({f(_median(runs, 'serial', 'download_s'))} + "
         f"{f(_median(runs, 'serial', 'serve_s'))})"),
        ("ratio hotstart / serial (goal <= 0.8)", f(cold / serial) if cold and serial else "-"),
        ("vLLM serving the same id from the same hub (launch -> first answer)", f(vllm)),
        ("ratio hotstart / vLLM", f(cold / vllm) if cold and vllm else "-"),
        ("hotstart: launch -> weights downloaded / loaded",
         f"{f(_median(runs, 'hub cold', 't_downloaded'))} / "
         f"{f(_median(runs, 'hub cold', 't_weights_loaded'))}"),
        ("restart, warm cache: `serve ORG/NAME` / `serve FOLDER`", f"{f(warm)} / {f(local)}"),
        ("warm difference (goal <= 0.3 s)", f(warm - local) if warm and local else "-"),
        (f"restart, endpoint down (warning lines: {warned})", f(down)),
        ("downloader CPU-seconds per GB (hotstart; the hub client's whole process beside it)",
         f"{f(statistics.median(cpu) if cpu else None)} ({f(client / gb if client else None)})"),
    ]
    head = (f"model {meta['model']} ({gb:.2f} GB of weights) as {meta['spec']}, loopback hub capped at "
            f"{meta['cap_mbps'] or 'no'} MB/s, medians of {meta['runs']} rounds\n\n"
            "| what | seconds |\n|---|---:|\n")
    return head + "".join(f"| {a} | {b} |\n" for a, b in rows)


def run_hub_bench(args: argparse.Namespace, folder: Path, weights_bytes: int, out: Path) -> int:
    proc, url = start_hub((args.prefix or f"bench/{folder.name}").strip("/"), folder, args.cap_mbps,
                          Path(tempfile.gettempdir()) / "hotstart-bench-hub-hashes.json", out / "hub.log")
    bench = HubBench(args, folder, url, out)
    meta = {"model": str(folder), "spec": bench.spec, "store": args.store, "endpoint": url,
            "cap_mbps": args.cap_mbps, "runs": args.runs, "weights_bytes": weights_bytes}
    try:
        for rnd in range(args.runs):
            first = ["hub cold", "serial"] if rnd % 2 == 0 else ["serial", "hub cold"]
            warm = ["hub warm", "local warm"] if rnd % 2 == 0 else ["local warm", "hub warm"]
            vllm = ["vllm"] if args.vllm or args.vllm_command else []
            for config in first + vllm + warm + ["hub down"]:
                bench.run(config, rnd)
                (out / "results.json").write_text(json.dumps({"meta": meta, "runs": bench.runs}, indent=1))
            shutil.rmtree(bench.tmp / f"round-{rnd}", ignore_errors=True)
    except KeyboardInterrupt:
        print("hotstart bench remote: interrupted; keeping the finished runs", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(bench.tmp, ignore_errors=True)
    text = table(bench.runs, meta)
    (out / "table.md").write_text(text)
    print(text)
    return 0 if bench.runs and all(r["ok"] for r in bench.runs) else 1
