"""The gateway's request metrics: counted on the request path in plain numbers, in the Prometheus
exposition whenever it is read, each request exactly once."""

from __future__ import annotations

import re
import time

from prometheus_client import generate_latest

from modelyard.gateway.metrics import GatewayMetrics

REQUESTS = 'modelyard_requests_total{backend="w0",code="200",model="m",strategy="round_robin"}'
REFUSED = 'modelyard_requests_total{backend="",code="503",model="m",strategy="round_robin"}'
DURATION = "modelyard_request_duration_seconds"
LABELS = {"model": "m", "backend": "w0", "strategy": "round_robin", "code": "200"}


def _page(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.exposition).decode()


def _value(page: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", page, re.M)
    assert match, f"{sample} not in the page"
    return float(match.group(1))


def _bucket(page: str, le: str) -> float:
    return _value(page, DURATION + f'_bucket{{le="{le}",model="m"}}')


def test_requests_are_in_the_page_as_soon_as_it_is_read_each_once() -> None:
    metrics = GatewayMetrics(lambda: [])
    # (0.005 and 60 are buckets' bounds: a sample on a bound is in that bucket, as Prometheus's le)
    for seconds in (0.0004, 0.0004, 0.003, 0.005, 0.7, 60.0, 100.0):
        metrics.observe_request("m", "w0", "round_robin", 200, seconds)
    metrics.observe_request("m", "", "round_robin", 503, 0.0)
    page = _page(metrics)
    assert (_value(page, REQUESTS), _value(page, REFUSED)) == (7, 1)
    assert _value(page, DURATION + '_count{model="m"}') == 8
    assert abs(_value(page, DURATION + '_sum{model="m"}') - 160.7088) < 1e-9
    # Cumulative buckets: each sample in the first bucket whose bound it does not exceed.
    assert _bucket(page, "0.0005") == 3  # 0.0, and 0.0004 twice
    assert _bucket(page, "0.0025") == 3
    assert _bucket(page, "0.005") == 5  # 0.003 and 0.005
    assert _bucket(page, "1.0") == 6
    assert _bucket(page, "30.0") == 6
    assert _bucket(page, "60.0") == 7  # 60.0
    assert _bucket(page, "+Inf") == 8
    assert _page(metrics) == page  # read again: nothing counted twice
    metrics.observe_request("m", "w0", "round_robin", 200, 0.01)
    assert _value(_page(metrics), REQUESTS) == 8
    # Whatever reads the registry gets them too (a flush is the first thing each read does).
    metrics.observe_request("m", "w0", "round_robin", 200, 0.01)
    assert metrics.registry.get_sample_value("modelyard_requests_total", LABELS) == 9


def test_a_label_set_is_created_with_its_first_request_not_at_the_next_read() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.observe_request("m", "w0", "round_robin", 200, 0.001)
    answered = time.time()  # (made at the read, it would be later than this)
    created = metrics.registry.get_sample_value("modelyard_requests_created", LABELS)
    assert created is not None and created < answered
