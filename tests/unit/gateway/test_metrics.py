"""The gateway's request metrics: counted on the request path in plain numbers, in the Prometheus
exposition whenever it is read, each request exactly once."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from modelyard.gateway.metrics import GatewayMetrics


def _page(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.exposition).decode()


def _value(page: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", page, re.M)
    assert match, f"{sample} not in the page"
    return float(match.group(1))


def test_requests_are_in_the_page_as_soon_as_it_is_read_each_once() -> None:
    metrics = GatewayMetrics(lambda: [])
    for seconds in (0.0004, 0.0004, 0.003, 0.7, 100.0):
        metrics.observe_request("m", "w0", "round_robin", 200, seconds)
    metrics.observe_request("m", "", "round_robin", 503, 0.0)
    page = _page(metrics)
    requests = 'modelyard_requests_total{backend="w0",code="200",model="m",strategy="round_robin"}'
    assert _value(page, requests) == 5
    assert (
        _value(page, 'modelyard_requests_total{backend="",code="503",model="m",strategy="round_robin"}') == 1
    )
    duration = "modelyard_request_duration_seconds"
    assert _value(page, duration + '_count{model="m"}') == 6
    assert abs(_value(page, duration + '_sum{model="m"}') - 100.7038) < 1e-9
    # Cumulative buckets: each sample in the first bucket whose bound it does not exceed.
    assert _value(page, duration + '_bucket{le="0.0005",model="m"}') == 3  # 0.0 and 0.0004 twice
    assert _value(page, duration + '_bucket{le="0.005",model="m"}') == 4
    assert _value(page, duration + '_bucket{le="1.0",model="m"}') == 5
    assert _value(page, duration + '_bucket{le="60.0",model="m"}') == 5
    assert _value(page, duration + '_bucket{le="+Inf",model="m"}') == 6
    assert _page(metrics) == page  # read again: nothing counted twice
    metrics.observe_request("m", "w0", "round_robin", 200, 0.01)
    assert _value(_page(metrics), requests) == 6
    # Whatever reads the registry gets them too (a flush is the first thing each read does).
    metrics.observe_request("m", "w0", "round_robin", 200, 0.01)
    labels = {"model": "m", "backend": "w0", "strategy": "round_robin", "code": "200"}
    assert metrics.registry.get_sample_value("modelyard_requests_total", labels) == 7
