"""prefix_aware: the prefix index (chunk chains, per-endpoint LRU) and the pick (longest prefix
within a load margin)."""

from __future__ import annotations

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


def test_the_longest_prefix_wins_among_endpoints_within_the_margin():
    assert pick({"a": 0, "b": 1, "c": 0}, {"a": 2, "b": 9, "c": 0}) == ("b", True)
    # b is 2 busier than the least loaded: beyond the margin, so the longest prefix within it
    assert pick({"a": 0, "b": 2, "c": 0}, {"a": 2, "b": 9, "c": 0}) == ("a", True)
    assert pick({"a": 0, "b": 2, "c": 0}, {"a": 2, "b": 9, "c": 0}, margin=2) == ("b", True)


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


def test_with_a_queue_cost_a_long_prefix_may_wait_behind_a_short_queue():
    def pick_with(queue_cost: int, loads: dict[str, int], held: dict[str, int]) -> str:
        model = ModelConfig(
            name="m",
            endpoints=[{"url": "http://127.0.0.1:1"}],
            prefix_aware={"load_margin": 2, "queue_cost_chars": queue_cost, "chunk_chars": 64},
        )
        views = [FakeEndpoint(name, load) for name, load in loads.items()]
        ctx = RoutingContext(RoutingRequest("m"), prefix=held)
        return views[build_strategy("prefix_aware", model).pick(views, ctx, random.Random(0)).index].name

    # b holds 30 chunks (1920 characters) and has one request in flight; a is idle and holds 10.
    assert pick_with(1000, {"a": 0, "b": 1}, {"a": 10, "b": 30}) == "b"  # 1000 - 1920 < 0 - 640
    assert pick_with(1500, {"a": 0, "b": 1}, {"a": 10, "b": 30}) == "a"  # 1500 - 1920 > -640
    assert pick_with(1000, {"a": 0, "b": 3}, {"a": 10, "b": 30}) == "a"  # beyond load_margin 2
