"""Active health checking: probe every endpoint of every cluster on its interval; the cluster
applies each result (cluster.record_probe) and takes endpoints out or brings them back."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Sequence

from modelyard.cluster import Endpoint
from modelyard.gateway.cluster import Cluster
from modelyard.upstream import UpstreamPool


class HealthChecker:
    def __init__(
        self,
        clusters: Iterable[Cluster],
        pool: UpstreamPool,
        on_probe: Callable[[Cluster, Endpoint], None] | None = None,
    ) -> None:
        self._clusters = {c.name: c for c in clusters if c.health_checked}
        self._pool = pool
        self._on_probe = on_probe  # after each verdict: the leader worker publishes it to the others
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(c, c.endpoints) for c in list(self._clusters.values())))

    def start(self) -> None:
        self._started = True
        for cluster in self._clusters.values():
            self._run(cluster, probed=True)

    def add(self, cluster: Cluster) -> None:
        """Check a cluster added at runtime (placed by the scheduler); its first probe goes out at
        once. A cluster of the same name that was checked before is replaced."""
        self.remove(cluster.name)
        if not cluster.health_checked:
            return
        self._clusters[cluster.name] = cluster
        if self._started:
            self._run(cluster, probed=False)

    def remove(self, name: str) -> None:
        self._clusters.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        self._started = False
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = {}

    def _run(self, cluster: Cluster, probed: bool) -> None:
        self._tasks[cluster.name] = asyncio.create_task(
            self._loop(cluster, probed), name=f"health:{cluster.name}"
        )

    async def _loop(self, cluster: Cluster, probed: bool) -> None:
        """Healthy endpoints are probed every `interval`; endpoints that are down (by a probe or a
        refused request), and those whose last probe failed, every `unhealthy_interval` (Envoy's
        names): one that comes back is used again soon, and one that stopped answering (a hung
        server) is confirmed down in about `unhealthy_threshold` x `unhealthy_interval` after its
        first failed probe rather than as many full intervals. `probed`: check_once has just
        probed the cluster's endpoints (at start); else they are probed at once."""
        check = cluster.config.health_check
        tick = min(check.interval, check.unhealthy_interval)
        loop = asyncio.get_running_loop()
        last = dict.fromkeys(cluster.endpoints, loop.time() if probed else -math.inf)
        while True:
            now = loop.time()
            endpoints = cluster.endpoints  # the cluster may have replaced them since
            # An endpoint added since is probed now: it takes traffic until its first verdict.
            last = {e: last.get(e, -math.inf) for e in endpoints}
            batch = [e for e in endpoints if now - last[e] >= self._period(e, check.interval, tick) - 1e-3]
            if batch:
                await self._check(cluster, batch)
                for endpoint in batch:
                    last[endpoint] = now
            await asyncio.sleep(tick)

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
            if self._on_probe is not None:
                self._on_probe(cluster, endpoint)
