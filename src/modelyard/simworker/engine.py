"""The mechanism around the pure latency model: slots, the queue, sleeps and live counters.

A request holds a slot for its whole prefill and decode. With all costs at zero nothing sleeps,
so the worker doubles as a fast test backend. What an admission does to the prefix cache goes, as
one batch of vLLM's KV-cache events, to `kv_events` when a publisher is attached.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from modelyard.balancing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from modelyard.simworker.cache_events import prefill_events
from modelyard.simworker.config import SimWorkerConfig
from modelyard.simworker.latency import PrefixCache, Tokens, cache_usage, kv_blocks_needed, plan_prefill

KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class SimStats:
    """Live counters; tokens are whitespace-separated words, or token ids with a tokenizer."""

    running: int = 0
    waiting: int = 0
    requests_total: int = 0
    failures_total: int = 0
    requests_by_endpoint: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    kv_blocks_in_use: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Slots:
    """A FIFO semaphore whose limit can change at runtime; counts land in `stats`."""

    def __init__(self, limit: int, stats: SimStats) -> None:
        self.limit = limit
        self._stats = stats
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self._stats.running < self.limit and not self._waiters:
            self._stats.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._stats.waiting = len(self._waiters)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            self._stats.waiting = len(self._waiters)

    def release(self) -> None:
        self._stats.running -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._stats.running < self.limit:  # bounded by the queue length
            fut = self._waiters.popleft()
            if not fut.done():
                self._stats.running += 1
                fut.set_result(None)
        self._stats.waiting = len(self._waiters)


class Running:
    """A request holding a slot: paces its decode steps against the current config."""

    def __init__(self, engine: SimEngine, cached_tokens: int) -> None:
        self._engine = engine
        self.cached_tokens = cached_tokens
        self.steps_done = 0
        self._deadline = asyncio.get_running_loop().time()

    async def step(self) -> None:
        """Wait out one decode step (one token per choice). Reads the cost now, so a runtime
        slowdown reaches requests already streaming. Catches up at most one step when late."""
        self.steps_done += 1
        cost = self._engine.decode_ms(1) / 1000.0
        if cost <= 0:
            return
        now = asyncio.get_running_loop().time()
        self._deadline = max(self._deadline, now - cost) + cost
        await asyncio.sleep(self._deadline - now)

    async def steps(self, n: int) -> None:
        """Wait out `n` decode steps at once (non-streaming responses)."""
        self.steps_done += n
        cost = self._engine.decode_ms(n) / 1000.0
        if cost > 0:
            await asyncio.sleep(cost)


class SimEngine:
    def __init__(self, config: SimWorkerConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self.cache = PrefixCache(config.cache_blocks)
        self._rng = random.Random(config.seed)
        self._slots = _Slots(config.max_concurrency, self.stats)
        # One batch of events per change to the cache (kv_publisher.py); None: nobody listens.
        self.kv_events: Callable[[list[KvEvent]], None] | None = None

    def update_config(self, changes: Mapping[str, object]) -> SimWorkerConfig:
        self.config = self.config.with_runtime_changes(changes)
        self._slots.set_limit(self.config.max_concurrency)
        return self.config

    def decode_ms(self, steps: int) -> float:
        """`steps` decode steps at the batch running now: each other request running makes a step
        `batch_slowdown` of a lone one's cost longer (a stream reads it at each step, as the batch
        changes; an answer sent whole, once, when its steps start)."""
        config = self.config
        batch = 1.0 + config.batch_slowdown * max(0, self.stats.running - 1)
        return config.costs.decode_ms(steps) * batch

    def count(self, endpoint: str) -> None:
        self.stats.requests_total += 1
        by_endpoint = self.stats.requests_by_endpoint
        by_endpoint[endpoint] = by_endpoint.get(endpoint, 0) + 1

    def should_fail(self) -> bool:
        rate = self.config.fail_rate
        if rate > 0 and self._rng.random() < rate:
            self.stats.failures_total += 1
            return True
        return False

    @property
    def cache_usage(self) -> float:
        return cache_usage(self.stats.kv_blocks_in_use, self.config.cache_blocks)

    def clear_cache(self) -> None:
        """Empty the prefix cache (and say so, as vLLM's reset_prefix_cache does)."""
        self.cache.clear()
        if self.kv_events is not None:
            self.kv_events([AllBlocksCleared()])

    @asynccontextmanager
    async def admit(
        self, prompts: Sequence[Tokens], max_tokens: int, *, use_cache: bool = True
    ) -> AsyncIterator[Running]:
        """Queue for a slot, match the prefix cache, wait out the prefill; release on exit."""
        await self._slots.acquire()
        stats = self.stats
        block_tokens = self.config.block_tokens
        blocks = 0
        running: Running | None = None
        try:
            cached = uncached = 0
            publish = self.kv_events if use_cache else None
            events: list[KvEvent] = []
            for tokens in prompts:
                prefill = plan_prefill(self.cache if use_cache else None, tokens, block_tokens)
                cached += prefill.cached_tokens
                uncached += prefill.uncached_tokens
                blocks += kv_blocks_needed(prefill.prompt_tokens, max_tokens, block_tokens)
                if publish is not None:
                    events += prefill_events(prefill, tokens, block_tokens)
            if events and publish is not None:  # (nothing changed: nothing to say)
                publish(events)
            stats.kv_blocks_in_use += blocks
            stats.prompt_tokens_total += cached + uncached
            if use_cache:
                stats.prefix_cache_queries_tokens += cached + uncached
                stats.prefix_cache_hits_tokens += cached
            running = Running(self, cached)
            cost = self.config.costs.prefill_ms(uncached) / 1000.0
            if cost > 0:
                await asyncio.sleep(cost)
                running._deadline = asyncio.get_running_loop().time()
            yield running
        finally:
            stats.kv_blocks_in_use -= blocks
            if running is not None:
                stats.completion_tokens_total += running.steps_done * len(prompts)
            self._slots.release()

    def snapshot(self) -> dict[str, object]:
        """`GET /sim/stats`."""
        return {
            **self.stats.as_dict(),
            "cached_blocks": len(self.cache),
            "gpu_cache_usage_perc": self.cache_usage,
            "config": self.config.model_dump(mode="json"),
        }
