"""Every bad s3:// input ends in one `hotstart: error: ...` line and a non-zero exit, no traceback, no
process left, and nothing in the cache that a later start would trust (no manifest, no `current`, no
durable chunk of a file whose bytes were wrong). Against moto's server on loopback, real uploads."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from helpers.cli import Pending, assert_fails_with, hotstart
from helpers.s3 import FaultProxy, Moto, free_port

from hotstart.model.arrival import ArrivalState


@pytest.fixture(scope="module")
def moto():
    m = Moto(auth=True)  # IAM enforced: wrong keys and denied reads are real 403s
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "m"
    run = hotstart(
        "make-model",
        "--family",
        "qwen2",
        "--size",
        "tiny",
        "--dtype",
        "float32",
        "--shard-size",
        "1MB",
        "--out",
        str(out),
        timeout=300,
    )
    assert run.rc == 0, run.stderr
    return out


def trusted(home: Path) -> list[Path]:
    """What a later start would trust: manifests and `current` pointers."""
    return sorted([*home.rglob(".hotstart-s3.json"), *home.rglob("current")]) if home.exists() else []


def durable_chunks(home: Path) -> dict[str, int]:
    out = {}
    for a in home.rglob("*.arrival"):
        st = ArrivalState(a)
        out[a.name.removesuffix(".arrival")] = sum(st.durable(i) for i in range(st.chunks))
        st.close()
    return out


def serve_fails(moto: Moto, home: Path, spec: str, *needles: str, env: dict | None = None) -> str:
    run = hotstart(
        "serve",
        "--port",
        "0",
        spec,
        env={**moto.env(), "HOTSTART_HOME": str(home), **(env or {})},
        timeout=240,
    )
    line = assert_fails_with(run, *needles)
    assert "testing" not in run.stderr and moto.keys["AWS_SECRET_ACCESS_KEY"] not in run.stderr
    assert trusted(home) == [], trusted(home)
    return line


def variant(tiny: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(tiny, out)
    return out


def test_missing_prefix_bucket_and_config(moto, tiny, tmp_path):
    moto.upload("models", "only-weights", tiny, skip=("config.json",))
    home = tmp_path / "home"
    serve_fails(moto, home, "s3://models/no/such/prefix", "no objects under this prefix")
    serve_fails(moto, home, "s3://no-such-bucket/x", "no such bucket")
    serve_fails(moto, home, "s3://models/only-weights", "no config.json")
    serve_fails(moto, home, "s3://Not_A_Bucket/x", "not a valid S3 bucket name")


def test_denied_requests(moto, tiny, tmp_path):
    moto.upload("models", "guarded", tiny)
    home = tmp_path / "home"
    wrong = {"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    line = serve_fails(moto, home, "s3://models/guarded", "access denied", env=wrong)
    assert "wrong-secret" not in line
    # listing and sidecars allowed, the weights denied: the failure reaches the engine's wait and ends startup
    line = serve_fails(
        moto, home, "s3://models/guarded", "access denied", "safetensors", env=moto.users["nodata"]
    )
    assert moto.users["nodata"]["AWS_SECRET_ACCESS_KEY"] not in line


def test_objects_that_disagree_with_their_headers_or_index(moto, tiny, tmp_path):
    home = tmp_path / "home"
    cut = variant(tiny, tmp_path, "cut")
    shard = cut / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])  # an upload cut short
    moto.upload("models", "cut", cut)
    serve_fails(moto, home, "s3://models/cut", "truncated", "model-00003-of-00003")
    assert durable_chunks(home).get("model-00003-of-00003.safetensors", 0) == 0

    longer = variant(tiny, tmp_path, "longer")
    shard = longer / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes() + bytes(4096))
    moto.upload("models", "longer", longer)
    serve_fails(moto, home, "s3://models/longer", "trailing bytes", "model-00002-of-00003")

    moto.upload("models", "lacking", tiny, skip=("model-00002-of-00003.safetensors",))
    serve_fails(moto, home, "s3://models/lacking", "names shard model-00002-of-00003.safetensors")


def test_unreachable_store_without_a_cached_copy(moto, tmp_path):
    home = tmp_path / "home"
    serve_fails(
        moto,
        home,
        "s3://models/tiny",
        "cannot reach the store",
        "no complete copy",
        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
    )


def test_object_replaced_during_the_download(moto, tiny, tmp_path):
    moto.upload("models", "moving", tiny)
    proxy = FaultProxy(moto.port)
    proxy.delay_s = 0.2
    home = tmp_path / "home"
    env = {
        **moto.env(proxy.url),
        "HOTSTART_HOME": str(home),
        "HOTSTART_S3_CHUNK_MB": "0.25",
        "HOTSTART_S3_THREADS": "2",
    }
    try:
        pending = Pending("serve", "--port", "0", "s3://models/moving", env=env)
        deadline = time.monotonic() + 120
        while proxy.gets < 3:
            assert time.monotonic() < deadline and pending.proc.poll() is None, "".join(pending.err)
            time.sleep(0.05)
        s3 = moto.client()
        name = "model-00001-of-00003.safetensors"
        s3.upload_file(
            str(tiny / name),
            "models",
            f"moving/{name}",  # same bytes, a new upload: a new ETag
            ExtraArgs={"Metadata": {"v": "2"}},
            Config=_single_part(),
        )
        run = pending.finish(240)
    finally:
        proxy.stop()
    assert_fails_with(run, "changed on the store")
    assert trusted(home) == []
    assert durable_chunks(home).get(name, 0) == 0


def _single_part():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=1 << 30)
