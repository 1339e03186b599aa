"""A cluster owns its endpoints, counters and health: replaced endpoints keep their state, and an
endpoint taken out aborts the tries still waiting on it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from modelyard.balancing import RoutingContext
from modelyard.cluster import BackendLoad
from modelyard.config import EndpointConfig, ModelConfig
from modelyard.errors import EndpointTakenOut, NotFound, RoutesInvalid, UnknownStrategy, UpstreamError
from modelyard.gateway.cluster import Cluster
from modelyard.types import RoutingRequest


class Recorder:
    def __init__(self) -> None:
        self.health: list[tuple[str, bool]] = []
        self.outliers: list[tuple[str, str]] = []

    def health_changed(self, model: str, endpoint: str, healthy: bool) -> None:
        self.health.append((endpoint, healthy))

    def outlier(self, model: str, endpoint: str, event: str) -> None:
        self.outliers.append((endpoint, event))


class FakeFlight:
    """A try waiting for its answer (the cluster's Abortable), recording how it was aborted."""

    def __init__(self) -> None:
        self.aborted: list[UpstreamError] = []

    def abort(self, error: UpstreamError) -> None:
        self.aborted.append(error)


def endpoints(*names: str, subset: str = "default") -> list[dict[str, Any]]:
    return [{"name": n, "url": f"http://127.0.0.1:{9000 + i}", "subset": subset} for i, n in enumerate(names)]


def cluster(*names: str, recorder: Recorder | None = None, **fields: Any) -> Cluster:
    config = ModelConfig.model_validate({"name": "m", "endpoints": endpoints(*names), **fields})
    recorder = recorder or Recorder()
    return Cluster(config, {}, recorder.health_changed, recorder.outlier)


def test_replace_endpoints_keeps_the_state_of_endpoints_that_stay() -> None:
    c = cluster("a", "b")
    a, b = c.endpoints
    c.record_probe(a, "health check failed")  # first verdict counts at once
    c.record_outcome(b, ok=False, latency=None, now=1.0)
    c.replace_endpoints(
        [EndpointConfig(name="a", url=a.url), EndpointConfig(name="c", url="http://127.0.0.1:9100")]
    )
    kept, added = c.endpoints
    assert kept is a and not kept.health.healthy
    assert added.name == "c" and added.health.healthy
    assert set(c.outliers) == {"a", "c"}
    assert [e.name for e in c.subset("default")] == ["a", "c"]
    assert [e.name for e in c.routable("default", 2.0)] == ["c"]


def test_an_endpoint_that_stays_takes_its_new_settings_and_keeps_its_state() -> None:
    c = cluster("a")
    (a,) = c.endpoints
    c.record_probe(a, "down")
    c.replace_endpoints([EndpointConfig(name="a", url=a.url, weight=5, metrics_url="http://127.0.0.1:1/m")])
    (same,) = c.endpoints
    assert same is a and same.weight == 5 and same.metrics_url == "http://127.0.0.1:1/m"
    assert not same.health.healthy


def test_a_name_moved_to_another_url_starts_afresh() -> None:
    detection = {"consecutive_5xx": 1, "max_ejection_percent": 50}
    c = cluster("a", "b", outlier_detection=detection)
    c.record_outcome(c.endpoints[0], ok=False, latency=None, now=1.0)  # a is ejected
    c.replace_endpoints(
        [
            EndpointConfig(name="a", url="http://127.0.0.1:9500"),
            EndpointConfig(name="b", url=c.endpoints[1].url),
        ]
    )
    assert not c.outliers["a"].ejected
    assert [e.name for e in c.routable("default", 1.1)] == ["a", "b"]


def test_replaced_endpoints_are_what_route_updates_are_checked_against() -> None:
    c = cluster("a")
    c.replace_endpoints(
        [
            EndpointConfig(name="a", url=c.endpoints[0].url),
            EndpointConfig(name="v2", url="http://127.0.0.1:9300", subset="v2"),
        ]
    )
    c.replace_routes([{"name": "to-v2", "destinations": [{"subset": "v2"}]}])
    assert [e.name for e in c.routable(c.route_for({}, None).destinations[0].subset, 0.0)] == ["v2"]
    assert c.subset_names == ["default", "v2"]


async def test_requests_waiting_for_room_look_again_when_endpoints_change() -> None:
    c = cluster("a", circuit_breakers={"max_requests": 1, "max_pending_requests": 4})
    waiting = asyncio.create_task(c.capacity.wait("default", time.monotonic() + 60))
    await asyncio.sleep(0)
    c.replace_endpoints([*c.config.endpoints, EndpointConfig(name="b", url="http://127.0.0.1:9400")])
    await asyncio.wait_for(waiting, 1)  # woken to look at the new endpoint, not left until 429


def test_endpoints_on_one_server_share_its_load_across_clusters() -> None:
    loads: dict[str, BackendLoad] = {}
    config = ModelConfig.model_validate({"name": "m", "endpoints": endpoints("a")})
    first, second = Cluster(config, loads), Cluster(config.model_copy(update={"name": "n"}), loads)
    first.acquire(first.endpoints[0], tokens=10)
    assert second.endpoints[0].in_flight == 1 and second.endpoints[0].outstanding_tokens == 10
    first.release(first.endpoints[0], tokens=10)
    assert second.endpoints[0].in_flight == 0


def test_the_overview_shows_each_models_own_requests_on_a_shared_server_beside_the_servers() -> None:
    loads: dict[str, BackendLoad] = {}
    config = ModelConfig.model_validate({"name": "m", "endpoints": endpoints("a")})
    busy, idle = Cluster(config, loads), Cluster(config.model_copy(update={"name": "n"}), loads)
    busy.acquire(busy.endpoints[0], tokens=10)
    busy.acquire(busy.endpoints[0], tokens=10)
    (theirs,) = idle.describe(now=0.0)["endpoints"]
    (mine,) = busy.describe(now=0.0)["endpoints"]
    assert (theirs["model_in_flight"], theirs["in_flight"]) == (0, 2)  # none of n's: both are m's
    assert (mine["model_in_flight"], mine["in_flight"]) == (2, 2)
    busy.release(busy.endpoints[0], tokens=10)
    assert busy.describe(now=0.0)["endpoints"][0]["model_in_flight"] == 1


def test_a_failed_health_check_aborts_the_tries_waiting_on_that_endpoint_only() -> None:
    recorder = Recorder()
    c = cluster("a", "b", recorder=recorder, health_check={"unhealthy_threshold": 2})
    a, b = c.endpoints
    waiting_a, answered_a, waiting_b = FakeFlight(), FakeFlight(), FakeFlight()
    c.awaiting_answer(a, waiting_a)
    c.awaiting_answer(a, answered_a)
    c.awaiting_answer(b, waiting_b)
    c.answered(a, answered_a)  # its head arrived: no longer abortable
    c.record_probe(a, "")  # first probe passes
    c.record_probe(a, "timed out")
    assert waiting_a.aborted == []  # one failure is below the threshold
    c.record_probe(a, "timed out")
    assert recorder.health == [("a", False)]
    (error,) = waiting_a.aborted
    assert isinstance(error, EndpointTakenOut) and "timed out" in error.message
    assert answered_a.aborted == [] and waiting_b.aborted == []
    assert [e.name for e in c.routable("default", 0.0)] == ["b"]


def test_an_ejection_aborts_the_tries_waiting_on_the_ejected_endpoint() -> None:
    recorder = Recorder()
    c = cluster(
        "a", "b", "c", recorder=recorder, outlier_detection={"consecutive_5xx": 2, "max_ejection_percent": 50}
    )
    a = c.endpoints[0]
    flight = FakeFlight()
    c.awaiting_answer(a, flight)
    c.record_outcome(a, ok=False, latency=None, now=1.0)
    assert flight.aborted == []
    c.record_outcome(a, ok=False, latency=None, now=1.1)
    assert ("a", "consecutive_5xx") in recorder.outliers
    assert len(flight.aborted) == 1 and "ejected" in flight.aborted[0].message
    assert [e.name for e in c.routable("default", 1.2)] == ["b", "c"]


def test_a_connection_failure_takes_the_endpoint_out_only_with_active_checks() -> None:
    checked = cluster("a")
    checked.record_connection_failure(checked.endpoints[0], "refused")
    assert list(checked.routable("default", 0.0)) == [] and not checked.ready
    unchecked = cluster("a", health_check={"interval": 0})
    unchecked.record_connection_failure(unchecked.endpoints[0], "refused")  # (nothing would bring it back)
    assert list(unchecked.routable("default", 0.0)) == list(unchecked.endpoints)


def test_an_adopted_verdict_keeps_the_error_only_when_it_failed() -> None:
    c = cluster("a")
    endpoint = c.endpoints[0]
    c.adopt_health(endpoint, False, "failed the health check")
    assert not endpoint.health.healthy and endpoint.health.last_error == "failed the health check"
    c.adopt_health(endpoint, True, "failed the health check")  # the siblings pass one error for both
    assert endpoint.health.healthy and endpoint.health.checked and endpoint.health.last_error == ""


def test_panic_mode_routes_over_the_whole_subset_below_the_threshold() -> None:
    recorder = Recorder()
    c = cluster("a", "b", "c", recorder=recorder, healthy_panic_threshold=50)
    a, b, _ = c.endpoints
    c.record_probe(a, "down")
    assert [e.name for e in c.routable("default", 0.0)] == ["b", "c"]
    c.record_probe(b, "down")  # one of three left: below 50%
    assert [e.name for e in c.routable("default", 0.0)] == ["a", "b", "c"]
    assert ("", "panic") in recorder.outliers and "default" in c.panicking


def test_routes_select_and_replace_atomically() -> None:
    c = cluster(
        "a",
        routes=[
            {
                "name": "only-v2",
                "match": {"headers": [{"name": "x-v", "exact": "2"}]},
                "destinations": [{"subset": "default"}],
            }
        ],
    )
    assert c.route_for({"x-v": "2"}, None).name == "only-v2"
    with pytest.raises(NotFound, match="only-v2"):
        c.route_for({}, None)
    with pytest.raises(RoutesInvalid, match="subset 'nope'"):
        c.replace_routes([{"name": "r", "destinations": [{"subset": "nope"}]}])
    assert [r.name for r in c.routes] == ["only-v2"]  # unchanged after a refused update
    c.replace_routes([])
    assert c.route_for({}, None).name == "default"  # the implicit route


def test_switching_strategy_builds_a_new_one_and_keeps_the_sequence() -> None:
    c = cluster("a", "b")
    c.next_seq()
    c.set_strategy("least_pending")
    assert c.balancer.strategy.name == "least_pending" and c.next_seq() == 1
    with pytest.raises(UnknownStrategy):
        c.set_strategy("fastest")
    assert c.balancer.strategy.name == "least_pending"


def test_what_an_endpoint_cached_is_forgotten_when_it_goes_or_moves() -> None:
    c = cluster("a", "b", strategy="prefix_aware")
    chunks = c.balancer.prefixes.chunks("a prompt long enough to fill a couple of chunks " * 4)
    for name in ("a", "b"):
        c.balancer.prefixes.record(chunks, name)
    a, _b = c.endpoints
    c.replace_endpoints(
        [EndpointConfig(name="a", url=a.url), EndpointConfig(name="b", url="http://127.0.0.1:1")]
    )
    assert c.balancer.prefixes.match(chunks, "a") == len(chunks)  # stayed: its cache is still there
    assert c.balancer.prefixes.match(chunks, "b") == 0  # same name, another server: nothing cached
    c.replace_endpoints([EndpointConfig(name="a", url=a.url)])
    assert set(c.balancer.prefixes.sizes()) == {"a"}


def test_each_answer_ends_its_own_flight_and_only_prefix_aware_keeps_them() -> None:
    c = cluster("a", strategy="least_pending")
    (a,) = c.endpoints
    flights = c.balancer.flights
    ctx = RoutingContext(RoutingRequest("m", prompt="p" * 100), prefix={"a": 1}, service=(0.001, 0.01, 0.1))
    c.acquire(a, 10)
    assert c.balancer.on_sent("a", 1, ctx, now=5.0) is None
    assert flights.count("a") == 0  # least_pending: nothing kept
    c.set_strategy("prefix_aware")
    c.acquire(a, 10)
    sent = c.balancer.on_sent("a", 2, ctx, now=5.0)
    assert sent == pytest.approx((36, 5.0, True, 5.046))  # 100 characters, 64 held: ends at 5.046
    assert flights.wait("a", 5.0, (0.001, 0.01)) == pytest.approx(0.046)  # 36 x 1 ms + 10 ms
    c.release(a, 10, key=1)  # the try started before the switch ends nothing of the new one's
    assert flights.count("a") == 1 and a.model_in_flight == 1
    c.release(a, 10, key=2)
    assert flights.count("a") == 0 and a.model_in_flight == 0


def test_describe_shows_the_model_and_each_endpoints_state_as_the_overview_does() -> None:
    c = cluster(
        "a",
        "b",
        "c",
        "d",
        routes=[{"name": "all", "destinations": [{"subset": "default"}]}],
        outlier_detection={"consecutive_5xx": 1, "base_ejection_time": "30s", "max_ejection_percent": 50},
        circuit_breakers={"max_requests": 1, "max_pending_requests": 7},
        healthy_panic_threshold=100,
    )
    a, b, _, d = c.endpoints
    c.record_probe(a, "connection refused")
    c.record_outcome(b, ok=False, latency=None, now=10.0)  # ejected until 40
    c.acquire(d, tokens=12)
    c.budget.request_started()
    c.budget.retry_started()
    c.routable("default", 10.0)  # 2 of 4 routable: below 100%, panic
    described = c.describe(now=12.5)
    assert {k: v for k, v in described.items() if k != "endpoints"} == {
        "name": "m",
        "strategy": "round_robin",
        "ready": True,
        "routes": ["all"],
        "panic_subsets": ["default"],
        "queued": 0,
        "max_pending_requests": 7,
        "active_requests": 1,
        "retries_in_flight": 1,
    }
    first, ejected, idle, busy = described["endpoints"]
    assert first["health"] == {"status": "unhealthy", "checked": True, "last_error": "connection refused"}
    assert first["routable"] is False and first["ejection"]["ejected"] is False
    assert ejected["ejection"] == {
        "ejected": True,
        "seconds_left": 27.5,
        "ejections": 1,
        "consecutive_failures": 1,
    }
    assert ejected["health"]["status"] == "healthy" and ejected["routable"] is False
    assert idle == {
        "name": "c",
        "url": "http://127.0.0.1:9002",
        "grpc_url": None,
        "subset": "default",
        "weight": 1,
        "health": {"status": "healthy", "checked": False, "last_error": ""},
        "in_flight": 0,
        "model_in_flight": 0,
        "outstanding_tokens": 0,
        "ejection": {"ejected": False, "seconds_left": None, "ejections": 0, "consecutive_failures": 0},
        "circuit": {"state": "closed", "max_requests": 1},
        "routable": True,
        "kv_events": None,  # (no KV events configured: precise mode off)
    }
    assert (busy["in_flight"], busy["outstanding_tokens"]) == (1, 12)
    assert busy["circuit"] == {"state": "open", "max_requests": 1}
    described["endpoints"].clear()  # a copy: the cluster keeps its own
    assert len(c.describe(now=12.5)["endpoints"]) == 4


def names(c: Cluster, now: float = 0.0) -> list[str]:
    return [e.name for e in c.routable("default", now)]


def test_what_is_routable_follows_every_change_of_health_ejection_and_endpoints() -> None:
    """`routable` answers from what it worked out last until something changes it: each change
    shows at once. What a caller gets is read-only (it is what the next caller gets too)."""
    c = cluster("a", "b", "c", outlier_detection={"consecutive_5xx": 1, "max_ejection_percent": 100})
    a, b, cc = c.endpoints
    assert names(c) == ["a", "b", "c"]
    got = c.routable("default", 0.0)
    assert isinstance(got, tuple)  # (no copy per request, so none to change)
    assert names(c) == ["a", "b", "c"]

    c.record_probe(a, "down")  # a failed health check
    assert names(c) == ["b", "c"]
    c.record_probe(a, "")  # (healthy_threshold: 1 by default)
    assert names(c) == ["a", "b", "c"]

    c.adopt_health(b, False, "down")  # another worker's verdict
    assert names(c) == ["a", "c"]
    c.adopt_health(b, True, "")
    assert names(c) == ["a", "b", "c"]

    c.record_connection_failure(cc, "refused")
    assert names(c) == ["a", "b"]
    c.record_probe(cc, "")
    assert names(c) == ["a", "b", "c"]

    c.record_outcome(b, ok=False, latency=None, now=1.0)  # ejected by outlier detection
    assert names(c, 1.0) == ["a", "c"]
    until = 1.0 + c.config.outlier_detection.base_ejection_time
    assert names(c, until) == ["a", "b", "c"]  # its ejection is over

    assert c.adopt_ejection("a", until + 30.0, 1, until)  # another worker's ejection
    assert names(c, until) == ["b", "c"]

    c.replace_endpoints([EndpointConfig(name="d", url="http://127.0.0.1:9200")])
    assert names(c, until) == ["d"]
