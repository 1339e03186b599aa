"""resource_aware as a pure function of scraped snapshots, the gateway's in-flight count and a clock."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from modelyard.balancing import RoutingContext, build_strategy
from modelyard.balancing.strategies import ResourceAware, load, resource_score
from modelyard.cluster import ResourceSnapshot
from modelyard.config import ModelConfig, ResourceAwareConfig
from modelyard.types import RoutingRequest

NOW = 1000.0
PARAMS = ResourceAwareConfig()  # w_sm 0.4, w_mem 0.3, w_queue 0.3, k 0.3, stale_after 15s, max queue 64


@dataclass(frozen=True, slots=True)
class FakeEndpoint:
    name: str
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    in_flight: int = 0
    outstanding_tokens: int = 0
    resources: ResourceSnapshot | None = None


def snap(
    queue: float | None = 0.0,
    *,
    age: float = 0.0,
    sm: float | None = None,
    mem: float | None = None,
    kv: float | None = None,
    in_flight_at_scrape: int = 0,
    running: float | None = None,
    at_scrape: int | None = None,
) -> ResourceSnapshot:
    return ResourceSnapshot(
        taken_at=NOW - age,
        queue_depth=queue,
        kv_cache_usage=kv,
        sm_utilization=sm,
        memory_used=mem,
        running=running,
        in_flight_at_scrape=in_flight_at_scrape if at_scrape is None else at_scrape,
    )


def pick(eps: Sequence[FakeEndpoint], *, params: ResourceAwareConfig = PARAMS, seed: int = 0) -> str:
    ctx = RoutingContext(request=RoutingRequest(model="m"), now=NOW)
    return eps[ResourceAware(params).pick(eps, ctx, random.Random(seed)).index].name


def score(endpoint: FakeEndpoint, params: ResourceAwareConfig = PARAMS) -> float | None:
    return resource_score(endpoint, params, NOW)


def test_worked_example_with_the_documented_weights() -> None:
    # 2 queued at the scrape plus 1 sent since (in flight 3, was 2): depth 3.
    # (0.4 (1 - 0.5) + 0.3 (1 - 0.6) + 0.3 exp(-0.3 * 3)) / (0.4 + 0.3 + 0.3)
    # = 0.2 + 0.12 + 0.3 * 0.40657 = 0.44197
    endpoint = FakeEndpoint("a", in_flight=3, resources=snap(2, sm=0.5, mem=0.6, in_flight_at_scrape=2))
    assert score(endpoint) == pytest.approx(0.2 + 0.12 + 0.3 * math.exp(-0.9))
    assert score(endpoint) == pytest.approx(0.44197, abs=1e-5)


def test_prefers_the_idle_endpoint() -> None:
    busy = FakeEndpoint("busy", resources=snap(12, sm=0.95, mem=0.9))
    idle = FakeEndpoint("idle", resources=snap(0, sm=0.05, mem=0.2))
    assert score(idle) > score(busy)  # type: ignore[operator]
    assert pick([busy, idle]) == "idle"
    assert pick([idle, busy]) == "idle"


def test_in_flight_sent_since_the_scrape_moves_the_score() -> None:
    same = snap(1, sm=0.5, mem=0.5, in_flight_at_scrape=2)
    scores = [score(FakeEndpoint("a", in_flight=n, resources=same)) for n in range(2, 7)]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == len(scores)
    # Two endpoints equal at the scrape: the one this gateway has since sent more to loses.
    a = FakeEndpoint("a", in_flight=4, resources=same)
    b = FakeEndpoint("b", in_flight=2, resources=same)
    assert pick([a, b]) == "b"


def test_requests_finished_since_the_scrape_do_not_lower_the_queue() -> None:
    at_scrape = FakeEndpoint("a", in_flight=5, resources=snap(3, in_flight_at_scrape=5))
    fewer_now = FakeEndpoint("a", in_flight=1, resources=snap(3, in_flight_at_scrape=5))
    assert score(fewer_now) == score(at_scrape) == pytest.approx(math.exp(-0.9))


def test_a_stale_snapshot_is_skipped() -> None:
    stale_idle = FakeEndpoint("stale", resources=snap(0, age=15.001, sm=0.0, mem=0.0))
    fresh_busy = FakeEndpoint("fresh", in_flight=9, resources=snap(20, age=15.0, sm=0.9, mem=0.9))
    assert score(stale_idle) is None
    assert score(fresh_busy) is not None  # exactly stale_after old is still fresh
    assert pick([stale_idle, fresh_busy]) == "fresh"


def test_stale_after_comes_from_the_config() -> None:
    endpoint = FakeEndpoint("a", resources=snap(0, age=20.0))
    assert score(endpoint) is None
    assert score(endpoint, ResourceAwareConfig(stale_after=30.0)) == pytest.approx(1.0)


def test_a_full_queue_is_skipped() -> None:
    full = FakeEndpoint("full", resources=snap(64, sm=0.0, mem=0.0))
    almost = FakeEndpoint("almost", resources=snap(63, sm=0.0, mem=0.0))
    assert score(full) is None
    assert score(almost) is not None
    filled_since = FakeEndpoint("filled", in_flight=3, resources=snap(61, in_flight_at_scrape=0))
    assert score(filled_since) is None
    small = ResourceAwareConfig(max_queue_depth=4)
    assert score(FakeEndpoint("a", resources=snap(4)), small) is None
    busy = FakeEndpoint("busy", resources=snap(40, sm=0.99, mem=0.99))
    assert pick([full, busy]) == "busy"


def test_nothing_fresh_falls_back_to_least_pending() -> None:
    eps = [
        FakeEndpoint("never-scraped", in_flight=3),
        FakeEndpoint("stale", in_flight=1, resources=snap(0, age=60)),
        FakeEndpoint("full", in_flight=2, resources=snap(100)),
    ]
    assert pick(eps) == "stale"
    counts = Counter(pick([FakeEndpoint("a"), FakeEndpoint("b")], seed=seed) for seed in range(50))
    assert set(counts) == {"a", "b"}  # ties broken at random, as least_pending does


def test_unscraped_endpoints_are_skipped_while_some_are_fresh() -> None:
    unknown = FakeEndpoint("unknown", in_flight=0)
    scraped = FakeEndpoint("scraped", in_flight=30, resources=snap(10, sm=0.9))
    assert pick([unknown, scraped]) == "scraped"


def test_missing_signals_renormalise_the_weights() -> None:
    # Every score is a weighted mean in 0..1, whichever signals the server exports.
    queue_only = FakeEndpoint("vllm", resources=snap(0))
    everything = FakeEndpoint("dcgm", resources=snap(0, sm=0.0, mem=0.0))
    assert score(queue_only) == pytest.approx(1.0)
    assert score(everything) == pytest.approx(1.0)
    # An idle queue-only server beats a half-busy fully instrumented one, and loses to an idle one
    # once its own queue grows: the scales are comparable.
    half_busy = FakeEndpoint("dcgm", resources=snap(0, sm=0.5, mem=0.5))
    assert score(half_busy) == pytest.approx(0.65)
    assert pick([half_busy, queue_only]) == "vllm"
    queued = FakeEndpoint("vllm", resources=snap(3))
    assert score(queued) == pytest.approx(math.exp(-0.9))
    assert pick([queued, half_busy]) == "dcgm"


def test_kv_cache_stands_in_for_memory_without_dcgm() -> None:
    kv_only = FakeEndpoint("a", resources=snap(0, kv=0.5))
    assert score(kv_only) == pytest.approx((0.3 * 0.5 + 0.3) / 0.6)
    both = FakeEndpoint("a", resources=snap(0, kv=0.5, mem=0.1))
    assert score(both) == pytest.approx((0.3 * 0.9 + 0.3) / 0.6)  # the frame buffer wins


def test_a_missing_queue_reading_counts_only_the_gateways_own_requests() -> None:
    no_queue = FakeEndpoint("a", in_flight=2, resources=snap(None, sm=0.0))
    assert score(no_queue) == pytest.approx((0.4 + 0.3 * math.exp(-0.6)) / 0.7)


def test_equal_scores_are_broken_at_random() -> None:
    eps = [FakeEndpoint(n, resources=snap(1, sm=0.3)) for n in ("a", "b", "c")]
    assert set(pick(eps, seed=seed) for seed in range(60)) == {"a", "b", "c"}


def test_the_strategy_is_built_with_its_models_own_parameters() -> None:
    # Equally loaded: a GPU busy with other work but a KV cache to spare, against an idle GPU
    # whose KV cache is nearly full.
    kv_free = FakeEndpoint("kv-free", resources=snap(0, sm=0.95, kv=0.1))
    gpu_free = FakeEndpoint("gpu-free", resources=snap(0, sm=0.05, kv=0.9))
    ctx = RoutingContext(request=RoutingRequest(model="m"), now=NOW)
    endpoints = [{"url": "http://127.0.0.1:1"}]
    memory_only = ModelConfig(name="m", endpoints=endpoints, resource_aware={"w_sm": 0})
    defaults = ModelConfig(name="m", endpoints=endpoints)
    eps = [kv_free, gpu_free]

    def chosen(config: ModelConfig) -> str:
        return eps[build_strategy("resource_aware", config).pick(eps, ctx, random.Random(0)).index].name

    assert (chosen(memory_only), chosen(defaults)) == ("kv-free", "gpu-free")


def test_the_fewest_requests_go_first_whatever_the_scrape_says_of_the_gpu() -> None:
    # Between scrapes the live count decides: an idle GPU with a request of ours running on it
    # loses to a busy-looking GPU with nothing of ours (least_pending's choice, and the right one).
    busy_now = FakeEndpoint("busy-now", in_flight=1, resources=snap(0, sm=0.0, kv=0.0))
    free_now = FakeEndpoint("free-now", in_flight=0, resources=snap(0, sm=0.9, kv=0.9))
    assert pick([busy_now, free_now]) == "free-now"


def test_other_clients_requests_seen_by_the_scrape_count_as_load() -> None:
    # The scrape saw 3 waiting or running where this gateway had 1 of its own: 2 are someone else's.
    shared = FakeEndpoint("shared", in_flight=1, resources=snap(2, running=1, at_scrape=1))
    ours = FakeEndpoint("ours", in_flight=2, resources=snap(0, running=2, at_scrape=2))
    assert load(shared, shared.resources) == 3 and load(ours, ours.resources) == 2  # type: ignore[arg-type]
    assert pick([shared, ours]) == "ours"
