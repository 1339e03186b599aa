"""Replay a `modelyard bench` workload against simulated workers in virtual time, to see what
routing can reach on it: the gateway's own Balancer (modelyard.balancing, driven as the gateway drives it),
a request-at-a-time oracle that knows every worker's true cache and queue, and the share of prompt
tokens an unbounded cache would serve. A run takes seconds instead of minutes, and the same seed
gives the same numbers on any machine (no clock is read).

The workers follow the sim-worker's latency model (simworker.latency: the same block hashing, LRU
prefix cache and per-token costs, one FIFO queue per worker), plus a fixed per-request overhead for
the HTTP round trips. The clients are a closed loop of `concurrency`, as `modelyard bench` sends.

    .venv/bin/python benchmarks/routing_sim.py                      # inferflow: c=3, 1 slot each
    .venv/bin/python benchmarks/routing_sim.py --concurrency 6 --slots 2
    .venv/bin/python benchmarks/routing_sim.py --grid 300 --seeds 3   # prefix_aware vs least_pending
    .venv/bin/python benchmarks/routing_sim.py --profile chat --load 0.9  # conversations: chat_sim.py

`--grid N` runs prefix_aware against least_pending at N points of GRID, a grid of workload shapes
(slots, load, prompt and output lengths, the spread of answer lengths, cache size, costs, repeat
share, prefix_aware sized or at its defaults): a routing rule must hold on all of them, not on one
calibrated profile. It prints each point's P95 and mean ratios and marks those over 1.03.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from modelyard.balancing import Need, RoutingContext
from modelyard.balancing.balancer import Balancer, Sample
from modelyard.balancing.kv_events import KVEventBatch, encode_batch
from modelyard.bench import PROFILES, BenchRequest, WorkloadSpec, build_requests
from modelyard.bench.spawn import gateway_config
from modelyard.bench.workload import SimShape, cacheable_share, prompt_tokens
from modelyard.config import ModelConfig
from modelyard.protocols.openai import routing_request
from modelyard.simworker.cache_events import prefill_events
from modelyard.simworker.latency import Prefill, PrefixCache, block_hashes, plan_prefill
from modelyard.types import RoutingRequest

BLOCK_TOKENS = 16
OVERHEAD = 0.002  # seconds per request outside the server's prefill and decode (HTTP, parsing)


@dataclass(slots=True)
class Worker:
    name: str
    cache: PrefixCache
    slots: int
    running: int = 0
    queue: list[int] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # when each running request ends
    # what a strategy reads (EndpointView)
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    in_flight: int = 0
    outstanding_tokens: int = 0
    resources: None = None


@dataclass(frozen=True, slots=True)
class Job:
    prompt: str  # as the gateway sees it
    tokens: int  # as the server counts them
    blocks: list[bytes]
    request: RoutingRequest  # the body as the gateway parses it, once per job
    output: int  # tokens the server generates for it
    ids: list[int]  # the server's tokens, as ids (a word's id: when it was first seen)


class WordIds:
    """Precise mode's tokenizer here: the server's tokens of each job's body, looked up by the
    body (the sim's words, numbered), as `PromptTokens.ids` gives them in the gateway."""

    def __init__(self) -> None:
        self.by_body: dict[int, list[int]] = {}

    def ids(self, fields: object) -> list[int] | None:
        return self.by_body.get(id(fields))


_WORD_IDS: dict[str, int] = {}
WORDS = WordIds()


class Cluster:
    """The workers and their costs: what a request would take on a worker right now."""

    def __init__(self, workers: list[Worker], prefill: float, decode: float) -> None:
        self.workers = workers
        self.prefill, self.decode = prefill, decode

    def service(self, worker: Worker, job: Job) -> float:
        cached = min(job.tokens, worker.cache.match(job.blocks) * BLOCK_TOKENS)
        return (job.tokens - cached) * self.prefill + job.output * self.decode + OVERHEAD

    def wait(self, worker: Worker, jobs: Sequence[Job], now: float) -> float:
        """When a new request would start there: the running ones end, then the queue's, in order."""
        free = sorted(max(0.0, end - now) for end in worker.ends)
        free += [0.0] * (worker.slots - len(free))
        for index in worker.queue:
            start = heapq.heappop(free)
            heapq.heappush(free, start + self.service(worker, jobs[index]))
        return min(free)


class Router:
    """Picks a worker for each job, and hears when it ends."""

    def pick(self, cluster: Cluster, jobs: Sequence[Job], index: int, now: float, rng: random.Random) -> int:
        raise NotImplementedError

    def ended(self, worker: Worker, index: int, now: float, job: Job) -> None:
        pass

    def prefilled(self, worker: Worker, job: Job, prefill: Prefill, now: float) -> None:
        """The worker admitted `job`: what its cache stored and evicted (its KV events)."""

    def answering(self, worker: Worker, index: int, job: Job) -> None:
        """The worker's headers for `index` came (a stream's: before its first token)."""


class Strategy(Router):
    """A modelyard strategy by name, through the gateway's own Balancer (balancing/balancer.py),
    driven as the gateway drives it: look, pick, on_sent; at the answer on_ended, on_cached and
    on_served. Only kv_aware's affinity (the gateway's shared state) is kept here."""

    def __init__(
        self, name: str, prefix_aware: dict[str, object] | None = None, precise: bool = False
    ) -> None:
        model = ModelConfig.model_validate(
            {
                "name": "m",
                "endpoints": [{"url": "http://x"}],
                "strategy": name,
                "prefix_aware": prefix_aware or {},
            }
        )
        # precise: the workers' caches publish their events to the balancer (prefix_aware's
        # precise mode), at once: the sim has no network
        self.balancer = Balancer(model, tokens=WORDS if precise else None)  # type: ignore[arg-type]
        self.seqs: dict[str, int] = {}
        self.prefix_chars = model.kv_aware.prefix_chars
        self.affinity: dict[str, str] = {}
        # job -> (worker, kv_aware's cache hit, the prompt's chunks, the service sample)
        self.sent: dict[int, tuple[str, bool | None, list[int] | None, Sample | None]] = {}
        self.answered: set[int] = set()  # jobs whose headers came (their prefix is remembered)
        self.prefix = Need.PREFIX in self.balancer.strategy.needs

    def pick(self, cluster: Cluster, jobs: Sequence[Job], index: int, now: float, rng: random.Random) -> int:
        job = jobs[index]
        request = job.request
        names = [w.name for w in cluster.workers]
        view = (
            self.balancer.look(request.prompt, names, now, request.fields)
            if self.prefix and request.prompt
            else None
        )
        ctx = RoutingContext(
            request,
            index,
            self.affinity.get(job.prompt[: self.prefix_chars]),
            now=now,
            prefix=view.held if view else None,
            waits=view.waits if view else None,
            service=view.line if view else None,
            roomy=view.roomy if view else None,
            tokens=view.tokens if view else None,
        )
        pick = self.balancer.pick(cluster.workers, ctx, rng)
        name = names[pick.index]
        sample = self.balancer.on_sent(name, index, ctx, now) if self.balancer.tracks else None
        self.sent[index] = (name, pick.cache_hit, view.chunks if view else None, sample)
        return pick.index

    def prefilled(self, worker: Worker, job: Job, prefill: Prefill, now: float) -> None:
        kv = self.balancer.kv
        if kv is None:
            return
        seq = self.seqs.get(worker.name, 0)
        self.seqs[worker.name] = seq + 1
        events = prefill_events(prefill, job.ids, BLOCK_TOKENS)
        kv.apply(worker.name, seq, encode_batch(KVEventBatch(ts=now, events=list(events))), now)

    def answering(self, worker: Worker, index: int, job: Job) -> None:
        # As the proxy does once the server's 200 came: a stream's before it is relayed.
        name, cache_hit, chunks, _ = self.sent[index]
        self.answered.add(index)
        if not cache_hit:  # proxy._remember: a miss (a new prefix, or the guard's detour) remembers
            self.affinity[job.prompt[: self.prefix_chars]] = name
        if chunks is not None:
            self.balancer.on_cached(name, chunks)  # every simulated answer is a 200

    def ended(self, worker: Worker, index: int, now: float, job: Job) -> None:
        if index not in self.answered:  # (an answer sent whole: its headers come with it)
            self.answering(worker, index, job)
        self.answered.discard(index)
        name, _, _, sample = self.sent.pop(index)
        self.balancer.on_ended(name, index)
        self.balancer.on_served(sample, now)


class Oracle(Router):
    """Knows each worker's true cache and queue: the worker where this request ends first (among
    equals the one caching most). The best a router deciding one request at a time can do."""

    def pick(self, cluster: Cluster, jobs: Sequence[Job], index: int, now: float, rng: random.Random) -> int:
        job = jobs[index]
        best = min(
            (
                cluster.wait(w, jobs, now) + cluster.service(w, job),
                -w.cache.match(job.blocks),
                rng.random(),
                i,
            )
            for i, w in enumerate(cluster.workers)
        )
        return best[-1]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def simulate(
    router: Router,
    requests: list[BenchRequest],
    spec: WorkloadSpec,
    shape: SimShape,
    workers_count: int,
    seed: int,
    output_spread: float = 0.0,
) -> dict[str, float]:
    """One run: `requests` sent by `spec.concurrency` closed-loop clients to `workers_count` workers
    shaped as `shape` (its max_concurrency is the slots per worker). With an `output_spread`, each
    answer's length is drawn uniformly within that share of `spec.output_tokens` either side (a
    server stops at the end of a sentence, not at max_tokens), which the router cannot know."""
    jobs = []
    WORDS.by_body.clear()  # (the bodies of this run only: an id may be reused once one is gone)
    lengths = random.Random(seed + 7919)
    for r in requests:
        request = routing_request(orjson.dumps(r.body("m", spec)), "chat")
        tokens = prompt_tokens(r)
        spread = lengths.uniform(1 - output_spread, 1 + output_spread) if output_spread else 1.0
        output = max(1, round(spec.output_tokens * spread))
        ids = [_WORD_IDS.setdefault(word, len(_WORD_IDS)) for word in tokens]
        WORDS.by_body[id(request.fields)] = ids
        jobs.append(Job(request.prompt, len(tokens), block_hashes(ids, BLOCK_TOKENS), request, output, ids))
    slots = shape.max_concurrency
    workers = [Worker(f"w{i}", PrefixCache(shape.cache_blocks), slots) for i in range(workers_count)]
    cluster = Cluster(workers, shape.prefill_ms_per_token / 1000, shape.decode_ms_per_token / 1000)
    rng = random.Random(seed)
    events: list[tuple[float, int, int]] = []  # (when it ends, job, worker)
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    cached = total = 0
    shares = [0] * len(workers)
    following = iter(range(len(jobs)))

    def start(w: int, index: int, now: float) -> None:
        nonlocal cached, total
        worker, job = workers[w], jobs[index]
        seconds = cluster.service(worker, job)
        prefill = plan_prefill(worker.cache, job.ids, BLOCK_TOKENS)
        router.prefilled(worker, job, prefill, now)
        hit = min(job.tokens, prefill.cached_tokens)
        cached, total = cached + hit, total + job.tokens
        worker.running += 1
        worker.ends.append(now + seconds)
        heapq.heappush(events, (now + seconds, index, w))

    def send(now: float) -> None:
        index = next(following, None)
        if index is None:
            return
        sent_at[index] = now
        w = router.pick(cluster, jobs, index, now, rng)
        worker = workers[w]
        worker.in_flight += 1
        shares[w] += 1
        if worker.running < worker.slots:
            start(w, index, now)
        else:
            worker.queue.append(index)

    for _ in range(spec.concurrency):
        send(0.0)
    while events:
        now, index, w = heapq.heappop(events)
        worker = workers[w]
        worker.running -= 1
        worker.in_flight -= 1
        worker.ends.remove(min(worker.ends, key=lambda end: abs(end - now)))
        latencies.append(now - sent_at[index])
        router.ended(worker, index, now, jobs[index])
        if worker.queue:
            start(w, worker.queue.pop(0), now)
        send(now)
    return {
        "p95": percentile(latencies, 0.95) * 1000,
        "mean": statistics.fmean(latencies) * 1000,
        "cached": cached / total,
        "busiest": max(shares) / sum(shares),
    }


# The grid of workload shapes a routing rule must hold on (not one calibrated profile): each axis
# has values on both sides of the inferflow profile, which is one of its points.
GRID: dict[str, tuple[object, ...]] = {
    "slots": (1, 4),  # request slots per worker
    "load": (0.7, 1.0, 2.0),  # clients per slot in the cluster (closed loop)
    "prompt": ("inferflow", "long-shared", "long-unique"),  # (system prompt, user prompt) words
    "output": (20, 200),  # max_tokens
    "spread": (0.0, 0.8),  # each answer's length, within this share of max_tokens either side
    "cache": (112, 2048),  # blocks of 16 tokens per worker's prefix cache
    "cost": ("prefill-heavy", "decode-heavy"),  # ms per prompt token, ms per output token
    "repeat": (0.5, 0.1),  # share of user prompts drawn from the popular pool
    "config": ("sized", "defaults"),  # prefix_aware told the servers' cache and slots, or not
}
_PROMPTS = {"inferflow": (120, 240), "long-shared": (1000, 100), "long-unique": (30, 600)}
_COSTS = {"prefill-heavy": (0.8, 2.5), "decode-heavy": (0.1, 10.0)}
GRID_WORKERS = 3


def grid_points(count: int = 0, seed: int = 0) -> list[dict[str, object]]:
    """Every point of GRID, or `count` of them drawn without replacement (always the same ones
    for the same seed), the inferflow profile's point first."""
    names = list(GRID)
    points = [dict(zip(names, values, strict=True)) for values in itertools.product(*GRID.values())]
    base = {"slots": 1, "load": 1.0, "prompt": "inferflow", "output": 20, "spread": 0.0, "cache": 112,
            "cost": "prefill-heavy", "repeat": 0.5, "config": "sized"}  # fmt: skip
    points.remove(base)
    if count:
        points = random.Random(seed).sample(points, min(count - 1, len(points)))
    return [base, *points]


def point_shape(
    point: dict[str, object], requests: int = 300
) -> tuple[WorkloadSpec, SimShape, dict[str, object]]:
    """The workload, the workers and prefix_aware's settings of one grid point."""
    slots = int(point["slots"])  # type: ignore[call-overload]
    system, user = _PROMPTS[str(point["prompt"])]
    prefill, decode = _COSTS[str(point["cost"])]
    spec = PROFILES["inferflow"].workload.model_copy(
        update={
            "requests": requests,
            "concurrency": max(1, round(float(point["load"]) * GRID_WORKERS * slots)),  # type: ignore[arg-type]
            "system_prompt_tokens": system,
            "prompt_tokens": user,
            "output_tokens": point["output"],
            "repeat_share": point["repeat"],
        }
    )
    shape = SimShape(
        max_concurrency=slots, prefill_ms_per_token=prefill, decode_ms_per_token=decode,
        cache_blocks=int(point["cache"]),  # type: ignore[call-overload]
    )  # fmt: skip
    settings = gateway_config("prefix_aware", [], shape, 0)["models"][0]["prefix_aware"]
    return spec, shape, settings if point["config"] == "sized" else {}


def run_point(
    point: dict[str, object], seeds: int, requests: int = 300, precise: bool = False
) -> dict[str, dict[str, float]]:
    """least_pending and prefix_aware (and, with `precise`, prefix_aware fed the workers' KV
    events) at one grid point: medians over `seeds` of P95, mean, cached."""
    spec, shape, settings = point_shape(point, requests)
    rows = {}
    for name in ("least_pending", "prefix_aware", *(("prefix_aware:precise",) if precise else ())):
        runs = []
        for seed in range(seeds):
            sent = build_requests(spec.model_copy(update={"seed": seed}))
            strategy = Strategy(name.split(":")[0], settings, precise=name.endswith(":precise"))
            runs.append(
                simulate(strategy, sent, spec, shape, GRID_WORKERS, seed, float(point["spread"]))  # type: ignore[arg-type]
            )
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return rows


def grid(args: argparse.Namespace) -> None:
    points = grid_points(args.grid if args.grid > 0 else 0)
    print(f"$ {' '.join(sys.argv)}")
    print(f"{len(points)} grid points, {GRID_WORKERS} workers, medians of {args.seeds} seeds")
    header = "".join(f"{n:>14}" for n in GRID)
    precise = (
        "".join(f"{c:>8}" for c in ("P95/LP", "mean/LP", "cached")) + "  (precise)" if args.precise else ""
    )
    print(f"{header}{'P95/LP':>8}{'mean/LP':>8}{'cached':>8}{'LP':>7}{precise}")
    worst = {"prefix_aware": [0.0, 0.0, 0], "prefix_aware:precise": [0.0, 0.0, 0]}
    for point in points:
        rows = run_point(point, args.seeds, precise=args.precise)
        lp = rows["least_pending"]
        cells = "".join(f"{point[n]!s:>14}" for n in GRID)
        for name in ("prefix_aware", *(("prefix_aware:precise",) if args.precise else ())):
            row = rows[name]
            p95, mean = row["p95"] / lp["p95"], row["mean"] / lp["mean"]
            kept = worst[name]
            kept[0], kept[1] = max(kept[0], p95), max(kept[1], mean)
            flag = " <" if p95 > 1.03 or mean > 1.03 else ""
            kept[2] += bool(flag)
            cells += f"{p95:>8.2f}{mean:>8.2f}{row['cached'] * 100:>7.0f}%"
            cells += f"{lp['cached'] * 100:>6.0f}%{flag}" if name == "prefix_aware" else flag
        print(cells)
    for name, (p95, mean, over) in worst.items():
        if name == "prefix_aware" or args.precise:
            print(
                f"{name}: worst P95/LP {p95:.2f}, worst mean/LP {mean:.2f}; {over} of {len(points)} over 1.03"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="inferflow", choices=sorted(PROFILES))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slots", type=int, default=1, help="request slots per worker")
    parser.add_argument("--concurrency", type=int, default=None, help="default: the profile's")
    parser.add_argument("--seeds", type=int, default=5, help="workload seeds; the table shows medians")
    parser.add_argument(
        "--strategies",
        default="least_pending,kv_aware,prefix_aware,prefix_aware:precise",
        help="prefix_aware:precise: prefix_aware fed the workers' KV-cache events",
    )
    parser.add_argument(
        "--grid",
        type=int,
        default=None,
        help="prefix_aware against least_pending over N points of GRID (0: all)",
    )
    parser.add_argument("--precise", action="store_true", help="with --grid: prefix_aware:precise too")
    args, rest = parser.parse_known_args()
    if PROFILES[args.profile].workload.conversations:  # (open loop, batching servers: chat_sim.py)
        import chat_sim

        chat_sim.main(sys.argv[1:])
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.grid is not None:
        grid(args)
        return
    base = PROFILES[args.profile].workload
    spec = base.model_copy(update={"concurrency": args.concurrency or base.concurrency})
    shape = dataclasses.replace(PROFILES[args.profile].sims, max_concurrency=args.slots)
    settings = gateway_config("prefix_aware", [], shape, 0)["models"][0]["prefix_aware"]  # as bench --spawn
    routers: dict[str, Callable[[], Router]] = {
        n: (lambda n=n: Strategy(n.split(":")[0], settings, precise=n.endswith(":precise")))
        for n in args.strategies.split(",")
    }
    routers["oracle"] = Oracle
    print(f"$ {' '.join(sys.argv)}")
    print(
        f"{args.workers} workers x {args.slots} slot(s), concurrency {spec.concurrency}, "
        f"{spec.requests} requests, medians of {args.seeds} seeds"
    )
    rows: dict[str, dict[str, float]] = {}
    ceilings = []
    for name, make in routers.items():
        runs = []
        for seed in range(args.seeds):
            requests = build_requests(spec.model_copy(update={"seed": seed}))
            runs.append(simulate(make(), requests, spec, shape, args.workers, seed))
            if name == "oracle":
                ceilings.append(cacheable_share(requests))
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    floor_p95 = rows["least_pending"]["p95"] if "least_pending" in rows else None
    best_mean = rows["least_pending"]["mean"] if "least_pending" in rows else None
    print(f"{'router':<15}{'P95 ms':>8}{'mean ms':>9}{'cached':>8}{'busiest':>9}{'P95/LP':>8}{'mean/LP':>9}")
    for name, row in rows.items():
        ratios = ""
        if floor_p95 and best_mean:
            ratios = f"{row['p95'] / floor_p95:>8.2f}{row['mean'] / best_mean:>9.2f}"
        print(
            f"{name:<15}{row['p95']:>8.0f}{row['mean']:>9.0f}{row['cached'] * 100:>7.1f}%"
            f"{row['busiest'] * 100:>8.0f}%{ratios}"
        )
    print(f"an unbounded cache would serve {statistics.median(ceilings) * 100:.1f}% of prompt tokens")


if __name__ == "__main__":
    main()
