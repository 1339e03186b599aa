"""Reliability: what clients see when a backend dies or hangs, when the gateway is told to stop,
and when clients misbehave.

Scenarios (each with fresh processes: three `modelyard sim-worker`s behind `modelyard serve` with
its default config, apart from the listen port):
  kill       SIGKILL worker w0 a third of the way through the load
  hang       SIGSTOP worker w0 a third of the way through (the kernel still accepts connections)
  drain      SIGTERM the gateway a third of the way through; the loops keep sending on their
             keep-alive connections until the gateway has gone
  slowloris  hold `--slow-connections` connections that send a request head one byte a second,
             while the loops send ordinary requests

The load: `--concurrency` loops of non-streaming chat requests (16 output tokens, about 32 ms on
a worker) over keep-alive connections, until `--requests` are sent or `--max-seconds` pass; every
request records its latency and status (0: no HTTP answer, with the client error's name).

Run by hand:  .venv/bin/python benchmarks/reliability.py                       # every scenario
              .venv/bin/python benchmarks/reliability.py --scenarios kill,hang \\
                  --gateway-cmd "/path/to/other/venv/bin/modelyard serve"      # another build
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from common import Child, free_ports, nproc, wait_for_chat, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
EXE = ROOT / ".venv" / "bin" / "modelyard"
SCENARIOS = ("kill", "hang", "drain", "slowloris")
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


@dataclass
class Sample:
    at: float  # seconds since the load started
    ms: float
    status: int  # 0: no HTTP answer
    error: str = ""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    event_at: float = float("nan")  # when the scenario's event happened (run seconds)
    notes: dict[str, object] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ",".join(SCENARIOS)
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per scenario (default 3000)")
    parser.add_argument("--concurrency", type=int, default=16, help="client loops (default 16)")
    parser.add_argument("--max-seconds", type=float, default=90.0, help="bound on each scenario's load")
    parser.add_argument("--client-timeout", type=float, default=30.0, help="a client gives up after this")
    parser.add_argument("--slow-connections", type=int, default=500, help="slowloris connections")
    parser.add_argument(
        "--slow-wait",
        type=float,
        default=15.0,
        help="slowloris: count open connections this long after opening",
    )
    parser.add_argument("--gateway-cmd", default=f"{EXE} serve --workers 1", help="how to start the gateway")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    return args


# --- the load -------------------------------------------------------------------------------------


async def load(args: argparse.Namespace, url: str, event, run: Run, *, until_gone: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Loops of requests; `event()` (sync) runs once a third of `--requests` have been sent. With
    `until_gone`, the loops go on past `--requests` until the gateway has exited."""
    sent = 0
    limit = 10**9 if until_gone else args.requests
    start = time.perf_counter()
    deadline = start + args.max_seconds
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def loop() -> None:
            nonlocal sent
            while sent < limit and time.perf_counter() < deadline:
                index = sent
                sent += 1
                if index == args.requests // 3:
                    event()
                    run.event_at = time.perf_counter() - start
                t0 = time.perf_counter()
                status, error = 0, ""
                try:
                    async with http.post(url + "/v1/chat/completions", json=BODY) as response:
                        await response.read()
                        status = response.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    error = type(exc).__name__
                run.samples.append(Sample(t0 - start, (time.perf_counter() - t0) * 1000, status, error))
                if error == "ClientConnectorError" and run.notes.get("gateway_gone"):
                    return  # drain: the gateway has exited; a load balancer would have moved on

        await asyncio.gather(*(loop() for _ in range(args.concurrency)))


# --- scenarios ------------------------------------------------------------------------------------


def start_stack(args: argparse.Namespace, folder: Path) -> tuple[list[Child], Child, str]:
    *worker_ports, gateway_port = free_ports(4)
    workers = []
    for i, port in enumerate(worker_ports):
        argv = [str(EXE), "sim-worker", "--port", str(port), "--model", "bench", "--max-concurrency", "8",
                "--decode-ms-per-token", "2", "--prefill-ms-per-token", "0.01"]  # fmt: skip
        workers.append(Child(f"w{i}", argv, folder / f"w{i}.log"))
    for worker, port in zip(workers, worker_ports, strict=True):
        wait_for_port(port, worker)
    endpoints = [{"name": f"w{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(worker_ports)]
    config = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "models": [{"name": "bench", "endpoints": endpoints}],
    }
    (folder / "gateway.yaml").write_text(json.dumps(config, indent=2))
    argv = [*shlex.split(args.gateway_cmd), "-c", str(folder / "gateway.yaml"), "--log-level", "warning"]
    gateway = Child("gateway", argv, folder / "gateway.log")
    wait_for_port(gateway_port, gateway)
    url = f"http://127.0.0.1:{gateway_port}"
    status, body = wait_for_chat(url + "/v1/chat/completions", gateway)
    if status != 200:
        raise RuntimeError(f"the gateway answered {status}: {body[:300]!r}\n{gateway.log_tail()}")
    return workers, gateway, url


def run_scenario(args: argparse.Namespace, scenario: str, tmp: Path) -> dict[str, object]:
    folder = tmp / scenario
    folder.mkdir()
    workers, gateway, url = start_stack(args, folder)
    run = Run()
    try:
        if scenario == "kill":
            asyncio.run(load(args, url, lambda: os.kill(workers[0].proc.pid, signal.SIGKILL), run))
        elif scenario == "hang":
            asyncio.run(load(args, url, lambda: os.kill(workers[0].proc.pid, signal.SIGSTOP), run))
            os.kill(workers[0].proc.pid, signal.SIGCONT)
        elif scenario == "drain":
            asyncio.run(drain(args, url, gateway, run))
        else:
            asyncio.run(slowloris(args, url, run))
    finally:
        for child in [gateway, *workers]:
            child.stop()
    return summarize(scenario, run)


async def drain(args: argparse.Namespace, url: str, gateway: Child, run: Run) -> None:
    """SIGTERM, then watch /readyz (on a fresh connection each time) until the process exits."""
    signalled = asyncio.Event()

    def terminate() -> None:
        gateway.proc.send_signal(signal.SIGTERM)
        run.notes["sigterm_wall"] = time.monotonic()
        signalled.set()

    async def watch() -> None:
        await signalled.wait()
        readiness: Counter[str] = Counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            while gateway.alive():
                try:
                    async with http.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=1)) as response:
                        readiness[str(response.status)] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    readiness[type(exc).__name__] += 1
                await asyncio.sleep(0.1)
        run.notes["gateway_gone"] = True
        run.notes["exit_after_s"] = round(time.monotonic() - float(run.notes["sigterm_wall"]), 2)  # type: ignore[arg-type]
        run.notes["exit_code"] = gateway.proc.returncode
        run.notes["readyz_during_drain"] = dict(readiness)

    await asyncio.gather(load(args, url, terminate, run, until_gone=True), watch())


async def slowloris(args: argparse.Namespace, url: str, run: Run) -> None:
    host, port = url.removeprefix("http://").split(":")
    writers: list[asyncio.StreamWriter] = []
    opened = 0

    async def trickle() -> None:
        nonlocal opened
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return
        opened += 1
        writers.append(writer)
        try:
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 120:
                writer.write(bytes([byte]))
                await writer.drain()
                if reader.at_eof():
                    return
                await asyncio.sleep(1.0)
        except (ConnectionError, OSError):
            return

    started = time.perf_counter()
    tasks = [asyncio.create_task(trickle()) for _ in range(args.slow_connections)]
    await asyncio.sleep(1.0)
    run.event_at = 0.0
    await load(args, url, lambda: None, run)
    # Past the gateway's header timeout (10 s by default): count what is still open.
    await asyncio.sleep(max(0.0, started + args.slow_wait - time.perf_counter()))
    open_at_end = sum(1 for w in writers if not w.is_closing() and not w.transport.is_closing())
    # A closed connection shows on the next write; probe them all once.
    for writer in writers:
        try:
            writer.write(b"a")
            await writer.drain()
        except (ConnectionError, OSError):
            pass
    await asyncio.sleep(0.2)
    still_open = sum(1 for w in writers if not w.transport.is_closing())
    run.notes.update(
        slow_connections=args.slow_connections,
        opened=opened,
        open_before_probe=open_at_end,
        still_open_after_s=(round(time.perf_counter() - started, 1), still_open),
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for writer in writers:
        writer.close()


# --- results --------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(scenario: str, run: Run) -> dict[str, object]:
    after = [s for s in run.samples if s.at >= run.event_at]
    failed = [s for s in run.samples if s.status != 200]
    refused_after_exit = (
        [s for s in failed if s.error == "ClientConnectorError"] if scenario == "drain" else []
    )
    return {
        "scenario": scenario,
        "requests": len(run.samples),
        "failed": len(failed) - len(refused_after_exit),
        "failures": dict(Counter(s.error or str(s.status) for s in failed if s not in refused_after_exit)),
        "refused_after_exit": len(refused_after_exit),
        "event_at_s": round(run.event_at, 2),
        "p50_ms": round(pct([s.ms for s in run.samples if s.status == 200], 0.5), 1),
        "p99_after_ms": round(pct([s.ms for s in after if s.status == 200], 0.99), 1),
        "max_after_ms": round(max((s.ms for s in after), default=float("nan")), 1),
        "slower_than_1s": sum(1 for s in after if s.ms > 1000),
        **run.notes,
    }


TABLE_COLUMNS = frozenset(
    ("scenario", "requests", "failed", "failures", "p50_ms", "p99_after_ms", "max_after_ms", "slower_than_1s")
)


def table(results: list[dict[str, object]]) -> str:
    lines = [
        "| scenario | requests | failed | failures | p50 ms | p99 after ms | max after ms | > 1 s |",
        "|:--|--:|--:|:--|--:|--:|--:|--:|",
    ]
    for r in results:
        failures = ", ".join(f"{k} {v}" for k, v in r["failures"].items()) or "—"  # type: ignore[attr-defined]
        lines.append(
            f"| {r['scenario']} | {r['requests']} | {r['failed']} | {failures} | {r['p50_ms']} | "
            f"{r['p99_after_ms']} | {r['max_after_ms']} | {r['slower_than_1s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="modelyard-reliability-") as tmp:
        for scenario in args.scenarios:
            print(f"running {scenario} ...", file=sys.stderr, flush=True)
            results.append(run_scenario(args, scenario, Path(tmp)))
    print(table(results))
    print()
    for r in results:
        extra = {k: v for k, v in r.items() if k not in TABLE_COLUMNS}
        print(f"{r['scenario']}: {extra}")
    print()
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"date: {datetime.now(UTC).isoformat(timespec='seconds')}; nproc: {nproc()}; "
          f"python {platform.python_version()}; gateway: {args.gateway_cmd}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
