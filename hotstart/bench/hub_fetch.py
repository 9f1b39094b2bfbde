"""The serial way's first half for a hub, run as its own process:
`python -m hotstart.bench.hub_fetch [--modelscope] ORG/NAME CACHE_DIR` downloads the repository with the
hub's own client (huggingface_hub.snapshot_download, plain HTTP: HF_HUB_DISABLE_XET=1 as the caller
sets it; or modelscope.snapshot_download), the endpoint from the environment (HF_ENDPOINT /
MODELSCOPE_ENDPOINT), its import included in the time, then prints {"seconds", "path", "cpu_s"} as JSON.
Only the files a server needs are asked for (config, tokenizer, template, safetensors), as vLLM does."""

from __future__ import annotations

import json
import os
import sys
import time

PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def main() -> int:
    t = time.perf_counter()
    ms = sys.argv[1] == "--modelscope"
    repo, cache = sys.argv[1 + ms], sys.argv[2 + ms]
    if ms:
        from modelscope import snapshot_download

        path = snapshot_download(repo, cache_dir=cache, allow_patterns=PATTERNS)
    else:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo, cache_dir=cache, allow_patterns=PATTERNS)
    usage = os.times()
    print(json.dumps({"seconds": time.perf_counter() - t, "path": str(path),
                      "cpu_s": usage.user + usage.system}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
