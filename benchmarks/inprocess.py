"""The gateway's own CPU per proxied request, without sockets: what its Python costs.

Runs a real gateway (`start_gateway`, the default config shape of overhead.py: one model, round
robin over 3 endpoints) in this process and drives its lean HTTP/1.1 connections directly: each
client connection is an `H1Connection` given a fake transport, and the upstream pool's connections
get a fake transport too, which answers every request with the same small chat.completion
(overhead.py's backend answer) on the next turn of the loop. So every line of the request path
runs (parse, route, pick, the attempt loop, the upstream client, the relay, metrics, the routing
log), but no system call: the numbers are the gateway's user-space work alone, and repeatable on a
noisy machine where overhead.py's are not.

    .venv/bin/python benchmarks/inprocess.py               # 20 rounds of 2,000 requests, 32 connections
    .venv/bin/python benchmarks/inprocess.py --profile 30  # plus cProfile's top 30 (a slower last round)
    PYTHONPATH=/path/to/other/src .venv/bin/python benchmarks/inprocess.py   # another version

Instructions per request, which do not depend on what else the machine does (benchmarks/README.md):
run it under `valgrind --tool=callgrind` with --repeat 1 and two request counts, and divide the
difference of the totals by twice the difference of the counts (each run is a warm-up round and
one measured round).

Prints microseconds of CPU (process time) per request: the median of --repeat rounds, with their
quartiles (on a shared machine the rounds spread widely: compare medians of runs taken in turn).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from typing import Any

import uvloop

from modelyard.config import GatewayConfig
from modelyard.gateway.server import start_gateway
from modelyard.upstream import http1

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import CHAT_BODY, CHAT_COMPLETION

REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(CHAT_BODY), CHAT_BODY.encode())
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 23:00:00 GMT\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%s"
    % (len(CHAT_COMPLETION), CHAT_COMPLETION.encode())
)


class FakeTransport(asyncio.Transport):
    """Enough of a transport for the lean connection and the upstream client."""

    def __init__(self, on_write: Any) -> None:
        super().__init__()
        self._on_write = on_write
        self._closing = False

    def write(self, data: Any) -> None:
        self._on_write(bytes(data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


async def fake_connect(pool: Any, until: float | None = None) -> Any:
    """`_HostPool._connect` without a socket: the server answers each request on the next turn."""
    loop = asyncio.get_running_loop()
    conn = http1._Connection(pool)
    conn.connection_made(FakeTransport(lambda _data: loop.call_soon(conn.data_received, RESPONSE)))
    return conn


async def run(args: argparse.Namespace) -> list[float]:
    http1._HostPool._connect = fake_connect  # type: ignore[method-assign]
    config = GatewayConfig.model_validate(
        {
            "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
            "models": [
                {
                    "name": "bench",
                    "strategy": "round_robin",
                    "health_check": {"interval": "60s"},
                    "endpoints": [{"url": f"http://127.0.0.1:{9001 + i}"} for i in range(3)],
                }
            ],
        }
    )
    gateway = await start_gateway(config)
    server = gateway.server
    done = asyncio.Event()
    answered = 0
    target = 0

    def client() -> None:
        protocol: Any = server._accept()  # what the listener makes for an accepted socket

        def on_write(data: bytes) -> None:
            nonlocal answered
            if data.startswith(b"HTTP/1.1 200"):
                answered += 1
                if answered < target:  # the next request on this connection, as wrk sends it
                    loop.call_soon(protocol.data_received, REQUEST)
                elif answered == target:
                    done.set()
            else:
                raise SystemExit(f"unexpected answer: {data[:300]!r}")

        protocol.connection_made(FakeTransport(on_write))
        protocol.data_received(REQUEST)

    loop = asyncio.get_running_loop()
    times = []
    try:
        for round_ in range(args.repeat + 1):  # the first round warms up
            answered, target = 0, args.requests
            done.clear()
            profiler = cProfile.Profile() if args.profile and round_ == args.repeat else None
            started = time.process_time()
            if profiler:
                profiler.enable()
            for _ in range(args.connections):
                client()
            await done.wait()
            if profiler:
                profiler.disable()
                stats = pstats.Stats(profiler)
                if args.dump:
                    stats.dump_stats(args.dump)
                stats.sort_stats("tottime").print_stats(args.profile)
            elif round_:
                times.append((time.process_time() - started) / args.requests * 1e6)
    finally:
        await gateway.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N (a last round)")
    parser.add_argument("--dump", help="with --profile: write cProfile's stats to this file")
    args = parser.parse_args()
    times = uvloop.run(run(args))
    if not times:
        return
    quartiles = statistics.quantiles(times, n=4)
    print(
        f"{statistics.median(times):.1f} us CPU per request: median of {len(times)} rounds "
        f"(quartiles {quartiles[0]:.1f} - {quartiles[2]:.1f}, least {min(times):.1f})"
    )
    print("command: " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
