"""Prompt-lookup speculative decoding against the plain engine: one stream, greedy, chat completions.

    python benchmarks/spec_decode.py [MODEL] [--rounds 3] [--max-tokens 256] [--out spec.json]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2}'] [-- SERVE FLAGS...]

Starts `hotstart serve MODEL` twice, one after the other (never together): plain, then with
--speculative-config SPEC. Against each, per round, three chats (streamed, temperature 0): "copy" (repeat
a given text), "edit" (the text with one word changed throughout) and "ordinary" (a short story: little to
copy). Per request: decode tokens/s = (completion tokens - 1) / (last - first event with text) and
end-to-end tokens/s; medians of rounds, the speculative / plain ratio, whether the texts are identical,
and the speculative server's acceptance (its /metrics, vLLM's series).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from hotstart.bench.process import Server
from hotstart.bench.prometheus import samples

TEXT = (
    "The old lighthouse stood at the end of the harbour wall, its white paint flaking in the salt wind. "
    "Every evening at dusk the keeper climbed the ninety-two steps, wound the clockwork, trimmed the wick "
    "and lit the great lamp, and every morning at dawn he climbed them again to put it out. The fishermen "
    "set their watches by the beam, and the children of the village dared each other to touch the iron "
    "door after dark. In winter the storms came in from the west, and the waves broke over the wall so "
    "high that the spray reached the gallery; in summer the sea lay flat and green, and the keeper's cat "
    "slept on the warm stones while the gulls argued over the scraps the boats threw back. The cat had "
    "come with the last keeper and stayed with this one, and nobody remembered its name."
)
CHATS = {
    "copy": f"Repeat the following text exactly, word for word, and nothing else:\n\n{TEXT}",
    "edit": "Rewrite the following text with every 'cat' replaced by 'dog'; change nothing else:\n\n" + TEXT,
    "ordinary": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def chat(url: str, model: str, content: str, max_tokens: int) -> dict:
    """One streamed greedy chat: its text, completion tokens and token-event times."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, events, tokens = [], [], 0
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if piece:  # a token event with text (not the role-only first chunk)
                events.append(time.perf_counter())
                text.append(piece)
    t_end = events[-1]
    return {
        "text": "".join(text),
        "tokens": tokens,
        "e2e_tok_s": tokens / (t_end - t0),
        "decode_tok_s": (tokens - 1) / (t_end - events[0]) if tokens > 1 and t_end > events[0] else 0.0,
    }


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: v for name, _, v in samples(text) if name.startswith("vllm:spec_decode_")}


def measure(argv: list[str], rounds: int, max_tokens: int) -> tuple[dict, dict]:
    srv = Server.launch(argv, tag="hotstart spec bench")
    try:
        deadline = time.perf_counter() + 300
        url = srv.wait_url(deadline)
        srv.wait_healthy(deadline)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        chat(url, model, "Hello!", 8)  # warm-up
        runs = {
            name: [chat(url, model, content, max_tokens) for _ in range(rounds)]
            for name, content in CHATS.items()
        }
        return runs, spec_counters(url)
    finally:
        srv.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the second server")
    p.add_argument("--out", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    serve = [
        sys.executable,
        "-m",
        "hotstart",
        "serve",
        *([args.model] if args.model else []),
        "--port",
        "0",
        *argv[cut + 1 :],
    ]
    plain, _ = measure(serve, args.rounds, args.max_tokens)
    spec, counters = measure([*serve, "--speculative-config", args.spec], args.rounds, args.max_tokens)
    print(
        f"{'chat':9s} {'tokens':>6s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'ratio':>6s} "
        f"{'e2e ratio':>9s} identical"
    )
    for name in CHATS:
        a, b = plain[name], spec[name]
        da, db = (statistics.median(r["decode_tok_s"] for r in x) for x in (a, b))
        ea, eb = (statistics.median(r["e2e_tok_s"] for r in x) for x in (a, b))
        same = all(r["text"] == a[0]["text"] for r in a + b)
        print(f"{name:9s} {a[0]['tokens']:6d} {da:11.1f} {db:10.1f} {db / da:6.2f} {eb / ea:9.2f} {same}")
    drafts = counters.get("vllm:spec_decode_num_draft_tokens_total", 0)
    ok = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    print(
        f"drafts {counters.get('vllm:spec_decode_num_drafts_total', 0):.0f}, draft tokens {drafts:.0f}, "
        f"accepted {ok:.0f} ({ok / drafts:.0%} of draft tokens)"
        if drafts
        else "no drafts"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"argv": serve, "spec": args.spec, "plain": plain, "speculative": spec, "counters": counters},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
