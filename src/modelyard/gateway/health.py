"""Active health checking: probe every endpoint of every cluster on its interval; the cluster
applies each result (cluster.record_probe) and takes endpoints out or brings them back."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence

from modelyard.cluster import Endpoint
from modelyard.gateway.cluster import Cluster
from modelyard.upstream import UpstreamPool


class HealthChecker:
    def __init__(self, clusters: Iterable[Cluster], pool: UpstreamPool) -> None:
        self._clusters = [c for c in clusters if c.health_checked]
        self._pool = pool
        self._tasks: list[asyncio.Task[None]] = []

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(c, c.endpoints) for c in self._clusters))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(c), name=f"health:{c.name}") for c in self._clusters]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _loop(self, cluster: Cluster) -> None:
        """Healthy endpoints are probed every `interval`; endpoints that are down (by a probe or a
        refused request), and those whose last probe failed, every `unhealthy_interval` (Envoy's
        names): one that comes back is used again soon, and one that stopped answering (a hung
        server) is confirmed down in about `unhealthy_threshold` x `unhealthy_interval` after its
        first failed probe rather than as many full intervals."""
        check = cluster.config.health_check
        tick = min(check.interval, check.unhealthy_interval)
        loop = asyncio.get_running_loop()
        last = dict.fromkeys(cluster.endpoints, loop.time())  # check_once probed them at start
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            endpoints = cluster.endpoints  # the cluster may have replaced them since
            # An endpoint added since is probed now: it takes traffic until its first verdict.
            last = {e: last.get(e, -math.inf) for e in endpoints}
            batch = [e for e in endpoints if now - last[e] >= self._period(e, check.interval, tick) - 1e-3]
            if batch:
                await self._check(cluster, batch)
                for endpoint in batch:
                    last[endpoint] = now

    @staticmethod
    def _period(endpoint: Endpoint, interval: float, tick: float) -> float:
        health = endpoint.health
        return interval if health.healthy and not health.consecutive_failures else tick

    async def _check(self, cluster: Cluster, endpoints: Sequence[Endpoint]) -> None:
        check = cluster.config.health_check
        errors = await asyncio.gather(
            *(self._pool.probe(e.url, check.path, check.timeout) for e in endpoints)
        )
        for endpoint, error in zip(endpoints, errors, strict=True):
            cluster.record_probe(endpoint, error)
