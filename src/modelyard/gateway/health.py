"""Active health checking: probe every endpoint on its model's interval, publish the result."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from modelyard.cluster import Endpoint
from modelyard.gateway.models import ServedModel
from modelyard.upstream import UpstreamPool


class HealthChecker:
    def __init__(self, models: Iterable[ServedModel], pool: UpstreamPool) -> None:
        self._models = [m for m in models if m.health_checked]
        self._pool = pool
        self._tasks: list[asyncio.Task[None]] = []

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check_model(m) for m in self._models))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(m), name=f"health:{m.name}") for m in self._models]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _loop(self, model: ServedModel) -> None:
        """Healthy endpoints are probed every `interval`, endpoints that are down (by a probe or a
        refused request) every `unhealthy_interval` (Envoy's names), so one that comes back is
        used again soon."""
        check = model.config.health_check
        tick = min(check.interval, check.unhealthy_interval)
        loop = asyncio.get_running_loop()
        last = dict.fromkeys(map(id, model.endpoints), loop.time())
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            batch = [
                e
                for e in model.endpoints
                if now - last[id(e)] >= (check.interval if e.healthy else tick) - 1e-3
            ]
            if batch:
                await self._check(model, batch)
                for endpoint in batch:
                    last[id(endpoint)] = now

    async def _check_model(self, model: ServedModel) -> None:
        await self._check(model, model.endpoints)

    async def _check(self, model: ServedModel, endpoints: list[Endpoint]) -> None:
        check = model.config.health_check
        errors = await asyncio.gather(
            *(self._pool.probe(e.url, check.path, check.timeout) for e in endpoints)
        )
        for endpoint, error in zip(endpoints, errors, strict=True):
            model.record_probe(endpoint, error)
