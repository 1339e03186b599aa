"""Fixtures that start real servers on ephemeral loopback ports (DESIGN.md habit 9)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from modelyard.config import validate_config
from modelyard.gateway import RunningGateway, start_gateway
from modelyard.simworker import SimWorker, SimWorkerConfig
from raw_http import Client
from support import free_ports

FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0}


@pytest.fixture
async def sim_workers() -> AsyncIterator[Any]:
    """`await sim_workers(n, **config)` starts n sim workers (zero latency unless overridden)."""
    started: list[SimWorker] = []

    async def start(n: int = 1, **overrides: Any) -> list[SimWorker]:
        workers = []
        for i in range(n):
            settings = {**FAST, "port": 0, "seed": i, **overrides}
            worker = SimWorker(SimWorkerConfig(**settings))
            await worker.start()
            started.append(worker)
            workers.append(worker)
        return workers

    yield start
    for worker in started:
        await worker.stop()


@pytest.fixture
async def gateways() -> AsyncIterator[Any]:
    """`await gateways(models, **top_level_config)` starts a gateway on a free port."""
    started: list[RunningGateway] = []

    async def start(models: list[dict[str, Any]], *, seed: int | None = 0, **config: Any) -> RunningGateway:
        data = {"listen": {"host": "127.0.0.1", "port": 0}, "models": models, **config}
        gateway = await start_gateway(validate_config(data, "<test>"), seed=seed)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        await gateway.stop()


@pytest.fixture
async def clients() -> AsyncIterator[Any]:
    """`await clients(url)`: a raw keep-alive connection (tests/raw_http.py), closed at teardown."""
    opened: list[Client] = []

    async def connect(url: str) -> Client:
        client = await Client.connect(url)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server on a free port, started for this test session."""
    server = RedisServer()
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for one test, which the test may stop and start again (empty)."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


class RedisServer:
    """redis-server on one free port, without persistence: each start is empty."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed (Debian package redis-server); the shared-state tests need it"
            )
        self._binary = binary
        (self.port,) = free_ports(1)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self._process is None, "already running"
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._process = subprocess.Popen(
            [self._binary, *options], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        _wait_for_port(self.port, self._process)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None


def _wait_for_port(port: int, process: subprocess.Popen[bytes], attempts: int = 200) -> None:
    for _ in range(attempts):
        if process.poll() is not None:
            pytest.fail(f"redis-server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.025)  # a bounded wait for the process to start listening
    pytest.fail(f"redis-server did not answer on port {port}")
