"""The GPU check: one prepared command that proves hotstart's CUDA path and measures its cold start.

    python benchmarks/gpu_check.py --out OUT [--device cuda] [--runs 3] [--work DIR] [--tokenizer DIR]
    python benchmarks/gpu_check.py --out OUT --device cpu --quick          # the dry run (CI runs it)

Writes OUT/gpu_check.json after every step (a crash or a timeout keeps what was measured) and
OUT/gpu_check.log. Steps (each bounded; the whole check is sized for < 8 minutes on one H200):
  env          versions, device, memory, disk, CPU count
  correctness  a random checkpoint of every family written by transformers: greedy tokens of
               hotstart == transformers in float32 on the device; last-position logits in bf16 close
  checkpoint   `hotstart make-model --family qwen2 --size 7b` (--quick: tiny) on the check's disk
  floor        per round, after dropping the page cache: a read of every weight byte, and
               `import torch` + a first CUDA tensor in a fresh interpreter
  startup      per round, cold (page cache dropped) then warm: launch -> /health, launch -> first chat
               completion, the same request again (the start's own cost = first - repeat), /startup
  serving      one warm server: the openai client's answer (if installed), decode tokens/s at 1 and 16
               streams (128 tokens each, ignore_eos)
Cold = `echo 3 > /proc/sys/vm/drop_caches` where permitted (root), else posix_fadvise eviction of the
weights and the Python environment (hotstart/bench/evict.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # the tests' helpers package: run from a whole checkout
from helpers.families import tiny_checkpoints  # noqa: E402

from hotstart import families  # noqa: E402
from hotstart.bench import evict as ev  # noqa: E402
from hotstart.bench.process import RunFailed, Server, free_port  # noqa: E402

QUESTION = "What is the capital of France?"


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or self.out / "work")
        self.work.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "steps": {}}
        self._log = open(self.out / "gpu_check.log", "a", encoding="utf-8")  # noqa: SIM115

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_check.json")

    def step(self, name: str, fn) -> None:
        self.log(f"--- {name}")
        t = time.perf_counter()
        try:
            value = fn()
            self.result["steps"][name] = {"ok": True, "seconds": round(time.perf_counter() - t, 2),
                                          **(value or {})}
        except Exception as e:  # noqa: BLE001 - one failed step must not lose the others
            self.log(f"{name} failed: {type(e).__name__}: {e}")
            self.result["steps"][name] = {"ok": False, "seconds": round(time.perf_counter() - t, 2),
                                          "error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()[-3000:]}
        self.log(f"{name}: {json.dumps(self.result['steps'][name], default=str)[:600]}")
        self.save()

    # ---- steps -----------------------------------------------------------------------------------
    def env(self) -> dict:
        import torch  # noqa: PLC0415

        info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(),
                "disk_free_gb": round(shutil.disk_usage(self.work).free / 1e9, 1), "root": os.geteuid() == 0}
        try:
            import transformers  # noqa: PLC0415

            info["transformers"] = transformers.__version__
        except ImportError:
            info["transformers"] = None
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
        if info["cuda"]:
            p = torch.cuda.get_device_properties(0)
            info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                        device_mem_gb=round(p.total_memory / 1e9, 1), device_count=torch.cuda.device_count())
            smi = shutil.which("nvidia-smi")
            if smi:
                info["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                                                     "--format=csv,noheader"], capture_output=True, text=True,
                                                    timeout=20).stdout.strip()
        return info

    def correctness(self) -> dict:
        import torch  # noqa: PLC0415
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

        from hotstart.config import EngineConfig  # noqa: PLC0415
        from hotstart.engine.core import EngineCore  # noqa: PLC0415
        from hotstart.messages import EngineRequest  # noqa: PLC0415
        from hotstart.model.files import weight_files  # noqa: PLC0415
        from hotstart.sampling_params import SamplingParams  # noqa: PLC0415

        dev, out = self.args.device, {}
        prompt = [3, 17, 42, 99, 7, 250, 11, 64]
        for family in families.names():  # the tests' odd-shaped tiny configs (tests/helpers/families.py)
            model_type, kw = tiny_checkpoints()[family]
            folder = self.work / f"tiny-{family}"
            if not (folder / "config.json").is_file():
                torch.manual_seed(0)
                cfg = AutoConfig.for_model(model_type, **kw)
                AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
            res = {}
            for dtype in ("float32", "bfloat16"):
                # transformers' grouped-mm experts need 16-byte strides (odd tiny shapes in bf16 on CPU
                # fail): the eager per-expert loop is the reference
                moe = {"experts_implementation": "eager"} if families.by_name(family).moe else {}
                ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **moe)
                ref_model = ref_model.to(dev).eval()
                ids = torch.tensor([prompt], device=dev)
                with torch.no_grad():
                    ref_logits = ref_model(ids).logits[0, -1].float().cpu()
                    # eos disabled, not masked: the engine's ignore_eos may still pick the eos token
                    out_ids = ref_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                                 pad_token_id=0)
                    ref_tokens = out_ids[0, len(prompt):].tolist()
                files = tuple(map(str, weight_files(folder)))
                ecfg = EngineConfig(model_path=str(folder), weight_files=files, device=dev, dtype=dtype,
                                    max_model_len=256, kv_cache_memory=32 << 20, compile="off")
                core = EngineCore.build(ecfg)
                params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
                core.add_request(EngineRequest("r", prompt, params))
                tokens = []
                while core.has_work():
                    for o in core.step():
                        tokens += o.new_token_ids
                with torch.inference_mode():  # one forward of the prompt, for the logits
                    from hotstart.engine.sequence import Sequence  # noqa: PLC0415

                    seq = Sequence("x", list(prompt), len(prompt), SamplingParams(max_tokens=1))
                    core.blocks.allocate(seq, len(prompt))
                    logits = core.runner.forward([(seq, len(prompt))], [True])[0].float().cpu()
                    core.blocks.free(seq)
                diff = (logits - ref_logits).abs().max().item()
                scale = ref_logits.abs().max().item()
                res[dtype] = {"tokens_equal": tokens == ref_tokens, "logits_max_abs_diff": round(diff, 6),
                              "logits_scale": round(scale, 3)}
                del ref_model, core
            res["ok"] = res["float32"]["tokens_equal"] and res["float32"]["logits_max_abs_diff"] < 1e-3 \
                and res["bfloat16"]["logits_max_abs_diff"] < 0.05 * max(1.0, res["bfloat16"]["logits_scale"])
            out[family] = res
        out["all_ok"] = all(v["ok"] for v in out.values())
        return out

    def checkpoint(self) -> dict:
        size = "tiny" if self.args.quick else "7b"
        self.model = self.work / f"qwen2-{size}"
        if not (self.model / "config.json").is_file():
            cmd = [sys.executable, "-m", "hotstart", "make-model", "--family", "qwen2", "--size", size,
                   "--out", str(self.model)]
            if self.args.tokenizer:
                cmd += ["--tokenizer", self.args.tokenizer]
            subprocess.run(cmd, check=True, timeout=600)
        from hotstart.model.files import sidecar_files, weight_files  # noqa: PLC0415

        self.weights = weight_files(self.model)
        self.cold = ev.build_cold_sets(self.weights + sidecar_files(self.model),
                                       {"hotstart": (sys.executable, [str(REPO / "hotstart")], [])})
        return {"model": str(self.model), "bytes": sum(p.stat().st_size for p in self.weights),
                "files": len(self.weights)}

    def drop_caches(self) -> str:
        if not self.args.fadvise:
            os.sync()
            try:
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
                return "drop_caches"
            except OSError:
                pass
        ev.evict_sets(self.cold.for_mode("all"))
        return "fadvise"

    def floor(self) -> dict:
        reads, imports = [], []
        code = "import torch; torch.zeros(1)"
        if self.args.device == "cuda":
            code = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
        for _ in range(self.args.runs):
            how = self.drop_caches()
            t = time.perf_counter()
            n = _read_all(self.weights)
            reads.append(time.perf_counter() - t)
            self.drop_caches()
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
            imports.append(time.perf_counter() - t)
        r, i = statistics.median(reads), statistics.median(imports)
        return {"cold": how, "read_s": [round(x, 3) for x in reads], "read_gbps": round(n / r / 1e9, 2),
                "import_torch_device_s": [round(x, 3) for x in imports], "floor_s": round(max(r, i), 3)}

    def _serve(self, extra: list[str] = ()) -> Server:
        port = free_port()
        argv = [sys.executable, "-m", "hotstart", "serve", str(self.model), "--port", str(port),
                "--device", self.args.device, "--max-model-len", "2048", *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return Server.launch(argv, port, env, self.out / "logs", f"serve-{port}")

    def startup(self) -> dict:
        runs = []
        for mode in ("cold", "warm"):
            for i in range(self.args.runs + (1 if mode == "warm" else 0)):  # warm: one discarded warm-up
                how = self.drop_caches() if mode == "cold" else "none"
                s = self._serve()
                rec = {"mode": mode, "round": i, "evicted": how}
                try:
                    deadline = s.t_launch + self.args.timeout
                    rec["t_health"] = round(s.wait_healthy(deadline), 3)
                    rec["answer"], t_first = s.ask(QUESTION, 16, None, deadline)
                    rec["t_first"] = round(t_first, 3)
                    t = time.perf_counter()
                    s.ask(QUESTION, 16, None, t + self.args.timeout)
                    rec["t_repeat"] = round(time.perf_counter() - t, 3)
                    rec["start_cost"] = round(rec["t_first"] - rec["t_repeat"], 3)
                    rec["timeline"] = s.get_json("/startup")
                except RunFailed as e:
                    rec["error"] = str(e)
                finally:
                    rec["stop"] = s.stop()
                if not (mode == "warm" and i == 0):
                    runs.append(rec)
                shown = {k: v for k, v in rec.items() if k != "timeline"}
                self.log(f"startup {mode} {i}: " + json.dumps(shown, default=str)[:300])
        out: dict = {"runs": runs}
        for mode in ("cold", "warm"):
            ok = [r for r in runs if r["mode"] == mode and "t_first" in r]
            for key in ("t_health", "t_first", "t_repeat", "start_cost"):
                if ok:
                    out[f"{mode}_{key}_median"] = round(statistics.median(r[key] for r in ok), 3)
        return out

    def serving(self) -> dict:
        s = self._serve()
        out: dict = {}
        try:
            s.wait_healthy(s.t_launch + self.args.timeout)
            try:
                from openai import OpenAI  # noqa: PLC0415

                client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                model = client.models.list().data[0].id
                r = client.chat.completions.create(model=model,
                                                   messages=[{"role": "user", "content": QUESTION}],
                                                   temperature=0, max_tokens=16)
                out["openai_client_answer"] = r.choices[0].message.content
            except ImportError:
                out["openai_client_answer"] = None
            tokens = 8 if self.args.quick else 128
            for streams in ((1, 2) if self.args.quick else (1, 16)):
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(streams) as pool:
                    done = sum(pool.map(lambda i: _complete(s.url, i, tokens), range(streams)))
                out[f"tok_s_{streams}_streams"] = round(done / (time.perf_counter() - t), 1)
        finally:
            out["stop"] = s.stop()
        return out


def _read_all(paths: list[Path], block: int = 16 << 20) -> int:
    total = 0
    buf = bytearray(block)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def _complete(url: str, i: int, tokens: int) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"model": "x", "prompt": f"Story number {i}: once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    models = json.loads(_get(conn, "/v1/models"))["data"][0]["id"]
    body["model"] = models
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data["usage"]["completion_tokens"]


def _get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    return conn.getresponse().read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny models, 1 round: the CPU dry run")
    p.add_argument("--work", default=None, help="where checkpoints are written (default OUT/work)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer files for make-model (default: the embedded model)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds from launch to a first answer")
    p.add_argument("--skip", default="", help="comma-separated steps to skip")
    p.add_argument("--fadvise", action="store_true",
                   help="evict with posix_fadvise only, never drop the whole page cache (the dry run)")
    args = p.parse_args()
    if args.quick:
        args.runs = min(args.runs, 1)
    c = Check(args)
    skip = set(filter(None, args.skip.split(",")))
    for name in ("env", "correctness", "checkpoint", "floor", "startup", "serving"):
        needs_checkpoint = name in ("floor", "startup", "serving")
        if name in skip or (needs_checkpoint and not c.result["steps"].get("checkpoint", {}).get("ok")):
            c.result["steps"].setdefault(name, {"ok": None, "skipped": True})
            continue
        c.step(name, getattr(c, name))
    c.result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    c.save()
    failed = [n for n, s in c.result["steps"].items() if s.get("ok") is False]
    verdict = "all steps ok" if not failed else "failed: " + ", ".join(failed)
    c.log(f"done: {verdict} -> {c.out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
