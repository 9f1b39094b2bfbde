"""The Run:ai Model Streamer's load of s3:// safetensors, run in ITS environment (stdlib +
runai-model-streamer + runai-model-streamer-s3 + torch; nothing of hotstart):
`PYTHON runai_load.py s3://BUCKET/KEY ...` streams every tensor of the files to CPU memory (as vLLM's
--load-format runai_streamer does) and prints
{"import_s", "load_s", "bytes", "tensors"} as JSON: load_s is from the first stream_files call to the last
tensor (its interpreter and import time are import_s, apart). Endpoint and credentials from the
environment."""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    t = time.perf_counter()
    from runai_model_streamer import SafetensorsStreamer

    imported = time.perf_counter()
    nbytes = count = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(sys.argv[1:])
        for _name, tensor in streamer.get_tensors():
            nbytes += tensor.numel() * tensor.element_size()
            count += 1
    print(
        json.dumps(
            {
                "import_s": imported - t,
                "load_s": time.perf_counter() - imported,
                "bytes": nbytes,
                "tensors": count,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
