"""The exchange ledger: an exchange is closed once, whoever closes it and however often, and what
closing does (the endpoint freed, the request counted in metrics and the routing log, the retry
budget's count ended) happens exactly once; a retried try is counted apart. No server: a real
cluster, metrics and routing log, and an answer that records being closed."""

from __future__ import annotations

import asyncio
import time

import pytest

from modelyard.balancing import Pick, RoutingContext
from modelyard.config import ModelConfig
from modelyard.errors import Overloaded, UpstreamTimeout
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.exchange import Exchange
from modelyard.gateway.ledger import CLIENT_CLOSED, Ledger, ended_with
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.types import RoutingRequest


class FakeAnswer:
    status = 200
    closed = 0

    def close(self) -> None:
        self.closed += 1


def setup() -> tuple[Ledger, GatewayMetrics, Cluster]:
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "endpoints": [
                {"name": "a", "url": "http://127.0.0.1:9"},
                {"name": "b", "url": "http://127.0.0.1:10"},
            ],
        }
    )
    cluster = Cluster(config, {}, lambda *_: None, lambda *_: None)
    metrics = GatewayMetrics(lambda: [])
    return Ledger(metrics, None, None), metrics, cluster


def exchange(cluster: Cluster, counted: bool = True) -> Exchange:
    route = cluster.route_for({}, None)
    ctx = RoutingContext(RoutingRequest("m"), cluster.next_seq(), now=time.monotonic())
    ex = Exchange(
        cluster, route, "", ctx, "POST", "/v1/chat/completions", [], b"{}", 10, time.perf_counter(), "id-1"
    )
    ex.counted = counted
    return ex


def hold(ex: Exchange, name: str) -> None:
    """As the attempt loop does: an endpoint acquired for a try."""
    endpoint = next(e for e in ex.cluster.endpoints if e.name == name)
    ex.cluster.acquire(endpoint, ex.tokens)
    ex.held = (endpoint, Pick(0), time.perf_counter())


def statuses(metrics: GatewayMetrics) -> list[tuple[str, int]]:
    return [(r.backend, r.status) for r in metrics.routing_log.recent()]


def test_an_exchange_closed_twice_is_freed_and_counted_once() -> None:
    ledger, metrics, cluster = setup()
    ex = exchange(cluster)
    ledger.open(ex, None)
    hold(ex, "a")
    answer = FakeAnswer()
    ex.answer = answer  # type: ignore[assignment]
    assert cluster.budget.active == 1 and cluster.endpoints[0].load.in_flight == 1
    ledger.close(ex, 200)
    ledger.close(ex, CLIENT_CLOSED)  # (the proxy's safety net, after the relay closed it)
    assert answer.closed == 1
    assert cluster.endpoints[0].load.in_flight == 0 and cluster.budget.active == 0
    assert statuses(metrics) == [("a", 200)]


def test_a_retried_try_is_counted_apart_and_the_request_once_with_how_it_ended() -> None:
    ledger, metrics, cluster = setup()
    ex = exchange(cluster)
    ledger.open(ex, None)
    hold(ex, "a")
    ledger.try_ended(ex, 503)  # retried on another endpoint
    assert cluster.endpoints[0].load.in_flight == 0 and ex.held is None
    hold(ex, "b")
    ledger.close(ex, 504)  # the route's time ran out on the second try
    assert statuses(metrics) == [("a", 503), ("b", 504)]
    assert [e.load.in_flight for e in cluster.endpoints] == [0, 0] and cluster.budget.active == 0


def test_a_request_that_never_held_an_endpoint_is_logged_without_one() -> None:
    ledger, metrics, cluster = setup()
    ex = exchange(cluster)
    ledger.open(ex, None)
    ledger.close(ex, Overloaded.status)
    assert statuses(metrics) == [("", 429)] and cluster.budget.active == 0


def test_a_shadow_copy_frees_its_endpoint_but_is_not_counted_nor_in_the_budget() -> None:
    ledger, metrics, cluster = setup()
    primary = exchange(cluster)
    ledger.open(primary, None)
    copy = primary.shadow(primary.route, "")
    hold(copy, "b")
    ledger.close(copy, 200)
    assert cluster.endpoints[1].load.in_flight == 0
    assert statuses(metrics) == [] and cluster.budget.active == 1  # the primary's, still open
    ledger.close(primary, 200)
    assert cluster.budget.active == 0


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (UpstreamTimeout("slow"), 504),
        (asyncio.CancelledError(), CLIENT_CLOSED),
        (ConnectionResetError(), CLIENT_CLOSED),
        (GeneratorExit(), CLIENT_CLOSED),
        (KeyError("bug"), 500),
    ],
)
def test_an_exchange_ended_by_an_exception_is_closed_with_its_status(
    error: BaseException, status: int
) -> None:
    assert ended_with(error) == status


def test_counting_that_fails_still_frees_the_endpoint_and_ends_the_budgets_count_and_the_capture() -> None:
    """A bug in what counts the request (here the routing log's sharing) must not leave the model's
    retry budget one request too high for ever, nor a shadow comparison waiting."""
    ledger, metrics, cluster = setup()

    def broken(entry: object) -> None:
        raise RuntimeError("sharing failed")

    metrics.routing_log.share = broken
    ex = exchange(cluster)
    ledger.open(ex, None)
    ended: list[float] = []
    ex.capture = type("Capture", (), {"ended": lambda self, seconds: ended.append(seconds)})()  # type: ignore[assignment]
    hold(ex, "a")
    with pytest.raises(RuntimeError):
        ledger.close(ex, 200)
    assert cluster.endpoints[0].load.in_flight == 0 and cluster.budget.active == 0 and len(ended) == 1
    ledger.close(ex, CLIENT_CLOSED)  # (and a second close still does nothing)
    assert cluster.budget.active == 0


def requests_total(metrics: GatewayMetrics, backend: str, code: int) -> float:
    metrics.flush()
    labels = {"model": "m", "backend": backend, "strategy": "round_robin", "code": str(code)}
    return metrics.registry.get_sample_value("modelyard_requests_total", labels) or 0.0


def test_a_request_that_never_reached_an_endpoint_is_in_the_request_metrics_once() -> None:
    """A 429 from the queue or a 503 with nothing healthy is what a client got: counted, without a
    backend; one whose earlier try was counted already is not counted again."""
    ledger, metrics, cluster = setup()
    ex = exchange(cluster)
    ledger.open(ex, None)
    ledger.close(ex, Overloaded.status)
    assert requests_total(metrics, "", 429) == 1
    retried = exchange(cluster)
    ledger.open(retried, None)
    hold(retried, "a")
    retried.tries = 1
    ledger.try_ended(retried, 503)
    ledger.close(retried, 503)  # then nothing healthy to retry on
    assert requests_total(metrics, "a", 503) == 1 and requests_total(metrics, "", 503) == 0
