"""The Prometheus text parser and the snapshot built from vLLM and DCGM metrics."""

from __future__ import annotations

import math

import pytest

from modelyard.cluster import ResourceSnapshot
from modelyard.config import ResourceMetricNames
from modelyard.upstream.scrape import parse_prometheus, snapshot_from_metrics

NAMES = ResourceMetricNames()

VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="lora \\"a\\" \\\\ b"} 2.0 1712345678901
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
vllm:num_requests_running{engine="1",model_name="lora"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:gpu_cache_usage_perc{engine="2",model_name="m"} NaN
# a free-form comment
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 7.5
vllm:e2e_request_latency_seconds_count{model_name="m"} 9.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 1234.0
"""


def dcgm(name: str, *values: float) -> str:
    lines = [f"# HELP {name} x", f"# TYPE {name} gauge"]
    for gpu, value in enumerate(values):
        lines.append(f'{name}{{gpu="{gpu}",UUID="GPU-{gpu}",modelName="NVIDIA H100 80GB HBM3"}} {value}')
    return "\n".join(lines) + "\n"


def snapshot(text: str, *, names: ResourceMetricNames = NAMES, in_flight: int = 0) -> ResourceSnapshot:
    return snapshot_from_metrics(parse_prometheus(text), names, now=100.0, in_flight=in_flight)


# parse_prometheus


def test_parse_keeps_every_series_with_its_labels() -> None:
    families = parse_prometheus(VLLM)
    assert families["vllm:num_requests_waiting"] == [
        ({"engine": "0", "model_name": "meta-llama/Llama-3.1-8B-Instruct"}, 3.0),
        ({"engine": "1", "model_name": 'lora "a" \\ b'}, 2.0),  # escapes undone, timestamp dropped
    ]


def test_parse_keys_by_sample_name_and_reads_special_values() -> None:
    families = parse_prometheus(VLLM)
    assert math.isnan(families["vllm:gpu_cache_usage_perc"][2][1])
    assert families["vllm:e2e_request_latency_seconds_bucket"][1] == ({"le": "+Inf", "model_name": "m"}, 9.0)
    assert families["vllm:prompt_tokens_total"] == [({"model_name": "m"}, 1234.0)]
    assert parse_prometheus("up +Inf\ndown -Inf 5\n") == {"up": [({}, math.inf)], "down": [({}, -math.inf)]}


def test_parse_ignores_comments_and_blank_lines() -> None:
    assert parse_prometheus("# only a comment\n\n# HELP x y\n") == {}
    assert parse_prometheus("") == {}


def test_parse_only_keeps_the_named_samples() -> None:
    families = parse_prometheus(VLLM, only={"vllm:num_requests_running", "absent"})
    assert list(families) == ["vllm:num_requests_running"]
    assert [value for _, value in families["vllm:num_requests_running"]] == [8.0, 1.0]


@pytest.mark.parametrize("text", ['x{a="b} 1\n', 'x{a="1", ="f"} 1\n', "x one\n"])
def test_parse_malformed_text_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="malformed"):
        parse_prometheus(text)


# snapshot_from_metrics: vLLM


def test_vllm_queue_and_running_sum_over_series_cache_is_the_fullest() -> None:
    snap = snapshot(VLLM, in_flight=5)
    assert snap.taken_at == 100.0
    assert snap.queue_depth == 5.0
    assert snap.running == 9.0
    assert snap.kv_cache_usage == 0.75  # the NaN series is ignored, not propagated
    assert snap.in_flight_at_scrape == 5


def test_vllm_only_leaves_gpu_signals_missing() -> None:
    snap = snapshot(VLLM)
    assert snap.sm_utilization is None
    assert snap.memory_used is None


def test_missing_signals_are_none() -> None:
    assert snapshot("other_metric 1\n") == ResourceSnapshot(taken_at=100.0)


def test_a_signal_with_only_nan_series_is_none() -> None:
    assert snapshot('vllm:num_requests_waiting{m="a"} NaN\n').queue_depth is None


def test_zero_is_a_reading_not_a_missing_signal() -> None:
    snap = snapshot("vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0\n")
    assert snap.queue_depth == 0.0
    assert snap.kv_cache_usage == 0.0


# snapshot_from_metrics: DCGM


def test_dcgm_gpu_util_is_percent_averaged_over_gpus() -> None:
    assert snapshot(dcgm("DCGM_FI_DEV_GPU_UTIL", 50, 100)).sm_utilization == pytest.approx(0.75)


def test_dcgm_gpu_util_of_one_percent_is_not_read_as_a_ratio() -> None:
    assert snapshot(dcgm("DCGM_FI_DEV_GPU_UTIL", 1, 0)).sm_utilization == pytest.approx(0.005)


def test_dcgm_sm_active_is_a_ratio_averaged_over_gpus() -> None:
    assert snapshot(dcgm("DCGM_FI_PROF_SM_ACTIVE", 0.2, 0.6)).sm_utilization == pytest.approx(0.4)


def test_the_first_sm_name_present_wins() -> None:
    text = dcgm("DCGM_FI_PROF_SM_ACTIVE", 0.1) + dcgm("DCGM_FI_DEV_GPU_UTIL", 90)
    assert snapshot(text).sm_utilization == pytest.approx(0.1)
    names = ResourceMetricNames(sm_utilization=["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_SM_ACTIVE"])
    assert snapshot(text, names=names).sm_utilization == pytest.approx(0.9)


def test_an_unknown_sm_name_above_one_is_read_as_percent() -> None:
    names = ResourceMetricNames(sm_utilization=["custom_gpu_busy"])
    assert snapshot("custom_gpu_busy 40\n", names=names).sm_utilization == pytest.approx(0.4)
    assert snapshot("custom_gpu_busy 0.4\n", names=names).sm_utilization == pytest.approx(0.4)


def test_memory_used_is_used_over_total_summed_over_gpus() -> None:
    text = dcgm("DCGM_FI_DEV_FB_USED", 60000, 20000) + dcgm("DCGM_FI_DEV_FB_FREE", 20000, 60000)
    assert snapshot(text).memory_used == pytest.approx(0.5)


def test_memory_needs_both_used_and_free() -> None:
    assert snapshot(dcgm("DCGM_FI_DEV_FB_USED", 60000)).memory_used is None
    assert snapshot(dcgm("DCGM_FI_DEV_FB_FREE", 60000)).memory_used is None
    assert snapshot(dcgm("DCGM_FI_DEV_FB_USED", 0) + dcgm("DCGM_FI_DEV_FB_FREE", 0)).memory_used is None


def test_vllm_and_dcgm_together_fill_every_signal() -> None:
    text = (
        VLLM
        + dcgm("DCGM_FI_DEV_GPU_UTIL", 30)
        + dcgm("DCGM_FI_DEV_FB_USED", 10)
        + dcgm("DCGM_FI_DEV_FB_FREE", 30)
    )
    snap = snapshot(text)
    assert (snap.queue_depth, snap.running, snap.kv_cache_usage) == (5.0, 9.0, 0.75)
    assert snap.sm_utilization == pytest.approx(0.3)
    assert snap.memory_used == pytest.approx(0.25)


def test_custom_names_are_read() -> None:
    names = ResourceMetricNames(queue_depth="tgi_queue_size", running="tgi_batch_current_size")
    snap = snapshot("tgi_queue_size 7\ntgi_batch_current_size 3\n", names=names)
    assert (snap.queue_depth, snap.running) == (7.0, 3.0)


def test_vllm_v1s_kv_cache_name_is_read_first_and_v0s_still_works() -> None:
    v1 = "vllm:kv_cache_usage_perc 0.4\n"
    v0 = "vllm:gpu_cache_usage_perc 0.9\n"
    assert snapshot(v1).kv_cache_usage == 0.4
    assert snapshot(v0).kv_cache_usage == 0.9
    assert snapshot(v1 + v0).kv_cache_usage == 0.4  # V1's when a server exports both
    # A config naming one metric, as before, still works.
    custom = ResourceMetricNames(kv_cache_usage="my_kv")  # type: ignore[arg-type]
    assert custom.kv_cache_usage == ["my_kv"]
    assert snapshot("my_kv 0.5\n" + v1, names=custom).kv_cache_usage == 0.5
