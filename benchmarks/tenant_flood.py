"""Tenant flood: one tenant sends 3x what the servers can take while another sends 20% of it. What
does the light tenant's latency become, and does the flooding one get the rest of the capacity?

The stack: `--workers` `modelyard sim-worker`s (`--slots` requests at a time each, about
`--service-ms` per request on average: 5 to 15 output tokens (`--tokens`), uniform; no prompt
cost, no batch slowdown), behind `modelyard serve --workers 1` with auth on and the model's
circuit breakers at the workers' size (`max_requests` = `--slots`, so a request waits in the
gateway's queue, not in a worker's; the queue holds `--max-pending`, `queue_timeout`
`--queue-timeout`). The keys file has tenants a and b at one
priority, and a third key of tenant a for B's traffic in the `fifo` phase.

Open-loop Poisson arrivals, non-streaming chat requests. Each repeat runs three phases:
  alone   tenant B alone at `--b-share` of the capacity (the capacity: workers x slots / service time)
  fair    tenant A floods at `--a-load` x the capacity, B as in `alone`, with its own tenant
  fifo    the same, B's requests sent with a key of tenant A: one tenant, so the queue is first come
          first served between them (what the queue did before priority and fairness)
A flood starts `--warmup` seconds before B's arrivals and stops with them; what is counted is what
was sent in B's window. Utilisation: the workers' `vllm:num_requests_running` over their slots,
sampled every 100 ms in the window. Medians over `--repeat` repeats.

Run by hand:  .venv/bin/python benchmarks/tenant_flood.py                  # 3 repeats, about 1.5 min
              .venv/bin/python benchmarks/tenant_flood.py --repeat 1 --seconds 6   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from common import Child, free_ports, nproc, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
EXE = ROOT / ".venv" / "bin" / "modelyard"
TOKENS = (5, 15)  # output tokens per request, uniform: service times vary as answers' lengths do
KEYS = {"a": "sk-bench-tenant-a-0001", "b": "sk-bench-tenant-b-0001", "b-as-a": "sk-bench-b-as-a-0001"}
PHASES = ("alone", "fair", "fifo")
MAX_OUTSTANDING = 4000  # requests a phase may have open at once (a bound on the open loop)


@dataclass
class Sample:
    tenant: str  # "a" or "b"
    sent: float  # seconds since the phase started
    ms: float
    status: int  # 0: no HTTP answer


@dataclass
class Phase:
    samples: list[Sample] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # sampled share of the workers' slots in use
    skipped: int = 0  # arrivals not sent: MAX_OUTSTANDING reached


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4, help="sim workers (default 4)")
    parser.add_argument("--slots", type=int, default=4, help="requests at a time per worker (default 4)")
    parser.add_argument("--service-ms", type=float, default=200.0, help="a request's time on a worker")
    parser.add_argument("--b-share", type=float, default=0.2, help="tenant B's rate, share of capacity")
    parser.add_argument("--a-load", type=float, default=3.0, help="tenant A's rate, times the capacity")
    parser.add_argument("--seconds", type=float, default=10.0, help="B's window per phase (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="flood before B's window (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of the three phases (default 3)")
    parser.add_argument("--max-pending", type=int, default=64, help="circuit_breakers.max_pending_requests")
    parser.add_argument("--queue-timeout", type=float, default=5.0, help="circuit_breakers.queue_timeout")
    parser.add_argument(
        "--tokens",
        default=",".join(map(str, TOKENS)),
        help="output tokens per request, MIN,MAX drawn uniformly (default 5,15; 10,10: all alike)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modelyard", default=str(EXE), help="the modelyard command (sim workers, gateway)")
    parser.add_argument(
        "--gateway-cmd", help="how to start the gateway (default: MODELYARD serve --workers 1)"
    )
    parser.add_argument("--json", type=Path, help="write every phase's summary here")
    args = parser.parse_args(argv)
    args.gateway_cmd = args.gateway_cmd or f"{args.modelyard} serve --workers 1"
    low, _, high = args.tokens.partition(",")
    args.tokens = (int(low), int(high or low))
    return args


# --- the stack ------------------------------------------------------------------------------------


def start_stack(args: argparse.Namespace, folder: Path) -> tuple[list[Child], list[str], Child, str]:
    *worker_ports, gateway_port = free_ports(args.workers + 1)
    workers = []
    for i, port in enumerate(worker_ports):
        argv = [args.modelyard, "sim-worker", "--port", str(port), "--model", "bench",
                "--max-concurrency", str(args.slots), "--prefill-ms-per-token", "0",
                "--decode-ms-per-token", f"{args.service_ms / statistics.fmean(args.tokens):g}"]  # fmt: skip
        workers.append(Child(f"w{i}", argv, folder / f"w{i}.log"))
    for worker, port in zip(workers, worker_ports, strict=True):
        wait_for_port(port, worker)
    worker_urls = [f"http://127.0.0.1:{p}" for p in worker_ports]
    keys = {
        "tenants": [{"name": "a", "models": ["*"]}, {"name": "b", "models": ["*"]}],
        "keys": [
            {"name": "a-app", "tenant": "a", "key": KEYS["a"]},
            {"name": "b-app", "tenant": "b", "key": KEYS["b"]},
            {"name": "b-app-as-a", "tenant": "a", "key": KEYS["b-as-a"]},
        ],
    }
    (folder / "keys.json").write_text(json.dumps(keys))  # (YAML is a superset of JSON)
    breakers = {
        "max_requests": args.slots,
        "max_pending_requests": args.max_pending,
        "queue_timeout": f"{args.queue_timeout:g}s",
    }
    config = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "auth": {"enabled": True, "keys_file": str(folder / "keys.json")},
        "models": [
            {
                "name": "bench",
                "endpoints": [{"name": f"w{i}", "url": url} for i, url in enumerate(worker_urls)],
                "health_check": {"interval": "60s"},
                "circuit_breakers": breakers,
            }
        ],
    }
    (folder / "gateway.yaml").write_text(json.dumps(config, indent=2))
    argv = [*shlex.split(args.gateway_cmd), "-c", str(folder / "gateway.yaml"), "--log-level", "warning"]
    gateway = Child("gateway", argv, folder / "gateway.log")
    wait_for_port(gateway_port, gateway)
    return workers, worker_urls, gateway, f"http://127.0.0.1:{gateway_port}"


def body(tokens: int = TOKENS[0]) -> dict[str, object]:
    return {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}


async def ready(url: str, gateway: Child) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            if not gateway.alive():
                raise RuntimeError(f"the gateway exited:\n{gateway.log_tail()}")
            try:
                headers = {"Authorization": f"Bearer {KEYS['b']}"}
                async with http.post(url + "/v1/chat/completions", json=body(), headers=headers) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway did not answer 200:\n{gateway.log_tail()}")


# --- the load -------------------------------------------------------------------------------------


async def arrivals(
    http: aiohttp.ClientSession, url: str, key: str, tenant: str, rate: float, start: float, end: float,
    t0: float, rng: random.Random, phase: Phase, tasks: set[asyncio.Task[None]], tokens: tuple[int, int],
) -> None:  # fmt: skip
    """Poisson arrivals at `rate` from `start` to `end` (perf_counter), each sent at once whatever
    the earlier ones are doing (open loop)."""
    headers = {"Authorization": f"Bearer {key}"}

    async def one(sent: float, tokens: int) -> None:
        status = 0
        try:
            async with http.post(
                url + "/v1/chat/completions", json=body(tokens), headers=headers
            ) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError):
            pass
        phase.samples.append(Sample(tenant, sent - t0, (time.perf_counter() - sent) * 1000, status))

    at = start
    while True:
        at += rng.expovariate(rate)
        if at >= end:
            return
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        if len(tasks) >= MAX_OUTSTANDING:
            phase.skipped += 1
            continue
        task = asyncio.create_task(one(time.perf_counter(), rng.randint(*tokens)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def sample_busy(http: aiohttp.ClientSession, workers: list[str], slots: int, start: float,
                      end: float, phase: Phase) -> None:  # fmt: skip
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    while time.perf_counter() < end:
        running = 0.0
        for url in workers:
            async with http.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        running += float(line.rsplit(" ", 1)[1])
        phase.busy.append(running / (slots * len(workers)))
        await asyncio.sleep(0.1)


async def run_phase(args: argparse.Namespace, name: str, url: str, workers: list[str], seed: int) -> Phase:
    capacity = args.workers * args.slots / (args.service_ms / 1000)
    phase = Phase()
    tasks: set[asyncio.Task[None]] = set()
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=args.queue_timeout + 30)
    flood = name != "alone"
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as a_http,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as b_http,
        aiohttp.ClientSession() as metrics_http,
    ):
        t0 = time.perf_counter()
        window = (t0 + (args.warmup if flood else 0.0), t0 + (args.warmup if flood else 0.0) + args.seconds)
        b_key = KEYS["b-as-a"] if name == "fifo" else KEYS["b"]
        loops = [
            arrivals(
                b_http, url, b_key, "b", args.b_share * capacity, *window, t0, rng, phase, tasks, args.tokens
            ),
            sample_busy(metrics_http, workers, args.slots, *window, phase),
        ]
        if flood:
            a_rate, a_rng = args.a_load * capacity, random.Random(seed + 1000)
            loops.append(
                arrivals(
                    a_http, url, KEYS["a"], "a", a_rate, t0, window[1], t0, a_rng, phase, tasks, args.tokens
                )
            )
        await asyncio.gather(*loops)
        while tasks:  # what is still queued or in flight (bounded by the queue timeout)
            await asyncio.gather(*list(tasks))
    start = window[0] - t0
    phase.samples = [s for s in phase.samples if s.sent >= start]
    return phase


# --- results --------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(args: argparse.Namespace, name: str, phase: Phase) -> dict[str, float]:
    out: dict[str, float] = {}
    for tenant in ("a", "b"):
        mine = [s for s in phase.samples if s.tenant == tenant]
        ok = [s.ms for s in mine if s.status == 200]
        out[f"{tenant}_sent"] = len(mine) / args.seconds
        out[f"{tenant}_ok"] = len(ok) / args.seconds
        out[f"{tenant}_429"] = sum(1 for s in mine if s.status == 429) / max(1, len(mine))
        out[f"{tenant}_other"] = sum(1 for s in mine if s.status not in (200, 429))
        out[f"{tenant}_p50"] = pct(ok, 0.5)
        out[f"{tenant}_p95"] = pct(ok, 0.95)
    out["busy"] = statistics.fmean(phase.busy) if phase.busy else float("nan")
    out["skipped"] = phase.skipped
    return out


def table(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> str:
    capacity = args.workers * args.slots / (args.service_ms / 1000)
    med = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()
    }
    alone_p95 = med["alone"]["b_p95"]
    lines = [
        f"capacity {capacity:g} req/s ({args.workers} workers x {args.slots} slots / "
        f"{args.service_ms:g} ms); "
        f"B at {args.b_share:g}x, A at {args.a_load:g}x; medians of {args.repeat} runs of {args.seconds:g} s",
        "",
        "| phase | B req/s | B ok/s | B 429 | B p50 ms | B p95 ms | B p95 / alone | A req/s | A ok/s (share "
        "of capacity) | A 429 | A p50 ms | workers busy |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, m in med.items():
        a_cols = "— | — | — | —"
        if name != "alone":
            a_ok = f"{m['a_ok']:.1f} ({m['a_ok'] / capacity:.0%})"
            a_cols = f"{m['a_sent']:.0f} | {a_ok} | {m['a_429']:.0%} | {m['a_p50']:.0f}"
        lines.append(
            f"| {name} | {m['b_sent']:.1f} | {m['b_ok']:.1f} | {m['b_429']:.0%} | {m['b_p50']:.0f} | "
            f"{m['b_p95']:.0f} | {m['b_p95'] / alone_p95:.2f}x | {a_cols} | {m['busy']:.0%} |"
        )
    alone_runs = [r["b_p95"] for r in results["alone"]]
    per_run = ", ".join(
        f"{name} " + "/".join(f"{r['b_p95'] / alone:.2f}" for r, alone in zip(runs, alone_runs, strict=True))
        for name, runs in results.items()
        if name != "alone"
    )
    lines += ["", f"B p95 / alone, per run: {per_run}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in PHASES}
    with tempfile.TemporaryDirectory(prefix="modelyard-tenant-flood-") as tmp:
        workers, worker_urls, gateway, url = start_stack(args, Path(tmp))
        try:
            asyncio.run(ready(url, gateway))
            for repeat in range(args.repeat):
                for name in PHASES:
                    print(f"run {repeat + 1}/{args.repeat}: {name} ...", file=sys.stderr, flush=True)
                    phase = asyncio.run(run_phase(args, name, url, worker_urls, args.seed + repeat))
                    results[name].append(summarize(args, name, phase))
                    rounded = {k: round(v, 3) for k, v in results[name][-1].items()}
                    print(f"  {json.dumps(rounded)}", file=sys.stderr)
        finally:
            for child in [gateway, *workers]:
                child.stop()
    print(table(args, results))
    print()
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"date: {datetime.now(UTC).isoformat(timespec='seconds')}; nproc: {nproc()}; "
          f"python {platform.python_version()}; gateway: {args.gateway_cmd}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
