"""The seven strategies, built per model by name from that model's parameters.

Each `pick(endpoints, ctx, rng)` chooses among the *healthy* endpoints (never empty) and touches
nothing else: the sequence number, the remembered affinity and the RNG come in as arguments, so a
strategy can be switched at runtime without losing the gateway's counters or affinity table.
A strategy declares in `needs` what the gateway must gather for it beyond the endpoints: the
remembered affinity of the request's prompt prefix, or the servers' scraped load.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from modelyard.cluster import EndpointView, ResourceSnapshot
from modelyard.config import (
    STRATEGY_NAMES,
    KvAwareConfig,
    ModelConfig,
    PrefixAwareConfig,
    ResourceAwareConfig,
)
from modelyard.errors import UnknownStrategy
from modelyard.types import RoutingRequest

# A prompt's token ids and its block keys by block size (precise mode: balancing/kv_events.py).
PromptBlocks = tuple[Sequence[int], Mapping[int, list[int]]]


class RoutingContext(NamedTuple):
    """`seq` counts the model's requests (round_robin's position); `affinity` is the endpoint name
    remembered for this request's prompt prefix, looked up by the gateway before picking.
    Immutable (a tuple: cheaper to make than a frozen dataclass, and one is made per request)."""

    request: RoutingRequest
    seq: int = 0
    affinity: str | None = None
    now: float = 0.0  # the caller's clock, for snapshot freshness
    prefix: Mapping[str, int] | None = None  # prefix_aware: endpoint name -> prompt chunks it holds
    # prefix_aware with a learnt service time: endpoint name -> seconds a request would queue there,
    # and (seconds per uncached prompt character, base seconds, the median seconds of a request that
    # started at once: balancing.prefix.ServiceModel)
    waits: Mapping[str, float] | None = None
    service: tuple[float, float, float] | None = None
    # prefix_aware, when some endpoint has a queue: the free endpoints where a cold start of this
    # prompt evicts nothing wanted more (the tail guard holds where one of them is a candidate)
    roomy: Collection[str] | None = None
    # prefix_aware in precise mode: the prompt's token ids and its block keys by block size, so
    # that the index learns what an endpoint rebuilding its index is sent (Balancer.on_sent)
    tokens: PromptBlocks | None = None


@dataclass(slots=True, frozen=True)
class Pick:
    index: int
    cache_hit: bool | None = None  # kv_aware only: was the remembered endpoint used?


# Picks without a cache_hit, made once: a frozen dataclass costs two object.__setattr__ calls to
# make, and most strategies make one per request.
_PLAIN_PICKS = tuple(Pick(i) for i in range(64))


def plain_pick(index: int) -> Pick:
    """`Pick(index)`."""
    return _PLAIN_PICKS[index] if index < 64 else Pick(index)


class Need(enum.Enum):
    """What a strategy reads beyond the endpoints' own counters."""

    AFFINITY = "affinity"  # the endpoint remembered for the prompt prefix (SharedState, kv_aware config)
    RESOURCES = "resources"  # each server's scraped load (a ResourceScraper on the model's endpoints)
    PREFIX = "prefix"  # how much of the prompt each endpoint holds (the model's PrefixIndex)


NOTHING: frozenset[Need] = frozenset()


class Strategy(Protocol):
    name: str
    needs: frozenset[Need]

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick: ...


@functools.lru_cache(maxsize=512)
def smooth_weighted_schedule(weights: tuple[int, ...]) -> tuple[int, ...]:
    """nginx's smooth weighted round robin unrolled into one period: weights (5,1,1) give
    a a b a c a a rather than a a a a a b c. Equal weights give the plain cycle 0 1 2."""
    if not any(weights):
        weights = (1,) * len(weights)
    total = sum(weights)
    current = [0] * len(weights)
    order = []
    for _ in range(total):
        for i, w in enumerate(weights):
            current[i] += w
        best = max(range(len(weights)), key=lambda i: current[i])
        current[best] -= total
        order.append(best)
    return tuple(order)


class RoundRobin:
    name = "round_robin"
    needs = NOTHING

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        first = endpoints[0].weight
        for endpoint in endpoints:
            if endpoint.weight != first:
                break
        else:  # all weigh the same
            return plain_pick(ctx.seq % len(endpoints))
        schedule = smooth_weighted_schedule(tuple(e.weight for e in endpoints))
        return plain_pick(schedule[ctx.seq % len(schedule)])


class Random:
    name = "random"
    needs = NOTHING

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        weights = [e.weight for e in endpoints]
        if all(w == weights[0] for w in weights) or not any(weights):
            return plain_pick(rng.randrange(len(endpoints)))
        return plain_pick(rng.choices(range(len(endpoints)), weights=weights)[0])


def _least(values: Sequence[float], rng: random.Random) -> int:
    """Index of the smallest value, ties broken uniformly at random."""
    low = min(values)
    ties = [i for i, v in enumerate(values) if v == low]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class LeastPending:
    name = "least_pending"
    needs = NOTHING

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        return plain_pick(_least([e.in_flight for e in endpoints], rng))


class KvAware:
    """Prefix affinity: a prompt prefix seen before goes back to the endpoint that served it, whose
    KV cache likely still holds it, unless that endpoint has more than `load_margin` requests in
    flight beyond the least loaded one (InferFlow's version has no such guard, and piles prompts
    sharing a system prompt onto one server); a new prefix goes to the least pending endpoint."""

    name = "kv_aware"
    needs = frozenset({Need.AFFINITY})

    def __init__(self, params: KvAwareConfig | None = None) -> None:
        self.margin = params.load_margin if params is not None else None

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        if ctx.affinity is not None:
            for i, e in enumerate(endpoints):
                if e.name == ctx.affinity:
                    if (
                        self.margin is None
                        or e.in_flight <= min(x.in_flight for x in endpoints) + self.margin
                    ):
                        return Pick(i, cache_hit=True)
                    break  # too busy: the least pending one instead
        return Pick(_least([e.in_flight for e in endpoints], rng), cache_hit=False)


_NO_CEILING = float("inf")


class PrefixAware:
    """Where the request will finish first, by what each endpoint holds of the prompt and by its
    queue. Among the endpoints with at most `load_margin` requests in flight beyond the least
    loaded one: once the gateway has learnt the servers' speed (seconds per uncached prompt
    character, from answers of idle endpoints: `ServiceModel`), the one whose expected queue
    (`Flights`) plus the prefill of what it does not hold (the model's PrefixIndex, over the whole
    prompt, not its first N characters) is shortest; until then only among the least loaded. Among
    equals, the one holding the longest prefix, then the fewest in flight, then chance. With no
    prefix held anywhere it is the endpoint expected to be free first (least_pending until the
    speed is learnt). A busy endpoint is chosen only if the request would still end there within
    the median time of a request that starts at once, when a free candidate could take the prompt
    without evicting chunks wanted more (the tail guard); when every candidate is busy, only the
    least loaded are. So a prompt waits for its prefix only behind a request about to end, a hot
    prefix spreads as soon as its endpoint is busier (not kv_aware's hotspot), and the endpoints
    beyond the margin are never chosen.

    Differs from SGLang's cache-aware router, which switches the whole model between cache-first
    and shortest-queue by a global imbalance test, and from vLLM's router, which scores prefix
    match and load with fixed weights: here each request weighs the prefill it saves against the
    queue it joins, in seconds learnt from the servers' answers."""

    name = "prefix_aware"
    needs = frozenset({Need.PREFIX})

    def __init__(self, params: PrefixAwareConfig) -> None:
        # A request more in flight means a queue on a one-slot server, but only a slightly larger
        # batch on one that works on 8 at once: there, a margin of 1 sent a chat's next turn away
        # from the server holding its history whenever two others were between them
        # (benchmarks/chat_sim.py: 76% of prompt tokens cached against the oracle's 82%; half the
        # slots, 82%, at the same mean and a lower TTFT P95).
        margin = params.load_margin
        self.margin = margin if margin is not None else max(1, params.slots // 2)
        self.chunk_chars = params.chunk_chars

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        loads = [e.in_flight for e in endpoints]
        held = ctx.prefix or {}
        matched = [held.get(e.name, 0) for e in endpoints]
        # Until the servers' speed is learnt, a busier endpoint's queue cannot be weighed against
        # the prefill it saves: the cache decides among the least loaded only.
        service, waits = ctx.service, ctx.waits
        learnt = (service, waits) if service is not None and waits is not None else None
        most = min(loads) + (self.margin if learnt else 0)
        eligible = [i for i, load in enumerate(loads) if load <= most]
        if learnt and len(eligible) > 1:
            # The endpoint where this request would finish first: its queue, then the prefill of
            # what it does not hold (the base cost is the same everywhere).
            (per_char, base, typical), queued = learnt
            chars, size = len(ctx.request.prompt), self.chunk_chars
            # The tail guard: a request joins a queue only if it would still end within the median
            # time of a request that starts at once, where one of the free candidates could take
            # it without evicting a prompt wanted more (`roomy`: Balancer.look). Waiting then never
            # makes it one of the slow requests a P95 counts, even where each wait pays for itself
            # (routing_sim.py's grid: a few long system prompts, each kept on one server of three
            # with room for all, had P95 2x least_pending's).
            roomy = ctx.roomy
            ceiling = typical if roomy and any(endpoints[i].name in roomy for i in eligible) else _NO_CEILING
            finish: dict[int, float] = {}
            calm: dict[int, float] = {}
            free = False
            for i in eligible:
                wait = queued.get(endpoints[i].name, 0.0)
                finish[i] = end = wait + per_char * max(0, chars - matched[i] * size)
                if not wait:
                    free = True
                    calm[i] = end
                elif end + base <= ceiling:
                    calm[i] = end
            if not free:
                # Every candidate has a queue (saturated): the shortest, by count as least_pending
                # counts, and the cache among those. A longer queue for a saving was a guess the
                # full queues then ate (routing_sim.py's grid: P95 up to 1.12x at a mean of 1.00x).
                fewest = min(loads[i] for i in eligible)
                calm = {i: finish[i] for i in eligible if loads[i] == fewest}
            choices = calm or finish
            soonest = min(choices.values())
            eligible = [i for i, end in choices.items() if end <= soonest + 1e-9]
        longest = max(matched[i] for i in eligible)
        best = [i for i in eligible if matched[i] == longest]
        chosen = best[_least([loads[i] for i in best], rng)]
        return Pick(chosen, cache_hit=longest > 0)


class CostAware:
    """Least estimated outstanding cost: (tokens in flight + this request's tokens) x price per token.
    Among equal costs (e.g. all free) the endpoint with fewer outstanding tokens wins."""

    name = "cost_aware"
    needs = NOTHING

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        tokens = ctx.request.prompt_tokens + ctx.request.max_tokens
        costs = [(e.outstanding_tokens + tokens) * e.cost_per_1k_tokens for e in endpoints]
        low = min(costs)
        # Costs are products of floats: equal on paper can differ in the last bit.
        cheapest = [i for i, c in enumerate(costs) if math.isclose(c, low, rel_tol=1e-9, abs_tol=1e-12)]
        if len(cheapest) == 1:
            return plain_pick(cheapest[0])
        best = _least([endpoints[i].outstanding_tokens for i in cheapest], rng)
        return plain_pick(cheapest[best])


class ResourceAware:
    """The endpoints with the fewest requests waiting or running (`load`: this gateway's own, live,
    plus the others' as of the last scrape), and among those the best score from the scraped
    signals (see `resource_score`). Endpoints whose scrape is stale or whose queue is full are
    skipped; with nothing fresh, least_pending. A 5-second-old scrape cannot see 300 ms requests
    come and go, but the live count can: between scrapes it follows this gateway's own requests
    as least_pending does, and the scrape adds what this gateway cannot see (other gateways'
    requests, GPU and KV use; a server's lagging gauges can overstate them until the next scrape)."""

    name = "resource_aware"
    needs = frozenset({Need.RESOURCES})

    def __init__(self, params: ResourceAwareConfig) -> None:
        self.params = params

    def pick(self, endpoints: Sequence[EndpointView], ctx: RoutingContext, rng: random.Random) -> Pick:
        scored: list[tuple[float, float, int]] = []  # (load, score, index)
        for i, endpoint in enumerate(endpoints):
            score = resource_score(endpoint, self.params, ctx.now)
            if score is not None:
                assert endpoint.resources is not None  # scored: fresh
                scored.append((load(endpoint, endpoint.resources), score, i))
        if not scored:
            return plain_pick(_least([e.in_flight for e in endpoints], rng))
        least = min(entry[0] for entry in scored)
        candidates = [entry for entry in scored if entry[0] == least]
        best = max(score for _, score, _ in candidates)
        ties = [i for _, score, i in candidates if math.isclose(score, best, rel_tol=1e-12)]
        return plain_pick(ties[0] if len(ties) == 1 else rng.choice(ties))


def load(endpoint: EndpointView, snapshot: ResourceSnapshot) -> float:
    """Requests waiting or running on the endpoint: this gateway's in flight now, plus what the
    scrape counted beyond this gateway's own at the time (other clients' requests)."""
    scraped = (snapshot.queue_depth or 0.0) + (snapshot.running or 0.0)
    return endpoint.in_flight + max(0.0, scraped - snapshot.in_flight_at_scrape)


def queue_depth(endpoint: EndpointView, snapshot: ResourceSnapshot) -> float:
    """The scraped queue plus what this gateway sent since the scrape, so scores move between scrapes."""
    sent_since = max(0, endpoint.in_flight - snapshot.in_flight_at_scrape)
    return (snapshot.queue_depth or 0.0) + sent_since


def resource_score(endpoint: EndpointView, params: ResourceAwareConfig, now: float) -> float | None:
    """w_sm (1 - SM use) + w_mem (1 - memory used) + w_queue exp(-k depth), over the signals the
    server exports (missing ones drop out and the weights renormalise). Memory is the GPU frame
    buffer when DCGM is scraped, else the KV cache. None: stale, never scraped, or queue full."""
    snapshot = endpoint.resources
    if snapshot is None or now - snapshot.taken_at > params.stale_after:
        return None
    depth = queue_depth(endpoint, snapshot)
    if depth >= params.max_queue_depth:
        return None
    total = params.w_queue * math.exp(-params.k * depth)
    weight = params.w_queue
    if snapshot.sm_utilization is not None:
        total += params.w_sm * (1.0 - snapshot.sm_utilization)
        weight += params.w_sm
    memory = snapshot.memory_used if snapshot.memory_used is not None else snapshot.kv_cache_usage
    if memory is not None:
        total += params.w_mem * (1.0 - memory)
        weight += params.w_mem
    return total / weight if weight else 0.0


# Each model gets its own instance, built from its config: parameters live in the strategy, not
# in every request's context.
_FACTORIES: dict[str, Callable[[ModelConfig], Strategy]] = {
    "round_robin": lambda _model: RoundRobin(),
    "random": lambda _model: Random(),
    "least_pending": lambda _model: LeastPending(),
    "kv_aware": lambda model: KvAware(model.kv_aware),
    "cost_aware": lambda _model: CostAware(),
    "resource_aware": lambda model: ResourceAware(model.resource_aware),
    "prefix_aware": lambda model: PrefixAware(model.prefix_aware),
}
assert tuple(_FACTORIES) == STRATEGY_NAMES, "config.StrategyName and the factories must list the same names"


def check_strategy_name(name: object) -> str:
    """`name` when it names a strategy; else UnknownStrategy (400) listing the valid names."""
    if not isinstance(name, str) or name not in _FACTORIES:
        raise UnknownStrategy(name, STRATEGY_NAMES)
    return name


def build_strategy(name: object, model: ModelConfig) -> Strategy:
    """A new strategy for `model`, with that model's parameters."""
    return _FACTORIES[check_strategy_name(name)](model)


def affinity_key(model: str, prompt: str, prefix_chars: int) -> str:
    """The kv_aware key: a hash of the model and the prompt's first `prefix_chars` characters."""
    digest = hashlib.blake2b(f"{model}\0{prompt[:prefix_chars]}".encode(), digest_size=16)
    return "kv:" + digest.hexdigest()
