"""Replay a conversation profile of `modelyard bench` (`--profile chat`: multi-turn chats and agent
loops, open-loop Poisson arrivals, servers that batch) against simulated workers in virtual time:
modelyard's strategies through the gateway's own Balancer (as routing_sim.py drives it), an oracle
that knows every worker's true cache and batch, and what an unbounded cache would serve. This is
what says how close routing comes to the best on this traffic; `modelyard bench` measures the same
workload on real processes (and other routers through `--target`).

    .venv/bin/python benchmarks/chat_sim.py                         # chat, 4 workers, 70% load
    .venv/bin/python benchmarks/chat_sim.py --load 0.9 --seeds 3
    .venv/bin/python benchmarks/routing_sim.py --profile chat       # the same

The workers follow the sim-worker (simworker/engine.py): `max_concurrency` slots, a FIFO queue for
them, a prefill of the uncached tokens, then one decode step per output token whose cost grows by
`batch_slowdown` for each other request holding a slot. Decode is simulated as processor sharing
(every running request advances at the batch's current step rate), not step by step. Each turn's
prompt is the conversation so far with the sim-worker's own answers (simworker.text), so the
cache sees what it sees in a bench run. Conversations arrive as the bench sends them: a Poisson
process at `--load` of the workers' capacity (bench.workload.capacity), a user thinking between
turns; the first `warmup` seconds are sent but not counted. The bench's cap of `concurrency`
requests in flight is not modelled (at these loads it is never reached).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (routing_sim, when loaded from a test)

from modelyard.bench import PROFILES, WorkloadSpec
from modelyard.bench.spawn import gateway_config
from modelyard.bench.workload import (
    BenchRequest,
    SimShape,
    capacity,
    iter_conversations,
    mean_turns,
    prompt_tokens,
)
from modelyard.protocols.openai import routing_request
from modelyard.simworker.latency import PrefixCache, block_hashes, plan_prefill
from modelyard.simworker.text import chat_prompt, generate_words
from routing_sim import _WORD_IDS, BLOCK_TOKENS, OVERHEAD, WORDS, Job, Router, Strategy, percentile

EPSILON = 1e-9  # (decode tokens left: float sums)


@dataclass(slots=True)
class Turn:
    """A request on a worker: its prefill ends at `prefilled`, then `left` decode steps."""

    index: int
    sent: float
    prefilled: float = 0.0
    left: float = 0.0
    first: float | None = None  # when its first token was out
    ended: float = 0.0


@dataclass(slots=True)
class BatchWorker:
    name: str
    cache: PrefixCache
    slots: int
    active: list[Turn] = field(default_factory=list)
    queue: deque[Turn] = field(default_factory=deque)
    last: float = 0.0  # when `active` was last advanced
    version: int = 0  # (its scheduled event; an older one is stale)
    # what a strategy reads (EndpointView)
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    in_flight: int = 0
    outstanding_tokens: int = 0
    resources: None = None


class Workers:
    """The batching workers and their costs (as `routing_sim.Cluster`, for a batch)."""

    def __init__(self, workers: list[BatchWorker], shape: SimShape) -> None:
        self.workers = workers
        self.prefill = shape.prefill_ms_per_token / 1000
        self.decode = shape.decode_ms_per_token / 1000
        self.slowdown = shape.batch_slowdown

    def step(self, running: int) -> float:
        """One decode step's seconds with `running` requests holding slots."""
        return self.decode * (1.0 + self.slowdown * max(0, running - 1))

    def advance(self, worker: BatchWorker, now: float) -> None:
        """Every running request's decode, from `worker.last` to `now`, at the batch's rate."""
        span_start = worker.last
        if now <= span_start:
            return
        step = self.step(len(worker.active))
        for turn in worker.active:
            begin = max(span_start, turn.prefilled)
            if begin < now:
                if turn.first is None:
                    turn.first = begin + step
                turn.left -= (now - begin) / step
        worker.last = now

    def next_end(self, worker: BatchWorker, now: float) -> float | None:
        step = self.step(len(worker.active))
        return min((max(now, t.prefilled) + max(0.0, t.left) * step for t in worker.active), default=None)

    def finish_if_sent(self, worker: BatchWorker, job: Job, now: float) -> float:
        """When `job` would end on `worker` if sent now (the oracle's view: its queue is served as
        the running requests end, at today's batch; its own decode at the batch it would join)."""
        running = len(worker.active)
        if running < worker.slots:
            start = now
        else:
            step = self.step(running)
            ends = sorted(max(now, t.prefilled) + max(0.0, t.left) * step for t in worker.active)
            ahead = len(worker.queue)
            start = ends[min(ahead, len(ends) - 1)]
            for _ in range(ahead // len(ends)):  # (a queue longer than the batch: whole rounds more)
                start += statistics.fmean(ends) - now
        cached = min(job.tokens, worker.cache.match(job.blocks) * BLOCK_TOKENS)
        batch = min(worker.slots, running + 1)
        return start + (job.tokens - cached) * self.prefill + job.output * self.step(batch)


class BatchOracle(Router):
    """Knows each worker's true cache, batch and queue: the worker where this request would end
    first (among equals the one caching most). Greedy: it does not weigh the slowdown it brings to
    the requests already in a batch, nor what the cache will hold later, so a router can beat it
    on some measure; it is a reference, not a bound."""

    def __init__(self, workers: Workers) -> None:
        self.at = workers

    def pick(self, cluster: object, jobs: Sequence[Job], index: int, now: float, rng: random.Random) -> int:
        for worker in self.at.workers:  # (each batch as it is now, not as it was at its last event)
            self.at.advance(worker, now)
        job = jobs[index]
        best = min(
            (self.at.finish_if_sent(w, job, now), -w.cache.match(job.blocks), rng.random(), i)
            for i, w in enumerate(self.at.workers)
        )
        return best[-1]


def answer(request: BenchRequest, spec: WorkloadSpec) -> str:
    """What the sim-worker answers: the same words for the same conversation so far."""
    messages = request.body("", spec)["messages"]
    return " ".join(generate_words(chat_prompt(messages), request.max_tokens or spec.output_tokens))  # type: ignore[arg-type]


def simulate_chat(
    make_router: Callable[[Workers], Router],
    spec: WorkloadSpec,
    shape: SimShape,
    workers_count: int,
    load: float,
    seed: int,
) -> dict[str, float]:
    """One run of the profile at `load` of the workers' capacity."""
    spec = spec.model_copy(update={"seed": seed})
    rate = load * capacity(spec, shape, workers_count) / mean_turns(spec)  # conversations per second
    workers = [
        BatchWorker(f"w{i}", PrefixCache(shape.cache_blocks), shape.max_concurrency)
        for i in range(workers_count)
    ]
    at = Workers(workers, shape)
    router = make_router(at)
    rng = random.Random(seed)
    arrivals = random.Random(seed + 1)
    conversations = iter_conversations(spec)
    WORDS.by_body.clear()
    jobs: list[Job] = []
    turns: list[Turn] = []
    playing: list[tuple[object, int, list[str]]] = []  # job -> (conversation, turn, answers so far)
    events: list[tuple[float, int, int, int]] = []  # (when, tiebreak, kind, what)
    order = itertools.count()
    arrive, send_turn, worker_event = 0, 1, 2
    counted: list[tuple[Turn, Job, int]] = []  # (turn, job, cached tokens) sent after the warm-up
    cached_of: dict[int, int] = {}
    ceiling = PrefixCache(1 << 62)
    ceiling_hits = 0
    shares = [0] * workers_count
    sent = 0

    def schedule(w: int, now: float) -> None:
        worker = workers[w]
        worker.version += 1
        end = at.next_end(worker, now)
        if end is not None:
            heapq.heappush(events, (end, next(order), worker_event, w * 1_000_000 + worker.version))

    def start(w: int, turn: Turn, now: float) -> None:
        worker, job = workers[w], jobs[turn.index]
        prefill = plan_prefill(worker.cache, job.ids, BLOCK_TOKENS)
        router.prefilled(worker, job, prefill, now)  # type: ignore[arg-type]
        cached_of[turn.index] = min(job.tokens, prefill.cached_tokens)
        turn.prefilled = now + prefill.uncached_tokens * at.prefill
        turn.left = float(job.output)
        worker.active.append(turn)

    def send(conversation: object, number: int, answers: list[str], now: float) -> None:
        nonlocal sent, ceiling_hits
        if sent >= spec.requests:
            return
        sent += 1
        request = conversation.turn(number, answers)  # type: ignore[attr-defined]
        index = len(jobs)
        parsed = routing_request(orjson.dumps(request.body("m", spec)), "chat")
        words = prompt_tokens(request)
        ids = [_WORD_IDS.setdefault(word, len(_WORD_IDS)) for word in words]
        WORDS.by_body[id(parsed.fields)] = ids
        blocks = block_hashes(ids, BLOCK_TOKENS)
        output = request.max_tokens or spec.output_tokens
        jobs.append(Job(parsed.prompt, len(words), blocks, parsed, output, ids))
        playing.append((conversation, number, answers))
        ceiling_hit = min(len(words), ceiling.match_and_insert(blocks) * BLOCK_TOKENS)
        turn = Turn(index, now)
        turns.append(turn)
        w = router.pick(at, jobs, index, now, rng)
        worker = workers[w]
        worker.in_flight += 1
        shares[w] += 1
        router.answering(worker, index, jobs[index])  # type: ignore[arg-type]  # (headers before the stream)
        at.advance(worker, now)
        if len(worker.active) < worker.slots:
            start(w, turn, now)
        else:
            worker.queue.append(turn)
        schedule(w, now)
        if now >= spec.warmup:
            counted.append((turn, jobs[index], w))
            ceiling_hits += ceiling_hit

    heapq.heappush(events, (0.0, next(order), arrive, 0))
    pending: dict[int, tuple[object, int, list[str]]] = {}
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == arrive:
            if sent >= spec.requests:
                continue
            send(next(conversations), 0, [], now)
            heapq.heappush(events, (now + arrivals.expovariate(rate), next(order), arrive, 0))
        elif kind == send_turn:
            conversation, number, answers = pending.pop(what)
            send(conversation, number, answers, now)
        else:
            w, version = divmod(what, 1_000_000)
            worker = workers[w]
            if version != worker.version:
                continue  # (the batch changed since: rescheduled)
            at.advance(worker, now)
            done = [t for t in worker.active if t.prefilled <= now and t.left <= EPSILON]
            for turn in done:
                worker.active.remove(turn)
                worker.in_flight -= 1
                turn.ended = now
                router.ended(worker, turn.index, now, jobs[turn.index])  # type: ignore[arg-type]
                conversation, number, answers = playing[turn.index]
                if number + 1 < len(conversation.messages):  # type: ignore[attr-defined]
                    request = conversation.turn(number, answers)  # type: ignore[attr-defined]
                    key = next(order)
                    pending[key] = (conversation, number + 1, [*answers, answer(request, spec)])
                    pause = conversation.pauses[number]  # type: ignore[attr-defined]
                    heapq.heappush(events, (now + OVERHEAD + pause, next(order), send_turn, key))
            while worker.queue and len(worker.active) < worker.slots:
                start(w, worker.queue.popleft(), now)
            schedule(w, now)
    if not counted:
        raise SystemExit(f"no turn was sent after the {spec.warmup:g} s warm-up: send more (--requests)")
    latencies = [t.ended - t.sent + OVERHEAD for t, _, _ in counted]
    ttfts = [(t.first or t.ended) - t.sent + OVERHEAD for t, _, _ in counted]
    itls = [
        (t.ended - t.first) / (j.output - 1) for t, j, _ in counted if t.first is not None and j.output > 1
    ]
    prompt = sum(j.tokens for _, j, _ in counted)
    return {
        "p50": percentile(latencies, 0.5) * 1000,
        "p95": percentile(latencies, 0.95) * 1000,
        "mean": statistics.fmean(latencies) * 1000,
        "ttft50": percentile(ttfts, 0.5) * 1000,
        "ttft95": percentile(ttfts, 0.95) * 1000,
        "itl50": percentile(itls, 0.5) * 1000,
        "cached": sum(cached_of[t.index] for t, _, _ in counted) / prompt,
        "ceiling": ceiling_hits / prompt,
        "busiest": max(shares) / sum(shares),
    }


def routers(names: Sequence[str], shape: SimShape) -> dict[str, Callable[[Workers], Router]]:
    settings = gateway_config("prefix_aware", [], shape, 0)["models"][0]["prefix_aware"]  # as bench --spawn
    made: dict[str, Callable[[Workers], Router]] = {
        n: (lambda _, n=n: Strategy(n.split(":")[0], settings, precise=n.endswith(":precise"))) for n in names
    }
    made["oracle"] = BatchOracle
    return made


def run(
    names: Sequence[str], profile: str, workers: int, load: float, seeds: int, requests: int | None = None
) -> dict[str, dict[str, float]]:
    """Each router's medians over `seeds` runs of `profile` at `load`."""
    spec, shape = PROFILES[profile].workload, PROFILES[profile].sims
    if requests is not None:
        spec = spec.model_copy(update={"requests": requests})
    rows = {}
    for name, make in routers(names, shape).items():
        runs = [simulate_chat(make, spec, shape, workers, load, seed) for seed in range(seeds)]
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--profile", default="chat", choices=[n for n, p in PROFILES.items() if p.workload.conversations]
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--load", type=float, default=None, help="share of the workers' capacity (default: the profile's)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds; the table shows medians")
    parser.add_argument("--requests", type=int, default=None, help="turns per run (default: the profile's)")
    parser.add_argument("--strategies", default="least_pending,round_robin,prefix_aware,prefix_aware:precise")
    args = parser.parse_args(argv)
    load = args.load if args.load is not None else (PROFILES[args.profile].load or 0.7)
    rows = run(args.strategies.split(","), args.profile, args.workers, load, args.seeds, args.requests)
    spec = PROFILES[args.profile].workload
    print(f"$ {' '.join(sys.argv)}")
    print(
        f"{args.profile}: {args.workers} workers x {PROFILES[args.profile].sims.max_concurrency} slots, "
        f"load {load:g}, {args.requests or spec.requests} turns, medians of {args.seeds} seeds"
    )
    columns = ("P50 ms", "P95 ms", "mean ms", "TTFT p50", "TTFT p95", "ITL p50", "cached", "busiest")
    print(f"{'router':<22}" + "".join(f"{c:>10}" for c in columns))
    for name, row in rows.items():
        cells = [row["p50"], row["p95"], row["mean"], row["ttft50"], row["ttft95"]]
        line = "".join(f"{v:>10.0f}" for v in cells) + f"{row['itl50']:>10.1f}"
        print(f"{name:<22}{line}{row['cached'] * 100:>9.1f}%{row['busiest'] * 100:>9.0f}%")
    ceiling = statistics.median(r["ceiling"] for r in rows.values())
    print(f"an unbounded cache would serve {ceiling * 100:.1f}% of prompt tokens")


if __name__ == "__main__":
    main()
