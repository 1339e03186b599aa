"""Governance: how each strategy copes when one of three workers turns slow mid-run.

Per scenario: three fresh `modelyard sim-worker`s (2 ms per output token, 8 slots each) behind a
fresh `modelyard serve` with the scenario's strategy. An aiohttp client here sends non-streaming
chat requests (`max_tokens` 16: about 32 ms on a normal worker) from `--concurrency` loops until
`--requests` are sent or `--max-seconds` pass. When half the requests have been sent, worker w0
is slowed 5x (`PUT /sim/config {"slowdown": 5}`: about 160 ms a request). Each request records
its latency, status, `X-Modelyard-Backend` and whether it was sent after the slowdown took effect.

Scenarios are `STRATEGY` or `STRATEGY+ejection`. Without `+ejection` outlier detection is off;
with it, latency ejection is tuned for a short run (see EJECTION). resource_aware scrapes every
0.5 s; active health checks run every 60 s (so in effect only at start-up).

Run by hand:  .venv/bin/python benchmarks/governance.py            # 6 scenarios, about 40 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from common import Child, free_ports, nproc, wait_for_chat, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
EXE = ROOT / ".venv" / "bin" / "modelyard"
WORKERS = ("w0", "w1", "w2")
SLOWED = "w0"
SLOWDOWN = 5.0
MAX_TOKENS = 16
DEFAULT_SCENARIOS = (
    "round_robin,least_pending,resource_aware,"
    "round_robin+ejection,least_pending+ejection,resource_aware+ejection"
)
# Short window and few samples so a 5x slower worker is judged within a second or two of a short
# run; 34% lets one of the three be out at a time.
EJECTION = {
    "latency_factor": 2.5,
    "latency_min_requests": 10,
    "latency_window": "2s",
    "base_ejection_time": "5s",
    "max_ejection_percent": 34,
}
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}


@dataclass(slots=True)
class Sample:
    sent_at: float  # seconds since the run started
    latency_ms: float
    status: int  # 0: no answer (connection error, timeout)
    backend: str
    after_slowdown: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1200, help="requests per scenario (default 1200)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="time bound per scenario's load (default 60)"
    )
    parser.add_argument(
        "--scenarios",
        default=DEFAULT_SCENARIOS,
        help=f"comma list of STRATEGY[+ejection] (default {DEFAULT_SCENARIOS})",
    )
    parser.add_argument("--json", metavar="PATH", help="write every scenario's samples and summary here")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    return args


def gateway_config(port: int, worker_ports: list[int], scenario: str) -> dict:
    strategy, _, extra = scenario.partition("+")
    if extra not in ("", "ejection"):
        raise SystemExit(f"unknown scenario {scenario!r}: expected STRATEGY or STRATEGY+ejection")
    outlier = EJECTION if extra else {"enabled": False}
    endpoints = [
        {"url": f"http://127.0.0.1:{p}", "name": name} for name, p in zip(WORKERS, worker_ports, strict=True)
    ]
    model = {
        "name": "bench",
        "strategy": strategy,
        "endpoints": endpoints,
        "health_check": {"interval": "60s"},
        "outlier_detection": outlier,
        "resource_aware": {"scrape_interval": "0.5s"},
    }
    return {"listen": {"host": "127.0.0.1", "port": port}, "models": [model]}


async def load(
    gateway: str, slowed_worker: str, requests: int, concurrency: int, max_seconds: float
) -> tuple[list[Sample], float, float, float]:
    """The samples, when the slowdown took effect (run seconds and wall clock) and when the load
    ended (run seconds)."""
    samples: list[Sample] = []
    sent = 0
    slowdown_at: float | None = None
    slowdown_wall = float("nan")
    start = time.perf_counter()
    deadline = start + max_seconds
    timeout = aiohttp.ClientTimeout(total=min(30.0, max_seconds))
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def slow_down() -> None:
            nonlocal slowdown_at, slowdown_wall
            async with http.put(slowed_worker + "/sim/config", json={"slowdown": SLOWDOWN}) as response:
                response.raise_for_status()
            slowdown_at = time.perf_counter() - start
            slowdown_wall = time.time()

        async def loop() -> None:
            nonlocal sent
            while sent < requests and time.perf_counter() < deadline:
                index = sent
                sent += 1
                if index == requests // 2:
                    await slow_down()
                after = slowdown_at is not None
                t0 = time.perf_counter()
                status, backend = 0, ""
                try:
                    async with http.post(gateway + "/v1/chat/completions", json=BODY) as response:
                        await response.read()
                        status, backend = response.status, response.headers.get("X-Modelyard-Backend", "")
                except (aiohttp.ClientError, TimeoutError):
                    pass
                t1 = time.perf_counter()
                samples.append(Sample(t0 - start, (t1 - t0) * 1000, status, backend, after))

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    at = slowdown_at if slowdown_at is not None else float("nan")
    return samples, at, slowdown_wall, time.perf_counter() - start


def ejections_from_log(log: str, slowdown_wall: float) -> tuple[int, float]:
    """How many ejections the gateway logged, and how long after the slowdown the first came (the
    log's timestamps are local time to the millisecond)."""
    times = []
    for line in log.splitlines():
        if "ejecting endpoint" in line:
            try:
                times.append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
            except ValueError:
                times.append(float("nan"))
    return len(times), (times[0] - slowdown_wall) if times else float("nan")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(
    scenario: str, samples: list[Sample], slowdown_at: float, elapsed: float, ejections: tuple[int, float]
) -> dict:
    after = [s for s in samples if s.after_slowdown]
    ok_all = [s.latency_ms for s in samples if s.status == 200]
    ok_after = [s.latency_ms for s in after if s.status == 200]
    served_after = Counter(s.backend for s in after if s.status == 200)
    return {
        "scenario": scenario,
        "requests": len(samples),
        "errors": sum(1 for s in samples if s.status != 200),
        "seconds": elapsed,
        "slowdown_at_s": slowdown_at,
        "p50": pct(ok_all, 0.50),
        "p95": pct(ok_all, 0.95),
        "p99": pct(ok_all, 0.99),
        "after_requests": len(after),
        "after_errors": sum(1 for s in after if s.status != 200),
        "after_p50": pct(ok_after, 0.50),
        "after_p95": pct(ok_after, 0.95),
        "after_p99": pct(ok_after, 0.99),
        "after_served": {name: served_after.get(name, 0) for name in WORKERS},
        "after_share_slowed": served_after.get(SLOWED, 0) / len(ok_after) if ok_after else float("nan"),
        "ejections": ejections[0],
        "first_ejection_after_s": ejections[1],
    }


def run_scenario(args: argparse.Namespace, scenario: str, tmp: Path) -> tuple[dict, list[Sample]]:
    folder = tmp / scenario.replace("+", "_")
    folder.mkdir()
    *worker_ports, gateway_port = free_ports(len(WORKERS) + 1)
    children: list[Child] = []
    try:
        for name, port in zip(WORKERS, worker_ports, strict=True):
            argv = [str(EXE), "sim-worker", "--port", str(port), "--model", "bench", "--max-concurrency", "8",
                    "--decode-ms-per-token", "2", "--prefill-ms-per-token", "0.01"]  # fmt: skip
            children.append(Child(name, argv, folder / f"{name}.log"))
        for child, port in zip(children, worker_ports, strict=True):
            wait_for_port(port, child)
        config = folder / "gateway.yaml"
        config.write_text(json.dumps(gateway_config(gateway_port, worker_ports, scenario), indent=2))
        gateway = Child(
            "gateway",
            [str(EXE), "serve", "-c", str(config), "--workers", "1", "--log-level", "warning"],
            folder / "gw.log",
        )
        children.append(gateway)
        wait_for_port(gateway_port, gateway)
        url = f"http://127.0.0.1:{gateway_port}"
        status, body = wait_for_chat(url + "/v1/chat/completions", gateway)
        if status != 200:
            raise RuntimeError(f"{scenario}: gateway answered {status}: {body[:300]!r}\n{gateway.log_tail()}")
        time.sleep(1.0)  # resource_aware: let a scrape of every worker land (every 0.5 s)
        slowed = f"http://127.0.0.1:{worker_ports[0]}"
        samples, slowdown_at, slowdown_wall, elapsed = asyncio.run(
            load(url, slowed, args.requests, args.concurrency, args.max_seconds)
        )
        ejections = ejections_from_log(gateway.log_tail(100_000), slowdown_wall)
        if not gateway.alive():
            raise RuntimeError(f"{scenario}: the gateway exited during the run:\n{gateway.log_tail()}")
    finally:
        for child in reversed(children):
            child.stop()
    return summarize(scenario, samples, slowdown_at, elapsed, ejections), samples


def table(results: list[dict]) -> str:
    def ms(value: float) -> str:
        return "-" if value != value else f"{value:.0f}"

    lines = [
        "| scenario | requests | errors | p50 ms | p95 ms | p99 ms | after: requests | errors | p50 ms "
        "| p95 ms | p99 ms | served w0/w1/w2 | share to slowed w0 | ejections (first after s) | seconds |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|:--|--:|:--|--:|",
    ]
    for r in results:
        served = "/".join(str(r["after_served"][name]) for name in WORKERS)
        share = r["after_share_slowed"]
        first = r["first_ejection_after_s"]
        ejected = f"{r['ejections']}" + ("" if first != first else f" ({first:.1f})")
        lines.append(
            f"| {r['scenario']} | {r['requests']} | {r['errors']} | {ms(r['p50'])} | {ms(r['p95'])} "
            f"| {ms(r['p99'])} | {r['after_requests']} | {r['after_errors']} | {ms(r['after_p50'])} "
            f"| {ms(r['after_p95'])} | {ms(r['after_p99'])} | {served} "
            f"| {'-' if share != share else f'{share:.1%}'} | {ejected} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-governance-bench-"))
    results: list[dict] = []
    raw: dict[str, list[dict]] = {}
    for scenario in args.scenarios:
        print(f"running {scenario} ...", file=sys.stderr, flush=True)
        try:
            summary, samples = run_scenario(args, scenario, tmp)
        except Exception:
            print(f"logs kept in {tmp}", file=sys.stderr)
            raise
        results.append(summary)
        raw[scenario] = [asdict(s) for s in samples]

    print(table(results))
    print()
    print("```")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    now = datetime.now(UTC)
    print(f"date: {now:%Y-%m-%d %H:%M UTC}, nproc {nproc()}, python {platform.python_version()}")
    print(
        f"load: {args.concurrency} concurrent loops, {args.requests} requests or {args.max_seconds:g}s per "
        f"scenario, max_tokens {MAX_TOKENS}; w0 slowed {SLOWDOWN:g}x after request {args.requests // 2}"
    )
    print(f"ejection settings: {json.dumps(EJECTION)}")
    print("```")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "samples": raw}, indent=1))
        print(f"raw results written to {args.json}")
    if not args.keep_tmp:
        for path in sorted(tmp.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        tmp.rmdir()
    else:
        print(f"configs and logs kept in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
