"""Parsers of the serving verbs of `hotstart bench` (serve, load, soak, over-time, prefix-cache; argparse
only). Each adds the subparser of the verb it is given (args.BENCH_VERBS spells them)."""

from __future__ import annotations

from hotstart.bench.argtypes import NameAction, TargetAction

# `hotstart bench soak --mix` default (soak.py checks it; kept here so that --help imports nothing)
DEFAULT_MIX = "chat=2,chat_stream=3,text=1,text_stream=2,n=1,json_schema=1,tools=1,hangup=1,bad=1"

OVER_TIME_KINDS = ("hotstart-cold", "hotstart-warm", "vllm", "vllm-cold", "llamacpp", "transformers")
MODEL_HELP = "model folder or hub id (default: the embedded model)"


def _quiet(p, max_load: float) -> None:
    p.add_argument("--max-load", type=float, default=max_load,
                   help="wait for the 1-minute load average below this")
    p.add_argument("--max-wait", type=float, default=600,
                   help="longest wait for a quiet machine (s; 0: no wait)")


def add_serve(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="throughput, TTFT, TPOT, ITL of OpenAI servers, as `vllm bench serve` measures them",
        description="Random prompts of exactly --input-len tokens, --output-len tokens each (forced: "
                    "ignore_eos or the server's own way), --num-prompts requests at most --concurrency at a "
                    "time, against each target; every length x concurrency for --rounds rounds, interleaved "
                    "between targets; medians of rounds, ratios against --baseline, the roofline fraction. "
                    "Metric definitions: vLLM's (docs/serving.md).")
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP + "; its tokenizer builds the prompts")
    t = p.add_argument_group("targets (in order; default: one `hotstart serve` of MODEL)")
    t.add_argument("--hotstart", dest="targets", action=TargetAction, const="hotstart", metavar="LABEL=FLAGS",
                   help="`hotstart serve MODEL FLAGS` from this checkout, labelled hotstart[LABEL] "
                        "(both may be empty: --hotstart =); leading VAR=value words are its environment "
                        "(PYTHONPATH=DIR: another checkout); repeatable")
    t.add_argument("--peers", dest="targets", action=TargetAction, const="peers", metavar="LIST",
                   help="vllm,llamacpp,transformers: the command lines `make peers` wrote")
    t.add_argument("--peer", dest="targets", action=TargetAction, const="peer", metavar="CMD",
                   help="any server's command line with {port} and {model} (the model folder) or {gguf}; "
                        "leading VAR=value words are its environment; repeatable")
    t.add_argument("--peer-name", action=NameAction, const=("peer", "peers"), metavar="NAME",
                   help="label of the --peer / --peers just before it")
    t.add_argument("--url", dest="targets", action=TargetAction, const="url", metavar="URL",
                   help="a running server (e.g. http://127.0.0.1:8000), never started or stopped here")
    t.add_argument("--url-name", action=NameAction, const=("url",), metavar="NAME",
                   help="label of the --url before it")
    t.add_argument("--baseline", default=None, metavar="LABEL",
                   help="ratios against this target (default: the first that is not hotstart, else "
                        "the first)")
    w = p.add_argument_group("workload (vLLM's spellings accepted)")
    w.add_argument("--input-len", "--random-input-len", default="200", metavar="N[,N...]",
                   help="prompt tokens (several: each is a level)")
    w.add_argument("--output-len", "--random-output-len", type=int, default=96,
                   help="output tokens per request")
    w.add_argument("--concurrency", "--max-concurrency", default="1,4,16", metavar="C[,C...]",
                   help="requests in flight at most (several: each is a level)")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: 4 x concurrency, at least 8)")
    w.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    w.add_argument("--temperature", type=float, default=None,
                   help="sent with every request (default: none, as vLLM's bench: the server's default)")
    w.add_argument("--extra-body", default=None, metavar="JSON", help="fields added to every request body")
    w.add_argument("--served-model-name", default=None,
                   help="the request's model (default: /v1/models' first)")
    w.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: MODEL)")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    w.add_argument("--api-key", default=None,
                   help="for --url targets (default: $OPENAI_API_KEY, as vLLM's bench)")
    r = p.add_argument_group("rounds and noise")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--schedule", default="interleaved", choices=["interleaved", "sequential"],
                   help="interleaved: every target up at once, rounds alternate between them; sequential: "
                        "one target up at a time (big checkpoints)")
    r.add_argument("--noise-cores", type=float, default=0.25,
                   help="a run during which other processes used more CPU than this (cores) is noisy: rerun")
    r.add_argument("--retries", type=int, default=3, help="reruns of a noisy run")
    _quiet(r, 1.5)
    r.add_argument("--timeout", type=float, default=1800, help="per-request limit (s)")
    s = p.add_argument_group("servers started here")
    s.add_argument("--dtype", default="auto", help="--dtype of hotstart, vLLM and transformers serve")
    s.add_argument("--hotstart-args", default="", metavar="ARGS",
                   help="extra `hotstart serve` flags, every hotstart")
    s.add_argument("--peer-args", default="", metavar="ARGS", help="extra flags for every --peers server")
    s.add_argument("--llamacpp-threads", type=int, default=None,
                   help="llama.cpp --n_threads (default: every core)")
    s.add_argument("--omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS of every server started here (default: unset: every core)")
    s.add_argument("--ready-timeout", type=float, default=600, help="launch -> /health limit (s)")
    s.add_argument("--fast-path-timeout", type=float, default=900,
                   help="longest wait after /health for hotstart's fast path to be built (0: none)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                   help="memory bandwidth for the roofline fraction (default: the last "
                        "`hotstart bench roofline`, else a quick measurement now)")
    p.add_argument("--roofline-device", default="cpu", choices=["cpu", "cuda"],
                   help="whose memory bandwidth the fraction uses (the servers' device)")
    p.add_argument("--no-roofline", action="store_true",
                   help="no roofline fraction (no bandwidth measurement)")
    p.add_argument("--out", default=None,
                   help="folder for results.json and table.md (default: bench-results/serve-DATE)")
    p.set_defaults(targets=None)


def add_load(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="sustained load, then leak checks (KV blocks, queues, fds, engine process)",
        description="N streaming clients for D seconds (random prompts, lengths, chat or text, temperature 0 "
                    "or 0.7, some hanging up with --abort-frac), then with no client connected /metrics must "
                    "show nothing running, waiting or cached, and the server's fds must not have grown.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start `hotstart serve` itself, stop it after")
    p.add_argument("--pid", type=int, default=None,
                   help="server pid for the fd check (default: the port's owner)")
    p.add_argument("--model", default=None, help="with --spawn: " + MODEL_HELP)
    p.add_argument("--server-args", default="", help="with --spawn: extra `hotstart serve` flags")
    p.add_argument("--dtype", default="auto", help="with --spawn: --dtype for the server")
    p.add_argument("--omp-threads", type=int, default=None,
                   help="with --spawn: OMP_NUM_THREADS for the server")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds clients keep starting requests")
    p.add_argument("--drain-timeout", type=float, default=180.0, help="extra seconds for requests in flight")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--abort-frac", type=float, default=0.0,
                   help="fraction of requests the client drops early")
    p.add_argument("--fd-slack", type=int, default=8, help="extra fds tolerated after the run")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds to wait for idle after the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")


def add_soak(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="a mixed workload for a long time, optional engine faults: errors, latency per window, "
                     "RSS and descriptors of every server process",
        description="--clients loops of mixed requests (plain and streamed chat and text completions, n = 2, "
                    "json_schema, forced tool calls, client hang-ups, bad requests that must get a 4xx) over "
                    "the served models for --duration seconds; per --window: errors by kind, TTFT and total "
                    "latency p50/p90/p99, KV cache usage, RSS and descriptors of each process of the server "
                    "tree; with --fault-every an engine is killed or frozen and its recovery timed. Exit "
                    "status 1 on a 5xx or failed good request outside fault windows, a bad request not "
                    "answered 4xx, a hung request, an unrecovered fault, or a process whose RSS grew by more "
                    "than --rss-growth % / descriptors by more than --fd-slack after its first window "
                    "(docs/reliability.md).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start `hotstart serve` itself, stop it after")
    p.add_argument("--pid", type=int, default=None,
                   help="the server's (API process's) pid (default: the port's owner)")
    p.add_argument("--extra-pid", type=int, action="append", default=None, metavar="PID",
                   help="another process whose tree is sampled and whose engines may be faulted, e.g. a "
                        "zygote's (`hotstart zygote status`; its engines of other servers too); repeatable")
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                   help="with --spawn: what `hotstart serve` serves (repeatable: several = the many-models "
                        "server; default: the embedded model)")
    p.add_argument("--server-args", default="", help="with --spawn: extra `hotstart serve` flags")
    p.add_argument("--dtype", default="auto", help="with --spawn: --dtype for the server")
    p.add_argument("--omp-threads", type=int, default=None,
                   help="with --spawn: OMP_NUM_THREADS for the server")
    p.add_argument("--small-kv", type=float, default=None, metavar="MIB",
                   help="with --spawn: --kv-cache-memory of MIB MiB, so that the first window touches all "
                        "of it and later RSS growth is not first-touched KV pages (--url: start the server "
                        "with --kv-cache-memory BYTES)")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    p.add_argument("--models", default=None, metavar="A,B",
                   help="the models requests name (default: every model /v1/models lists, but failed ones)")
    w = p.add_argument_group("workload")
    w.add_argument("--duration", type=float, default=600.0, help="seconds clients keep starting requests")
    w.add_argument("--clients", type=int, default=12)
    w.add_argument("--mix", default=DEFAULT_MIX, metavar="KIND=W,...",
                   help=f"weights of the request kinds (unnamed ones: 0; default {DEFAULT_MIX})")
    w.add_argument("--min-tokens", type=int, default=8)
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request without its whole answer by then has hung")
    w.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("faults")
    f.add_argument("--fault-every", type=float, default=None, metavar="SECONDS",
                   help="inject a fault into an engine every SECONDS (default: none; more than 5 engine "
                        "deaths within 60 s end the server: keep it above 12)")
    f.add_argument("--fault", choices=["kill", "freeze", "both"], default="kill",
                   help="SIGKILL the engine, SIGSTOP it (the watchdog's case), or alternate")
    f.add_argument("--freeze-for", type=float, default=30.0,
                   help="a frozen engine still there after this many seconds is resumed (SIGCONT)")
    f.add_argument("--fault-grace", type=float, default=2.0,
                   help="seconds after a fault's recovery still counted as its window")
    r = p.add_argument_group("report and goals")
    r.add_argument("--fast-path-timeout", type=float, default=300.0,
                   help="before the clock starts, wait at most this long for the fast path of every model "
                        "to be built (its packed weights are RSS the first window must already hold; 0: "
                        "no wait)")
    r.add_argument("--window", type=float, default=60.0, help="seconds per report line")
    r.add_argument("--sample-every", type=float, default=2.0,
                   help="seconds between samples of RSS, descriptors and KV usage")
    r.add_argument("--rss-growth", type=float, default=15.0,
                   help="%% a process's RSS may grow from its first window to the end")
    r.add_argument("--fd-slack", type=int, default=8,
                   help="descriptors a process may gain from its first window to the end")
    r.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds to wait for the server to be idle before the end sample")
    p.add_argument("--out", default=None, help="write the JSON report here")


def add_over_time(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="throughput over the first minutes since launch, under a steady load",
        description="Per server, one after the other: launch it and at once start --streams client loops of "
                    "streamed greedy chat requests forced to --max-tokens; tokens/s per --window "
                    "since launch.")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--servers", default="hotstart-cold,hotstart-warm,vllm",
                   help=f"in order: {', '.join(OVER_TIME_KINDS)}")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--duration", type=float, default=120.0, help="seconds after launch")
    p.add_argument("--window", type=float, default=5.0, help="seconds per throughput point")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hotstart-args", default="", help="extra `hotstart serve` flags (both hotstart runs)")
    p.add_argument("--peer-args", default="", help="extra flags for the peers")
    p.add_argument("--prime-timeout", type=float, default=900.0, help="longest priming run (hotstart-warm)")
    _quiet(p, 1.5)
    p.add_argument("--out", default="over_time", help="folder for over_time.json and over_time.png")


def add_prefix_cache(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="TTFT of a chat's second turn with and without automatic prefix caching",
        description="Two servers one after the other (prefix caching on, then off); R unique conversations "
                    "each; turn 2's TTFT, the prefix-cache counters, the load average.")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--words", type=int, default=1050,
                   help="words in turn 1's user message (~1.4 tokens each)")
    p.add_argument("--max-load", type=float, default=100.0,
                   help="wait for the 1-minute load average below this")
    p.add_argument("--max-wait", type=float, default=600,
                   help="longest wait for a quiet machine (s; 0: no wait)")
    p.add_argument("--out", default=None, help="write the results as JSON")
