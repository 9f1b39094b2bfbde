"""The fast path's typed status crosses to the API process (no torch there) and reaches /startup and
/metrics as enum values, never parsed."""

from __future__ import annotations

import msgspec

from hotstart.frontend.metrics import Metrics
from hotstart.messages import BucketState, FastPathStatus, from_engine_decoder
from hotstart.messages import FastPathState as S


def _status() -> FastPathStatus:
    return FastPathStatus("graphs", S.OFF, S.COMPILING, "--compile graphs", "",
                          [BucketState(8, S.READY, 3, "compiled"), BucketState(16, S.FAILED, 0, "boom")], 7)


def test_status_decodes_to_the_enum_and_shows_as_values():
    got = from_engine_decoder.decode(msgspec.msgpack.encode(_status()))
    assert got == _status() and got.buckets[0].state is S.READY and not got.settled()
    shown = msgspec.to_builtins(got)  # /startup's fast_path section
    assert shown["packing"] == "off" and shown["compile"] == "compiling"
    assert shown["buckets"] == [[8, "ready", 3, "compiled"], [16, "failed", 0, "boom"]]


def test_metrics_read_the_typed_states():
    m = Metrics()
    m.update_fast_path(_status())
    text = m.render().decode()
    assert 'hotstart_compiled_bucket_state{bucket="8",state="ready"} 1.0' in text
    assert 'hotstart_compiled_bucket_state{bucket="8",state="compiling"} 0.0' in text
    assert 'hotstart_compiled_bucket_state{bucket="16",state="failed"} 1.0' in text
    assert 'hotstart_compiled_bucket_steps{bucket="8"} 3.0' in text
    assert "hotstart_eager_steps 7.0" in text
