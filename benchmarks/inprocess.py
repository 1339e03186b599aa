"""The gateway's own CPU per proxied request, without sockets: what its Python costs.

Runs a real gateway (`start_gateway`, the config shape of overhead.py: one model, round robin over
3 endpoints) in this process and drives its lean HTTP/1.1 connections directly: each client
connection is an `H1Connection` given a fake transport, and the upstream pool's connections get a
fake transport too, which answers every request with overhead.py's small chat.completion on the
next turn of the loop. So every line of the request path runs (parse, route, pick, the attempt
loop, the upstream client, the relay, metrics, the routing log), but no system call: the numbers
are the gateway's user-space work alone.

    .venv/bin/python benchmarks/inprocess.py               # 20 rounds of 2,000 requests (about 15 s)
    .venv/bin/python benchmarks/inprocess.py --profile 30  # and one more round under cProfile
    .venv/bin/python benchmarks/inprocess.py --repeat 0 --opcodes 40  # bytecodes per request, by function
    .venv/bin/python benchmarks/inprocess.py --workers 2   # the path of `--workers 2` (see below)
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/inprocess.py   # another version (a worktree)

Prints the median CPU time (user + system of this process) per request over the measured rounds,
with their quartiles. On a shared machine rounds spread widely (±25% on the 2-core VM here):
compare medians of runs taken in turn, or count instructions, which do not move with the
machine's load: under `valgrind --tool=callgrind`, with `--repeat 1` and two values of --requests
(benchmarks/README.md has the commands). `--opcodes` counts the bytecodes each Python function runs
per request, in one more round traced with sys.settrace. It repeats to within a few bytecodes
(outlier detection also decides on a one-second clock) and says where the interpreter's work is; the
harness's own functions are in it too (a few percent), and the dataclasses' generated __init__
methods are counted together as `<string>:2 __create_fn__.<locals>.__init__`. It also splits the
bytecodes by where the request is: from the client's bytes to the request written upstream, while
the backend works, from the backend's answer to the answer written, and after that. At one
connection only the first and third are the latency the client sees; the rest overlaps the backend's
and the client's time. Bytecodes say where the work is; instructions say whether a change saves any
(a C call may cost more than the bytecodes it replaces). The garbage collector is set up as
`modelyard serve` sets it up once it serves (`settle_garbage_collector` in serving/process.py).

`--workers N` runs N gateways in this process as the N workers of one `modelyard serve --workers N`:
their shared files in a temporary folder, prometheus-client in multiprocess mode, in-flight counts
in shared memory, and each worker's routing log shared with the others. The client connections are
spread over them. It measures what a worker's request costs beyond a lone gateway's, including its
part of the others' work (adopting their routing-log records). Both workers write the same metrics
files here (prometheus-client names them by process id, and there is one process), so their values
mean nothing; the cost of writing them is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvloop

import modelyard
from common import CHAT_BODY, CHAT_COMPLETION
from modelyard.config import GatewayConfig
from modelyard.upstream import http1

# (modelyard.gateway is imported in run(): with --workers, prometheus-client must first see
# PROMETHEUS_MULTIPROC_DIR, which it reads once, when imported)

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


# Where a request is, for --opcodes: what runs between the client's bytes and the request sent
# upstream, and between the server's answer and the answer written, is the latency the client sees
# at one connection; what runs while the server works or after the answer is written overlaps them.
PHASES = ("to the upstream write", "while the server works", "to the answer's write", "after the answer")
phase = 0


def _enter(which: int) -> None:
    global phase
    phase = which


async def fake_connect(pool: Any, until: float | None = None) -> Any:
    """`_HostPool._connect` without a socket: the server answers each request on the next turn."""
    loop = asyncio.get_running_loop()
    conn = http1._Connection(pool)

    def answer() -> None:
        _enter(2)
        conn.data_received(RESPONSE)

    def sent(_data: bytes) -> None:
        _enter(1)
        loop.call_soon(answer)

    conn.connection_made(FakeTransport(sent))
    return conn


class Round:
    """`requests` requests over `connections` client connections, each sending its next request
    once its last is answered (as wrk does); done when all are answered, and no more are sent."""

    def __init__(self, servers: list[Any], requests: int, connections: int) -> None:
        self._servers = servers
        self._loop = asyncio.get_running_loop()
        self.requests = requests
        self._connections = connections
        self._sent = self._answered = 0
        self._clients: list[Any] = []
        self.done = asyncio.Event()

    def start(self) -> None:
        for index in range(min(self._connections, self.requests)):
            # What the listener makes for an accepted socket; the workers take turns.
            server = self._servers[index % len(self._servers)]
            protocol: Any = server._accept()
            protocol.connection_made(FakeTransport(lambda data, p=protocol: self._answer(p, data)))
            self._clients.append(protocol)
            self._send(protocol)

    def _send(self, protocol: Any) -> None:
        self._sent += 1
        _enter(0)
        protocol.data_received(REQUEST)

    def _answer(self, protocol: Any, data: bytes) -> None:
        _enter(3)
        if not data.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"unexpected answer: {data[:300]!r}")
        self._answered += 1
        if self._sent < self.requests:
            self._loop.call_soon(self._send, protocol)
        elif self._answered == self.requests:
            self.done.set()

    def close(self) -> None:
        for protocol in self._clients:
            protocol.connection_lost(None)


def bench_config(workers: int, strategy: str = "round_robin") -> GatewayConfig:
    """overhead.py's config: one model, round robin (or `strategy`) over 3 endpoints."""
    return GatewayConfig.model_validate(
        {
            "listen": {"host": "127.0.0.1", "port": 0, "workers": workers},
            "models": [
                {
                    "name": "bench",
                    "strategy": strategy,
                    "health_check": {"interval": "60s"},
                    "endpoints": [{"url": f"http://127.0.0.1:{9001 + i}"} for i in range(3)],
                }
            ],
        }
    )


async def run(args: argparse.Namespace, run_dir: Path | None) -> list[float]:
    from modelyard.gateway.server import start_gateway
    from modelyard.serving.process import settle_garbage_collector

    setattr(http1._HostPool, "_connect", fake_connect)  # noqa: B010 (a method replaced on purpose)
    config = bench_config(args.workers, args.strategy)
    gateways = []
    if run_dir is None:
        gateways.append(await start_gateway(config))
    else:
        from modelyard.gateway.siblings import Siblings
        from modelyard.gateway.workers import worker_share

        for index in range(args.workers):  # the workers' share of the config, as each gets it
            siblings = Siblings(config, index, args.workers, run_dir)
            gateways.append(await start_gateway(worker_share(config, args.workers), siblings=siblings))
    servers = [gateway.server for gateway in gateways]
    settle_garbage_collector()  # as `modelyard serve` does once it serves
    times = []
    try:
        # A warm-up round, the measured rounds, then one under cProfile when asked.
        for round_ in range(1 + args.repeat + (1 if args.profile else 0)):
            one = Round(servers, args.requests, args.connections)
            profiler = cProfile.Profile() if round_ > args.repeat else None
            started = time.process_time()
            if profiler:
                profiler.enable()
            one.start()
            await one.done.wait()
            if profiler:
                profiler.disable()
            elapsed = time.process_time() - started
            one.close()
            if profiler:
                stats = pstats.Stats(profiler)
                if args.dump:
                    stats.dump_stats(args.dump)
                stats.sort_stats("tottime").print_stats(args.profile)
            elif round_:
                times.append(elapsed / args.requests * 1e6)
        if args.opcodes:
            await count_opcodes(servers, args)
    finally:
        for gateway in gateways:
            await gateway.stop()
    return times


async def count_opcodes(servers: list[Any], args: argparse.Namespace) -> None:
    """One more round with every bytecode counted, by the function that ran it."""
    counts: collections.Counter[tuple[str, int, str]] = collections.Counter()
    by_phase = [0] * len(PHASES)

    def opcode(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            counts[code.co_filename, code.co_firstlineno, code.co_qualname] += 1
            by_phase[phase] += 1
        return opcode

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return opcode

    one = Round(servers, args.requests, args.connections)
    sys.settrace(call)
    try:
        one.start()
        await one.done.wait()
    finally:
        sys.settrace(None)
    one.close()
    per = args.requests
    print(f"{sum(counts.values()) / per:.0f} bytecodes per request, by where the request is:")
    for name, count in zip(PHASES, by_phase, strict=True):
        print(f"{count / per:8.1f}  {name}")
    print(f"the top {args.opcodes} functions:")
    for (path, line, name), count in counts.most_common(args.opcodes):
        where = path.split("/src/")[-1].split("site-packages/")[-1]
        print(f"{count / per:8.1f}  {where}:{line} {name}")


def make_run_dir(run_dir: Path, workers: int) -> None:
    """The files `modelyard serve --workers N` shares between its workers (gateway/workers.py)."""
    if "prometheus_client" in sys.modules:
        raise SystemExit("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / "metrics")

    from modelyard.gateway.siblings import METRICS_DIR
    from modelyard.gateway.workers import create_run_files

    if METRICS_DIR != "metrics":
        raise SystemExit(f"gateway/siblings.py names the metrics folder {METRICS_DIR!r} now: update this")
    create_run_files(run_dir, bench_config(workers), workers).close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per round (default 2000)")
    parser.add_argument("--connections", type=int, default=32, help="client connections (default 32)")
    parser.add_argument(
        "--repeat", type=int, default=20, help="measured rounds, after a warm-up one (default 20)"
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="then one more round under cProfile: its top N"
    )
    parser.add_argument("--dump", help="with --profile: also write cProfile's stats to this file")
    parser.add_argument(
        "--opcodes",
        type=int,
        default=0,
        help="then one more round with its bytecodes counted (sys.settrace): the top N functions",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run the gateway as this many workers of one `serve --workers N` (default 1: alone)",
    )
    parser.add_argument(
        "--strategy", default="round_robin", help="the model's strategy (default round_robin, as overhead.py)"
    )
    args = parser.parse_args()
    if args.dump and not args.profile:
        parser.error("--dump needs --profile")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    run_dir = Path(tempfile.mkdtemp(prefix="inprocess-")) if args.workers > 1 else None
    try:
        if run_dir is not None:
            make_run_dir(run_dir, args.workers)
        times = uvloop.run(run(args, run_dir))
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"modelyard from {modelyard.__file__}")
    if len(times) >= 2:
        low, _, high = statistics.quantiles(times, n=4)
        print(
            f"{statistics.median(times):.1f} us CPU per request: median of {len(times)} rounds "
            f"(quartiles {low:.1f} - {high:.1f}, least {min(times):.1f})"
        )
    elif times:
        print(f"{times[0]:.1f} us CPU per request (one round)")
    print("command: " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
