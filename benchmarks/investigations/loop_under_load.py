"""Does a running server's event loop answer while large requests are prepared? /live and /health latency
while N one-megabyte /tokenize (or chat) requests run at once, as JSON.

    hotstart serve --port 8000 &            # a checkout's server (PYTHONPATH=/other/checkout: another's)
    python benchmarks/investigations/loop_under_load.py http://127.0.0.1:8000 --requests 8
    python benchmarks/investigations/loop_under_load.py http://127.0.0.1:8000 --endpoint chat --chars 40000

Each request carries --chars characters of English text (under --max-request-bytes); the probes poll every
--every seconds until the last request ends. Reported: the requests' statuses and seconds, and the probes'
count, median, p99 and max seconds. Before the worker pool (server/offload.py), /live waited for every
tokenize on the event loop: 2.8 s on a quiet 2-core machine with 8 requests.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--model", default=None, help="the served model's name (default: the first of /v1/models)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--chars", type=int, default=900_000)
    p.add_argument("--endpoint", choices=["tokenize", "chat"], default="tokenize",
                   help="chat: a 1-token chat completion of the text (its prompt must fit the context)")
    p.add_argument("--every", type=float, default=0.05)
    args = p.parse_args()
    model = args.model or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    text = ("The quick brown fox jumps over the lazy dog. " * (args.chars // 45 + 1))[:args.chars]
    if args.endpoint == "tokenize":
        path, body = "/tokenize", {"model": model, "prompt": text}
    else:
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    answers: list[tuple[int, float]] = []

    def one() -> None:
        t = time.perf_counter()
        r = httpx.post(args.url + path, json=body, timeout=600)
        answers.append((r.status_code, round(time.perf_counter() - t, 3)))

    threads = [threading.Thread(target=one) for _ in range(args.requests)]
    for t in threads:
        t.start()
    waits: list[float] = []
    with httpx.Client(base_url=args.url, timeout=600) as c:
        while any(t.is_alive() for t in threads):
            for probe in ("/live", "/health"):
                t0 = time.perf_counter()
                c.get(probe)
                waits.append(time.perf_counter() - t0)
            time.sleep(args.every)
    for t in threads:
        t.join()
    waits = sorted(waits) or [0.0]

    def pick(q: float) -> float:
        return round(waits[min(len(waits) - 1, int(q * len(waits)))], 4)

    print(json.dumps({"requests": sorted(answers, key=lambda a: a[1]), "probes": len(waits),
                      "median_s": pick(0.5), "p99_s": pick(0.99), "max_s": pick(1.0)}, indent=1))

if __name__ == "__main__":
    main()
