"""prefix_aware: the prefix index (chunk chains, per-endpoint LRU) and the pick (longest prefix
within a load margin)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import pytest

from modelyard.balancing import RoutingContext, build_strategy
from modelyard.balancing.prefix import PrefixIndex
from modelyard.config import ModelConfig
from modelyard.types import RoutingRequest

SYSTEM = "You are a careful assistant. " * 8  # 232 characters shared by many prompts


@dataclass(frozen=True, slots=True)
class FakeEndpoint:
    name: str
    in_flight: int = 0
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    outstanding_tokens: int = 0
    resources: None = None


def pick(
    loads: dict[str, int], held: dict[str, int], margin: int = 1, seed: int = 0
) -> tuple[str, bool | None]:
    model = ModelConfig(
        name="m",
        endpoints=[{"url": "http://127.0.0.1:1"}],
        strategy="prefix_aware",
        prefix_aware={"load_margin": margin},
    )
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint(name, load) for name, load in loads.items()]
    chosen = strategy.pick(views, RoutingContext(RoutingRequest("m"), prefix=held), random.Random(seed))
    return views[chosen.index].name, chosen.cache_hit


def test_the_chain_names_a_whole_prefix_so_prompts_diverging_later_share_only_the_head():
    index = PrefixIndex(chunk_chars=16, capacity=100)
    a = index.chunks(SYSTEM + "What is the capital of France?")
    b = index.chunks(SYSTEM + "Write a haiku about autumn leaves.")
    shared = len(SYSTEM) // 16
    assert a[:shared] == b[:shared] and a[shared + 1 :] != b[shared + 1 :]
    index.record(a, "w0")
    assert index.match(b, "w0") == shared  # the system prompt, not the question
    assert index.match(a, "w0") == len(a)
    assert index.match(a, "w1") == 0
    assert index.chunks("") == []


def test_chunk_names_are_a_chained_blake2b_the_same_in_every_process():
    """Not Python's hash(), which each process seeds anew: gateways share these names."""
    index = PrefixIndex(chunk_chars=4, capacity=100)
    assert index.chunks("abcdefghij") == [16365864867884416859, 14823669105871815314, 1219151702360748407]
    prompt = "héllo wörld, ça va?"  # characters, not bytes, are cut into chunks
    expected, previous = [], bytes(8)
    for start in range(0, len(prompt), 4):
        previous = hashlib.blake2b(previous + prompt[start : start + 4].encode(), digest_size=8).digest()
        expected.append(int.from_bytes(previous, "big"))
    assert index.chunks(prompt) == expected
    assert all(0 <= name < 2**64 for name in expected)


def test_each_endpoint_keeps_its_most_recent_chunks_up_to_capacity_heads_last():
    index = PrefixIndex(chunk_chars=4, capacity=6)
    first = index.chunks("aaaabbbbcccc")  # 3 chunks
    second = index.chunks("xxxxyyyyzzzz")
    index.record(first, "w0")
    index.record(second, "w0")
    assert index.sizes() == {"w0": 6}
    index.record(index.chunks("qqqq"), "w0")  # one more: first's tail goes, its head stays longest
    assert index.match(first, "w0") == 2 and index.match(second, "w0") == 3
    index.keep_only(["w1"])
    assert index.sizes() == {}


MS = (0.001, 0.0)  # a service line of 1 ms per uncached character and no base


def test_until_the_speed_is_learnt_the_cache_decides_among_the_least_loaded_only():
    assert pick({"a": 0, "b": 1, "c": 0}, {"a": 2, "b": 9, "c": 0}) == ("a", True)
    assert pick({"a": 0, "b": 1, "c": 0}, {"a": 2, "b": 9, "c": 0}, margin=3) == ("a", True)


def test_an_endpoint_beyond_the_margin_is_never_chosen_however_much_it_holds():
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware={"load_margin": 1})
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint("a", 0), FakeEndpoint("b", 2)]
    ctx = RoutingContext(
        RoutingRequest("m", prompt="x" * 6400),
        prefix={"b": 100},
        waits={"a": 0.0, "b": 0.0},
        service=(1.0, 0.0, 10_000.0),
    )
    assert views[strategy.pick(views, ctx, random.Random(0)).index].name == "a"


@pytest.mark.parametrize(("slots", "busier", "chosen"), [(1, 2, "a"), (8, 4, "b"), (8, 5, "a"), (4, 2, "b")])
def test_by_default_the_margin_is_half_the_slots_as_one_more_request_is_only_a_larger_batch(
    slots, busier, chosen
):
    """A server that works on 8 requests at once: 4 more in flight is a larger batch, not a queue,
    and the chat's history it holds is worth that (benchmarks/chat_sim.py)."""
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware={"slots": slots})
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint("a", 0), FakeEndpoint("b", busier)]
    ctx = RoutingContext(
        RoutingRequest("m", prompt="x" * 6400),
        prefix={"b": 100},
        waits={"a": 0.0, "b": 0.0},
        service=(1.0, 0.0, 10_000.0),
    )
    assert views[strategy.pick(views, ctx, random.Random(0)).index].name == chosen


def test_with_no_prefix_held_it_is_least_pending_and_says_no_hit():
    assert pick({"a": 3, "b": 1, "c": 2}, {}) == ("b", False)
    assert pick({"a": 3, "b": 1, "c": 2}, {"a": 5}) == ("b", False)  # a is beyond the margin
    chosen = {pick({"a": 0, "b": 0}, {}, seed=s)[0] for s in range(20)}
    assert chosen == {"a", "b"}  # ties broken at random


def test_equal_prefixes_go_to_the_least_loaded_of_them():
    assert pick({"a": 1, "b": 0, "c": 0}, {"a": 4, "b": 4, "c": 1}) == ("b", True)


@pytest.mark.parametrize("bad", [{"chunk_chars": 0}, {"max_chunks_per_endpoint": -1}, {"load_margin": -1}])
def test_bad_parameters_are_config_errors(bad):
    with pytest.raises(ValueError):
        ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware=bad)


def test_the_service_model_learns_seconds_per_uncached_character():
    from modelyard.balancing.prefix import ServiceModel

    model = ServiceModel(min_samples=4)
    for chars in (0, 1000, 2000, 500):
        assert model.line() is None or chars == 500
        model.observe(chars, 0.05 + chars * 0.0001)
    per_char, base, _typical = model.line()  # type: ignore[misc]
    assert per_char == pytest.approx(0.0001) and base == pytest.approx(0.05)


def test_flights_queue_one_after_another_and_each_answer_ends_its_own():
    from modelyard.balancing.prefix import Flights

    flights = Flights()
    flights.start("a", 1, now=10.0, chars=300)  # 0.3 s at 1 ms per character
    flights.start("a", 2, now=10.1, chars=200)  # starts once the first ends, at 10.3
    assert flights.wait("a", 10.1, MS) == pytest.approx(0.4) and flights.count("a") == 2
    flights.end("a", 2)  # the quick one answered first: the long one stays
    assert flights.wait("a", 10.2, MS) == pytest.approx(0.1)
    flights.end("a", 7)  # a try started before the flights were kept: nothing to end
    assert flights.count("a") == 1 and flights.wait("b", 10.2, MS) == 0.0


def test_on_a_server_with_two_slots_a_request_waits_only_when_both_are_taken():
    from modelyard.balancing.prefix import Flights

    flights = Flights()
    flights.start("a", 1, now=10.0, chars=300)
    assert flights.wait("a", 10.0, MS, slots=2) == 0.0  # the second slot is free
    flights.start("a", 2, now=10.1, chars=500)
    assert flights.wait("a", 10.1, MS, slots=2) == pytest.approx(0.2)  # the first ends at 10.3
    flights.start("a", 3, now=10.15, chars=100)  # takes the slot freed at 10.3, to 10.4
    assert flights.wait("a", 10.1, MS, slots=2) == pytest.approx(0.3)
    assert flights.wait("a", 10.1, MS) == pytest.approx(0.8)  # one slot: all three in a row
    assert flights.wait("a", 10.1, (0.002, 0.1)) == pytest.approx(2.0)  # each timed by the line now


def test_a_queued_flight_starts_when_its_queue_drains_and_an_overdue_one_holds_its_slot_until_now():
    # Found by routing_sim.py's grid (4 slots, twice as many clients, 2 s answers): the flights
    # were taken to start when sent and to end on time, so an endpoint with 8 in flight on 4 slots,
    # whose oldest had queued 2 s, looked free; prefix_aware sent there, at P95 1.4x least_pending.
    from modelyard.balancing.prefix import Flights

    flights = Flights()
    flights.start("a", 1, now=0.0, chars=2000)
    flights.start("a", 2, now=0.0, chars=2000, queued=flights.wait("a", 0.0, MS))  # starts at 2.0
    assert flights.wait("a", 0.0, MS) == pytest.approx(4.0)
    assert flights.wait("a", 1.0, MS) == pytest.approx(3.0)  # the first to 2.0, the second to 4.0
    # The first still running at 3.0, past its expected end: it is taken to end now, and the
    # second (which cannot have started on one slot) to take its whole time after it.
    assert flights.wait("a", 3.0, MS) == pytest.approx(2.0)
    assert flights.wait("a", 5.0, MS) == pytest.approx(2.0)
    flights.end("a", 1)
    assert flights.wait("a", 5.0, MS) == pytest.approx(0.0)  # the second holds its slot until now only


def test_the_service_model_draws_no_slope_from_one_length():
    from modelyard.balancing.prefix import ServiceModel

    model = ServiceModel(min_samples=4)
    for seconds in (1.5, 1.6, 1.5, 1.58):
        model.observe(6000, seconds)
    per_char, base, typical = model.line()  # type: ignore[misc]
    assert per_char == 0.0 and base == pytest.approx(1.545, abs=0.01)
    assert typical in (1.5, 1.58)  # the median of the times themselves


def test_with_a_learnt_speed_a_prompt_waits_for_its_prefix_only_behind_a_request_about_to_end():
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware={"chunk_chars": 64})
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint("idle", 0), FakeEndpoint("holder", 1)]
    prompt = RoutingRequest("m", prompt="x" * 2560)  # 40 chunks, all held by "holder"

    def chosen(wait: float) -> str:
        ctx = RoutingContext(
            prompt, prefix={"holder": 40}, waits={"idle": 0.0, "holder": wait}, service=(0.0001, 0.05, 0.4)
        )
        return views[strategy.pick(views, ctx, random.Random(0)).index].name

    assert chosen(0.1) == "holder"  # 0.1 s of queue saves 0.256 s of prefill
    assert chosen(0.3) == "idle"


def test_a_request_joins_a_queue_only_if_it_still_ends_within_the_typical_time():
    # The tail guard (found by routing_sim.py's grid: four long system prompts, each kept on one
    # of three servers, the others idle): the queue saves prefill, but a request that waits behind
    # a whole answer ends slower than most, and enough of them make the P95.
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware={"chunk_chars": 64})
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint("idle", 0), FakeEndpoint("holder", 1)]
    prompt = RoutingRequest("m", prompt="x" * 7000)  # 110 chunks: 0.7 s of prefill uncached

    def chosen(typical: float, roomy: frozenset[str] = frozenset({"idle"})) -> str:
        waits = {"idle": 0.0, "holder": 0.15}  # behind a whole answer
        service = (0.0001, 0.05, typical)
        ctx = RoutingContext(prompt, prefix={"holder": 110}, waits=waits, service=service, roomy=roomy)
        return views[strategy.pick(views, ctx, random.Random(0)).index].name

    assert chosen(0.25) == "holder"  # ends at 0.15 + 0.05 = 0.2 s, within the typical 0.25 s
    assert chosen(0.15) == "idle"  # 0.2 s would be slower than most: it goes where it starts at once
    # A cold start on "idle" would evict a prompt wanted more: the queue is weighed by its cost.
    assert chosen(0.15, roomy=frozenset()) == "holder"
    # Only the candidates count: an endpoint with room that is not one (ejected, another subset)
    # does not hold the guard.
    assert chosen(0.15, roomy=frozenset({"elsewhere"})) == "holder"


def test_when_every_candidate_has_a_queue_the_shortest_by_count_is_taken():
    # Found by routing_sim.py's grid (4 slots, twice as many clients): a queue one longer, chosen
    # for the prefill it saves by a guessed wait, raised P95 up to 1.12x at the same mean.
    model = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}], prefix_aware={"chunk_chars": 64})
    strategy = build_strategy("prefix_aware", model)
    views = [FakeEndpoint("short", 4), FakeEndpoint("holder", 5)]
    prompt = RoutingRequest("m", prompt="x" * 7000)
    waits = {"short": 0.2, "holder": 0.25}
    ctx = RoutingContext(prompt, prefix={"holder": 110}, waits=waits, service=(0.0001, 0.05, 0.3))
    assert views[strategy.pick(views, ctx, random.Random(0)).index].name == "short"
    views = [FakeEndpoint("short", 5), FakeEndpoint("holder", 5)]  # as many: the one holding it
    assert views[strategy.pick(views, ctx, random.Random(0)).index].name == "holder"


def test_a_cold_start_evicts_the_oldest_chunks_but_not_the_prompts_own():
    # Found by review: b's own half of the prompt is its oldest entry, but sending the prompt
    # touches it; what goes is the newer prompt z, sent after the prompt's last use.
    from modelyard.balancing.prefix import PrefixIndex

    index = PrefixIndex(chunk_chars=4, capacity=10)
    prompt = "".join(f"p{i:03d}" for i in range(6))  # 6 chunks
    chunks = index.chunks(prompt)
    index.record(chunks[:3], "b")  # clock 1
    index.record(chunks, "a")  # clock 2: the prompt's last use
    index.record(index.chunks("z" * 28), "b")  # clock 3: 7 chunks, b is full
    assert index.age(chunks[-1], ["a", "b"]) == 1  # (the clock is 3)
    assert index.evicted_age("b", chunks, 3) == 0  # 3 of z's go, sent at 3, not b's half (sent at 1)
    assert index.evicted_age("a", chunks, 6) == float("inf")  # it holds it all: nothing goes
    assert index.evicted_age("c", chunks, 0) == float("inf")  # empty: room for all
    longer = index.chunks(prompt + "q" * 40)  # 16 chunks, more than the capacity
    assert index.evicted_age("b", longer, 3) == 0  # every other entry goes, z's (sent at 3) too


def test_a_full_endpoint_never_has_a_wait_of_zero():
    # Found by review: with lateness learnt as 0, a full endpoint whose flights looked over had a
    # wait of 0 and counted as free (for the tail guard and the room test).
    from modelyard.balancing.prefix import BUSY, Flights

    flights = Flights()
    flights.start("a", 1, now=0.0, chars=100)
    assert flights.waits(["a", "b"], 50.0, MS, 1, 0.0) == {"a": BUSY, "b": 0.0}
    assert flights.waits(["a"], 0.0, MS, 1, 0.0) == {"a": pytest.approx(0.1)}
    assert flights.waits(["a"], 0.0, MS, 2, 0.0) == {"a": 0.0}  # a slot of two is free
