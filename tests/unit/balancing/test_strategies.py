"""Routing strategies as pure functions of (endpoints, context, rng)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from modelyard.balancing import Need, Pick, RoutingContext, affinity_key, build_strategy
from modelyard.balancing.strategies import smooth_weighted_schedule
from modelyard.config import STRATEGY_NAMES, ModelConfig
from modelyard.errors import BadRequest, UnknownStrategy
from modelyard.types import RoutingRequest


@dataclass(frozen=True, slots=True)
class FakeEndpoint:
    name: str
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    in_flight: int = 0
    outstanding_tokens: int = 0


def endpoints(*names: str, **fields: Sequence[object]) -> list[FakeEndpoint]:
    """endpoints("a", "b", weight=(2, 1)) -> two endpoints with those weights."""
    return [
        FakeEndpoint(name, **{key: values[i] for key, values in fields.items()})  # type: ignore[arg-type]
        for i, name in enumerate(names)
    ]


MODEL = ModelConfig(name="m", endpoints=[{"url": "http://127.0.0.1:1"}])


def get_strategy(name: object):  # type: ignore[no-untyped-def]
    return build_strategy(name, MODEL)


def context(seq: int = 0, affinity: str | None = None, *, tokens: int = 0) -> RoutingContext:
    request = RoutingRequest(
        model="m", prompt="p", prompt_tokens=tokens // 2, max_tokens=tokens - tokens // 2
    )
    return RoutingContext(request=request, seq=seq, affinity=affinity)


def picks(strategy: str, eps: Sequence[FakeEndpoint], n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    chosen = [get_strategy(strategy).pick(eps, context(seq=seq), rng) for seq in range(n)]
    return [eps[p.index].name for p in chosen]


def longest_run(names: Sequence[str]) -> int:
    return max(len(list(group)) for _, group in itertools.groupby(names))


# round_robin


def test_round_robin_cycles_over_equal_weight_endpoints_by_seq() -> None:
    eps = endpoints("a", "b", "c")
    assert picks("round_robin", eps, 9) == ["a", "b", "c"] * 3


def test_round_robin_position_comes_from_seq_not_call_count() -> None:
    eps = endpoints("a", "b", "c")
    rr = get_strategy("round_robin")
    rng = random.Random(0)
    assert [rr.pick(eps, context(seq=s), rng).index for s in (4, 4, 0, 2)] == [1, 1, 0, 2]


def test_round_robin_equal_nonunit_weights_are_a_plain_cycle() -> None:
    eps = endpoints("a", "b", "c", weight=(7, 7, 7))
    assert picks("round_robin", eps, 6) == ["a", "b", "c"] * 2


@pytest.mark.parametrize("weights", [(5, 1, 1), (3, 2, 1), (1, 4), (2, 0, 3)])
def test_weighted_round_robin_is_weight_proportional_over_one_period(weights: tuple[int, ...]) -> None:
    names = [f"e{i}" for i in range(len(weights))]
    eps = endpoints(*names, weight=weights)
    period = sum(weights)
    for cycles in (1, 4):
        counts = Counter(picks("round_robin", eps, period * cycles))
        assert [counts[n] for n in names] == [w * cycles for w in weights]


def test_weighted_round_robin_interleaves_the_heavy_endpoint() -> None:
    eps = endpoints("a", "b", "c", weight=(5, 1, 1))
    chosen = picks("round_robin", eps, 7 * 5)
    assert longest_run(chosen) < 5
    assert smooth_weighted_schedule((5, 1, 1)) == (0, 0, 1, 0, 2, 0, 0)


def test_round_robin_all_zero_weights_behave_as_equal() -> None:
    eps = endpoints("a", "b", "c", weight=(0, 0, 0))
    assert picks("round_robin", eps, 6) == ["a", "b", "c"] * 2
    assert smooth_weighted_schedule((0, 0, 0)) == (0, 1, 2)


# random


def test_random_equal_weights_is_uniform_with_seeded_rng() -> None:
    eps = endpoints("a", "b", "c")
    counts = Counter(picks("random", eps, 3000, seed=7))
    assert set(counts) == {"a", "b", "c"}
    for name in "abc":
        assert 900 <= counts[name] <= 1100, counts


def test_random_respects_weights() -> None:
    eps = endpoints("a", "b", "c", weight=(6, 3, 1))
    counts = Counter(picks("random", eps, 5000, seed=11))
    assert 2800 <= counts["a"] <= 3200, counts
    assert 1300 <= counts["b"] <= 1700, counts
    assert 380 <= counts["c"] <= 620, counts


def test_random_zero_weight_endpoint_gets_nothing_while_others_have_weight() -> None:
    eps = endpoints("a", "b", "c", weight=(0, 1, 1))
    assert "a" not in picks("random", eps, 1000, seed=3)


def test_random_all_zero_weights_behave_as_equal() -> None:
    eps = endpoints("a", "b", "c", weight=(0, 0, 0))
    counts = Counter(picks("random", eps, 3000, seed=5))
    for name in "abc":
        assert 900 <= counts[name] <= 1100, counts


def test_random_same_seed_same_choices() -> None:
    eps = endpoints("a", "b", "c", weight=(3, 2, 1))
    assert picks("random", eps, 200, seed=42) == picks("random", eps, 200, seed=42)
    assert picks("random", eps, 200, seed=42) != picks("random", eps, 200, seed=43)


# least_pending


def test_least_pending_picks_minimum_in_flight() -> None:
    eps = endpoints("a", "b", "c", in_flight=(3, 1, 5))
    assert get_strategy("least_pending").pick(eps, context(), random.Random(0)) == Pick(1)


def test_least_pending_never_picks_busy_endpoint_while_an_idle_one_exists() -> None:
    rng = random.Random(1234)
    strategy = get_strategy("least_pending")
    for _ in range(500):
        loads = [rng.randrange(0, 6) for _ in range(5)]
        loads[rng.randrange(5)] = 0
        eps = endpoints("a", "b", "c", "d", "e", in_flight=loads)
        assert eps[strategy.pick(eps, context(), rng).index].in_flight == 0, loads


def test_least_pending_breaks_ties_across_all_tied_endpoints() -> None:
    eps = endpoints("a", "b", "c", "d", "e", in_flight=(2, 1, 1, 1, 4))
    counts = Counter(picks("least_pending", eps, 300, seed=9))
    assert set(counts) == {"b", "c", "d"}
    assert min(counts.values()) >= 60, counts


# kv_aware


def test_kv_aware_returns_remembered_endpoint_as_cache_hit() -> None:
    eps = endpoints("a", "b", "c", in_flight=(0, 1, 0))
    pick = get_strategy("kv_aware").pick(eps, context(affinity="b"), random.Random(0))
    assert pick == Pick(1, cache_hit=True)


@pytest.mark.parametrize("affinity", [None, "gone"], ids=["no-affinity", "affinity-not-a-candidate"])
def test_kv_aware_falls_back_to_least_pending(affinity: str | None) -> None:
    eps = endpoints("a", "b", "c", in_flight=(4, 2, 7))
    pick = get_strategy("kv_aware").pick(eps, context(affinity=affinity), random.Random(0))
    assert pick == Pick(1, cache_hit=False)


def test_kv_aware_fallback_spreads_ties_like_least_pending() -> None:
    eps = endpoints("a", "b", "c", in_flight=(0, 0, 3))
    rng = random.Random(2)
    chosen = {eps[get_strategy("kv_aware").pick(eps, context(), rng).index].name for _ in range(100)}
    assert chosen == {"a", "b"}


def test_strategies_declare_what_they_need() -> None:
    needs = {name: get_strategy(name).needs for name in STRATEGY_NAMES}
    assert {name for name, need in needs.items() if Need.AFFINITY in need} == {"kv_aware"}
    assert {name for name, need in needs.items() if Need.RESOURCES in need} == {"resource_aware"}


# cost_aware


def cost_pick(eps: Sequence[FakeEndpoint], tokens: int, seed: int = 0) -> str:
    return eps[get_strategy("cost_aware").pick(eps, context(tokens=tokens), random.Random(seed)).index].name


def test_cost_aware_picks_least_outstanding_cost() -> None:
    eps = endpoints("a", "b", "c", cost_per_1k_tokens=(1.0, 0.5, 2.0), outstanding_tokens=(0, 1000, 0))
    # (0+200)*1.0 = 200, (1000+200)*0.5 = 600, (0+200)*2.0 = 400
    assert cost_pick(eps, tokens=200) == "a"


def test_cost_aware_counts_this_requests_tokens() -> None:
    eps = endpoints("cheap", "pricey", cost_per_1k_tokens=(1.0, 2.0), outstanding_tokens=(100, 0))
    assert cost_pick(eps, tokens=10) == "pricey"  # 110 vs 20
    assert cost_pick(eps, tokens=200) == "cheap"  # 300 vs 400


def test_cost_aware_equal_cost_goes_to_fewer_outstanding_tokens() -> None:
    eps = endpoints("a", "b", cost_per_1k_tokens=(1.0, 2.0), outstanding_tokens=(100, 40))
    # (100+20)*1.0 == (40+20)*2.0
    for seed in range(20):
        assert cost_pick(eps, tokens=20, seed=seed) == "b"


def test_cost_aware_equal_cost_tie_survives_float_rounding() -> None:
    eps = endpoints("a", "b", cost_per_1k_tokens=(0.7, 1.5), outstanding_tokens=(29, 5))
    assert cost_pick(eps, tokens=16) == "b"


def test_cost_aware_free_endpoints_spread_by_outstanding_tokens() -> None:
    eps = endpoints("a", "b", "c", outstanding_tokens=(500, 100, 300))
    assert cost_pick(eps, tokens=50) == "b"

    # Simulate a stream of requests that stay in flight: the load evens out.
    eps = endpoints("a", "b", "c")
    rng = random.Random(4)
    counts: Counter[str] = Counter()
    for _ in range(30):
        i = get_strategy("cost_aware").pick(eps, context(tokens=10), rng).index
        counts[eps[i].name] += 1
        eps[i] = replace(eps[i], outstanding_tokens=eps[i].outstanding_tokens + 10)
    assert counts == {"a": 10, "b": 10, "c": 10}


# registry and affinity key


@pytest.mark.parametrize("name", ["fastest", "", "Round_Robin", None, 3])
def test_build_strategy_unknown_name_is_a_400_listing_valid_names(name: object) -> None:
    with pytest.raises(UnknownStrategy) as info:
        get_strategy(name)
    assert isinstance(info.value, BadRequest)
    assert info.value.status == 400
    for valid in STRATEGY_NAMES:
        assert valid in info.value.message
    assert repr(name) in info.value.message


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_build_strategy_returns_a_new_named_strategy_per_model(name: str) -> None:
    first, second = get_strategy(name), get_strategy(name)
    assert first.name == second.name == name
    assert first is not second  # per model: one model's parameters never reach another


def test_config_lists_every_strategy() -> None:
    assert set(STRATEGY_NAMES) == {
        "round_robin",
        "random",
        "least_pending",
        "kv_aware",
        "cost_aware",
        "resource_aware",
        "prefix_aware",
    }


def test_affinity_key_is_deterministic() -> None:
    assert affinity_key("m", "hello world", 512) == affinity_key("m", "hello world", 512)


def test_affinity_key_differs_by_model_and_prefix() -> None:
    assert affinity_key("llama", "hello", 512) != affinity_key("mistral", "hello", 512)
    assert affinity_key("m", "hello", 512) != affinity_key("m", "help!", 512)


def test_affinity_key_ignores_text_beyond_prefix_chars() -> None:
    prefix = "You are a helpful assistant. "
    a = affinity_key("m", prefix + "What is 2+2?", len(prefix))
    b = affinity_key("m", prefix + "Write a poem.", len(prefix))
    assert a == b
    assert affinity_key("m", prefix + "What", len(prefix) + 1) != affinity_key(
        "m", prefix + "Xhat", len(prefix) + 1
    )


def test_kv_aware_leaves_a_remembered_endpoint_too_far_ahead_of_the_least_loaded() -> None:
    def pick(margin: object, loads: tuple[int, ...]) -> tuple[int, object]:
        model = ModelConfig(
            name="m", endpoints=[{"url": "http://127.0.0.1:1"}], kv_aware={"load_margin": margin}
        )
        chosen = build_strategy("kv_aware", model).pick(
            endpoints("a", "b", in_flight=loads),
            RoutingContext(RoutingRequest("m"), affinity="a"),
            random.Random(0),
        )
        return chosen.index, chosen.cache_hit

    assert pick(1, (1, 0)) == (0, True)  # within the margin: back to the cache
    assert pick(1, (2, 0)) == (1, False)  # beyond it: the least pending
    assert pick(None, (9, 0)) == (0, True)  # no guard: InferFlow's behaviour
