"""The Balancer: one model's strategy and what prefix_aware learns, driven in virtual time as the
gateway and the routing simulator drive it (look, pick, on_sent, then on_ended, on_cached, on_served)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from modelyard.balancing import RoutingContext
from modelyard.balancing.balancer import Balancer
from modelyard.config import ModelConfig
from modelyard.types import RoutingRequest


@dataclass(slots=True)
class FakeEndpoint:
    name: str
    in_flight: int = 0
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    outstanding_tokens: int = 0
    resources: None = None


def balancer(strategy: str = "prefix_aware") -> Balancer:
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], strategy=strategy)
    return Balancer(model)


def send(b: Balancer, endpoints: list[FakeEndpoint], prompt: str, key: int, now: float, rng: random.Random):
    """One request as the gateway routes it: returns (endpoint, its chunks, its sample)."""
    view = b.look(prompt, [e.name for e in endpoints], now)
    request = RoutingRequest("m", prompt=prompt)
    ctx = RoutingContext(request, key, None, now, view.held, view.waits, view.line, view.roomy)
    chosen = endpoints[b.pick(endpoints, ctx, rng).index]
    chosen.in_flight += 1
    return chosen, view.chunks, b.on_sent(chosen.name, key, ctx, now)


def answer(b: Balancer, endpoint: FakeEndpoint, key: int, chunks, sample, now: float) -> None:
    endpoint.in_flight -= 1
    b.on_ended(endpoint.name, key)
    b.on_cached(endpoint.name, chunks)
    b.on_served(sample, now)


def test_a_prompt_an_endpoint_answered_goes_back_to_it_and_a_new_endpoint_knows_nothing() -> None:
    b, rng = balancer(), random.Random(1)
    endpoints = [FakeEndpoint("a"), FakeEndpoint("b"), FakeEndpoint("c")]
    prompt = "You are a careful assistant. " * 20
    first, chunks, sample = send(b, endpoints, prompt, 1, 0.0, rng)
    answer(b, first, 1, chunks, sample, 0.2)
    for key in range(2, 6):
        again, chunks, sample = send(b, endpoints, prompt + f" question {key}", key, key, rng)
        assert again is first
        answer(b, again, key, chunks, sample, key + 0.1)
    view = b.look(prompt, ["a", "b", "c"], 9.0)
    assert view.held == {e.name: len(view.chunks) if e is first else 0 for e in endpoints}
    b.keep_only([e.name for e in endpoints if e is not first])  # it moved: another server now
    assert b.look(prompt, ["a", "b", "c"], 9.0).held == {"a": 0, "b": 0, "c": 0}


def test_the_service_time_is_learnt_from_tries_that_started_idle_and_queues_show_in_waits() -> None:
    b, rng = balancer(), random.Random(2)
    endpoint = FakeEndpoint("a")
    now = 0.0
    times = []
    for key, length in enumerate(range(100, 1700, 200)):  # 8 tries, one at a time: each starts idle
        chosen, chunks, sample = send(b, [endpoint], "x" * length + str(key), key, now, rng)
        assert sample is not None and sample[2]
        times.append(0.001 * sample[0] + 0.010)  # 1 ms per uncached character, 10 ms more
        now += times[-1]
        answer(b, chosen, key, chunks, sample, now)
    line = b.look("y", ["a"], now).line
    assert line is not None and line[:2] == pytest.approx((0.001, 0.010), rel=1e-6)
    assert line[2] == pytest.approx(sorted(times)[3])  # the median time (the lower of the two)

    # A try sent behind another (one slot) waits there: its time is not the server's, not learnt.
    first, chunks1, sample1 = send(b, [endpoint], "z" * 500, 100, now, rng)
    view = b.look("w" * 300, ["a", "b"], now)
    assert view.waits is not None and view.waits["b"] == 0.0
    # Its flight's time, and (no lateness seen yet) a typical time more: not taken to be over.
    assert view.waits["a"] == pytest.approx(0.001 * 500 + 0.010 + line[2])
    second, chunks2, sample2 = send(b, [endpoint], "w" * 300, 101, now, rng)
    assert sample2 is not None and not sample2[2]
    answer(b, first, 100, chunks1, sample1, now + 0.51)
    answer(b, second, 101, chunks2, sample2, now + 5.0)  # a queue's 5 s
    assert b.service.samples == 9
    assert b.look("y", ["a"], now).line[:2] == pytest.approx((0.001, 0.010), rel=1e-3)  # type: ignore[index]
    assert b.look("y", ["a"], now + 6).waits == {"a": 0.0}  # both ended: nothing in flight


def test_a_switch_away_and_back_keeps_what_was_learnt_and_only_prefix_aware_keeps_flights() -> None:
    b, rng = balancer(), random.Random(3)
    endpoints = [FakeEndpoint("a"), FakeEndpoint("b")]
    chosen, chunks, sample = send(b, endpoints, "p" * 200, 1, 0.0, rng)
    assert b.flights.count(chosen.name) == 1
    b.switch("least_pending")
    assert not b.tracks
    ctx = RoutingContext(RoutingRequest("m", prompt="q" * 200), 2, None, 0.1)
    assert b.on_sent("a", 2, ctx, 0.1) is None and b.flights.count("a") + b.flights.count("b") == 1
    answer(b, chosen, 1, chunks, sample, 0.3)  # the flight sent before the switch still ends
    assert not b.flights
    b.switch("prefix_aware")
    assert b.tracks and b.strategy.name == "prefix_aware"
    assert b.look("p" * 200, ["a", "b"], 1.0).held[chosen.name] == len(chunks)


def test_tries_that_end_later_than_expected_make_a_full_endpoint_wait_longer() -> None:
    # An answer's length is not known when it is sent: a full server whose flights look over by
    # the line is not free, it is as late as tries have been (their median).
    b, rng = balancer(), random.Random(4)
    endpoint = FakeEndpoint("a")
    now = 0.0
    for key in range(24):  # one at a time: the line is learnt from the first 8, then each is late
        chosen, chunks, sample = send(b, [endpoint], f"{key} " + "x" * 300, key, now, rng)
        late = 0.2 if sample is not None and sample[3] >= 0 else 0.0
        now += 0.3 + late
        answer(b, chosen, key, chunks, sample, now)
    # (The line learns the late times too, so what is left late is less than the 0.2 s.)
    assert b.lateness.learnt and 0.05 < b.lateness.value < 0.2
    send(b, [endpoint], "y" * 300, 99, now, rng)
    view = b.look("z" * 300, ["a"], now + 5.0)  # its flight is over by the line
    assert view.waits is not None and view.waits["a"] == pytest.approx(b.lateness.value)


def test_a_free_endpoint_is_roomy_for_a_prompt_only_if_a_cold_start_evicts_what_is_wanted_less() -> None:
    # The tail guard holds where a cold start on a free endpoint is paid once (it then holds the
    # prompt); where it would push out a prompt wanted again, a queue is weighed by its cost.
    model = ModelConfig(
        name="m", endpoints=[{"url": "http://127.0.0.1:1"}], strategy="prefix_aware",
        prefix_aware={"max_chunks_per_endpoint": 40},
    )  # fmt: skip
    b, rng = Balancer(model), random.Random(5)
    a = FakeEndpoint("a")
    now = 0.0
    for key in range(8):  # learn the line on "a", one at a time
        chosen, chunks, sample = send(b, [a], f"{key} " + "x" * 600, key, now, rng)
        now += 0.1
        answer(b, chosen, key, chunks, sample, now)
    hot = b.prefixes.chunks("h" * 64 * 30)  # 30 chunks, held by "a"
    b.on_cached("a", hot)
    assert b.look("h" * 64 * 30, ["a", "b"], now).roomy is None  # no queue anywhere: no guard needed
    send(b, [a], "busy", 99, now, rng)  # "a" now has its one slot taken
    assert b.look("h" * 64 * 30, ["a", "b"], now).roomy == {"b"}  # "b" is empty: room for all 30
    b.on_cached("b", b.prefixes.chunks("z" * 64 * 20))  # "b" holds 20 of its 40, just sent
    # 30 more would push out 10 of those, sent after the hot prompt was: wanted more than it.
    assert b.look("h" * 64 * 30, ["a", "b"], now).roomy == frozenset()
    b.on_cached("a", hot)  # the hot prompt is sent again, after "b"'s: now it is the wanted one
    assert b.look("h" * 64 * 30, ["a", "b"], now).roomy == {"b"}
