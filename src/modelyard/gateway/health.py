"""Active health checking: probe every endpoint on its model's interval, publish the result."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

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
        interval = model.config.health_check.interval
        while True:
            await asyncio.sleep(interval)
            await self._check_model(model)

    async def _check_model(self, model: ServedModel) -> None:
        check = model.config.health_check
        errors = await asyncio.gather(
            *(self._pool.probe(e.url, check.path, check.timeout) for e in model.endpoints)
        )
        for endpoint, error in zip(model.endpoints, errors, strict=True):
            model.record_probe(endpoint, error)
