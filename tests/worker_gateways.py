"""`serve_workers(config)`: a `modelyard serve --workers 2` process on a free port (stopped at
teardown), and a way to reach each of its workers."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml


class Workers:
    """A `modelyard serve --workers 2` process and a way to reach each of its workers."""

    def __init__(self, process: asyncio.subprocess.Process, url: str, output: list[str]) -> None:
        self.process = process
        self.url = url
        self.output = output  # its lines so far, read by a background task
        self.sessions: list[aiohttp.ClientSession] = []

    async def on_worker(self, index: int) -> aiohttp.ClientSession:
        """A session whose one keep-alive connection is served by worker `index`."""
        for _ in range(200):
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, force_close=False),
                timeout=aiohttp.ClientTimeout(total=30),
            )
            self.sessions.append(session)
            if (await self.worker_of(session))["worker"] == index:
                return session
        raise AssertionError(f"no connection reached worker {index}")

    async def worker_of(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "/healthz") as response:
            return await response.json()  # type: ignore[no-any-return]

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


@pytest.fixture
async def serve_workers(tmp_path: Path) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[Workers]]]:
    processes: list[asyncio.subprocess.Process] = []
    readers: list[asyncio.Task[None]] = []
    started: list[Workers] = []

    async def start(config: dict[str, Any]) -> Workers:
        path = tmp_path / f"gateway-{len(processes)}.yaml"
        path.write_text(
            yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0, "drain_seconds": 0}, **config})
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2",
            "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        processes.append(process)  # stopped at teardown even if it never announces
        output: list[str] = []
        announced: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def read() -> None:  # to the end: a full pipe would block the gateway's logging
            assert process.stdout is not None
            while line := (await process.stdout.readline()).decode():
                output.append(line)
                match = re.search(r"listening on (http://\S+) .*2 workers", line)
                if match and not announced.done():
                    announced.set_result(match.group(1))
            if not announced.done():
                announced.set_exception(AssertionError("exited without serving:\n" + "".join(output)))

        readers.append(asyncio.create_task(read()))
        workers = Workers(process, await asyncio.wait_for(announced, 60), output)
        started.append(workers)
        return workers

    yield start
    for workers in started:
        await workers.close()
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
    await asyncio.gather(*readers, return_exceptions=True)
