"""Streaming through the gateway: does it add buffering delay to server-sent events?

One `modelyard sim-worker` streams `--tokens` chunks, one every `--decode-ms` milliseconds. The same
streaming chat request is sent, one at a time, directly to the worker and through
`modelyard serve` (one endpoint), alternating, `--requests` times each. For each target it reports
the median and p95 of: time to first chunk, gap between chunks, and whole-stream time. A gateway
that buffered would show a first chunk near the whole-stream time, or bursty gaps.

Run by hand:  .venv/bin/python benchmarks/streaming.py
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from common import Child, free_ports, nproc, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
EXE = ROOT / ".venv" / "bin" / "modelyard"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=50, help="streams per target (default 50)")
    parser.add_argument("--tokens", type=int, default=32, help="chunks per stream (default 32)")
    parser.add_argument("--decode-ms", type=float, default=10.0, help="ms between chunks (default 10)")
    return parser.parse_args(argv)


async def one_stream(http: aiohttp.ClientSession, url: str, tokens: int) -> tuple[float, list[float], float]:
    body = {
        "model": "bench",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - started, gaps, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    results = {name: {"ttft": [], "gap": [], "total": []} for name in urls}
    async with aiohttp.ClientSession() as http:
        for url in urls.values():  # warm-up: pools, caches
            await one_stream(http, url, args.tokens)
        for _ in range(args.requests):
            for name, url in urls.items():
                ttft, gaps, total = await one_stream(http, url, args.tokens)
                results[name]["ttft"].append(ttft)
                results[name]["gap"].extend(gaps)
                results[name]["total"].append(total)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-stream-bench-"))
    worker_port, gateway_port = free_ports(2)
    worker = Child(
        "sim-worker",
        [str(EXE), "sim-worker", "--port", str(worker_port), "--model", "bench",
         "--decode-ms-per-token", str(args.decode_ms), "--prefill-ms-per-token", "0"],
        tmp / "worker.log",
    )  # fmt: skip
    wait_for_port(worker_port, worker)
    config = tmp / "gateway.yaml"
    config.write_text(
        f"listen: {{port: {gateway_port}}}\nmodels:\n  - name: bench\n    health_check: {{interval: 60s}}\n"
        f"    endpoints: [{{url: 'http://127.0.0.1:{worker_port}'}}]\n"
    )
    gateway = Child(
        "gateway",
        [str(EXE), "serve", "-c", str(config), "--workers", "1", "--log-level", "warning"],
        tmp / "gw.log",
    )
    try:
        wait_for_port(gateway_port, gateway)
        urls = {"direct": f"http://127.0.0.1:{worker_port}", "modelyard": f"http://127.0.0.1:{gateway_port}"}
        results = asyncio.run(measure(args, urls))
    finally:
        gateway.stop()
        worker.stop()

    print("| target | first chunk p50 ms | p95 | chunk gap p50 ms | p95 | stream p50 ms | p95 | streams |")
    print("|:--|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in results.items():
        ms = [statistics.median(r["ttft"]), pct(r["ttft"], 0.95), statistics.median(r["gap"]),
              pct(r["gap"], 0.95), statistics.median(r["total"]), pct(r["total"], 0.95)]  # fmt: skip
        print(f"| {name} | " + " | ".join(f"{v * 1000:.2f}" for v in ms) + f" | {len(r['total'])} |")
    added = statistics.median(results["modelyard"]["ttft"]) - statistics.median(results["direct"]["ttft"])
    print(f"\nadded time to first chunk (p50): {added * 1000:+.2f} ms")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M UTC}, nproc {nproc()}, python {platform.python_version()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
