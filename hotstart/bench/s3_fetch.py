"""The serial way's first half, run as its own process: `python -m hotstart.bench.s3_fetch BUCKET PREFIX DIR`
downloads every object directly under s3://BUCKET/PREFIX/ into DIR with boto3's transfer manager
(s3transfer: the `aws s3 cp --recursive` machinery, its default concurrency and chunk size), then prints
{"seconds", "bytes"} as JSON. Endpoint and credentials from the environment, as the AWS SDKs read them."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    t = time.perf_counter()
    import boto3

    bucket, prefix, out = sys.argv[1], sys.argv[2].strip("/"), sys.argv[3]
    s3 = boto3.client("s3")
    os.makedirs(out, exist_ok=True)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", Delimiter="/").get("Contents", [])
    total = 0
    for obj in listed:
        name = obj["Key"][len(prefix) + 1 :]
        s3.download_file(bucket, obj["Key"], os.path.join(out, name))
        total += obj["Size"]
    print(json.dumps({"seconds": time.perf_counter() - t, "bytes": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
