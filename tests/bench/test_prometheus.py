"""The one client-side reader of /metrics (hotstart/bench/prometheus.py): labels, timestamps, what is no
sample. tests/bench/test_soak_e2e.py reads a real server's /metrics with it."""

from __future__ import annotations

from hotstart.bench.prometheus import metric_value, metric_values, samples


def test_metric_values_with_and_without_the_model_label():
    text = (
        "# HELP hotstart_kv_cache_usage_ratio x\nhotstart_kv_cache_usage_ratio 0.25\n"
        'hotstart_kv_cache_usage_ratio{model="a"} 0.5\nhotstart_kv_cache_usage_ratio{model="b\\"q"} 1.0\n'
        "hotstart_kv_cache_usage_ratio_other 3\n"
    )
    assert metric_values(text, "hotstart_kv_cache_usage_ratio") == {"": 0.25, "a": 0.5, 'b\\"q': 1.0}
    assert metric_value(text, "hotstart_kv_cache_usage_ratio") == 0.25
    assert metric_value(text, "hotstart_kv_cache_usage_ratio_other") == 3.0
    assert metric_value(text, "missing") is None


def test_samples_read_labels_timestamps_and_skip_the_rest():
    text = (
        "# TYPE x counter\n"
        'x_total{endpoint="/v1/{id}",status="200"} 3.0 1700000000000\n'
        'h_bucket{le="+Inf"} +Inf\n'
        "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 7\n"
        "not a sample\n\n"
    )
    assert list(samples(text)) == [
        ("x_total", {"endpoint": "/v1/{id}", "status": "200"}, 3.0),
        ("h_bucket", {"le": "+Inf"}, float("inf")),
        ("vllm:spec_decode_num_drafts_total", {"model_name": "m"}, 7.0),
    ]

