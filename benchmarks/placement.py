"""Placement speed: 10,000 models over 100 replicas, in the planner alone and through the scheduler.

  planner    `modelyard.placement.plan` called once per model, in order, each decision seeing the
             reservations of the ones before it (as the scheduler applies them). Times the decision
             alone and the decision plus building its snapshot (the ServerViews).
  scheduler  a real `modelyard scheduler` (in this process, SQLite in a temp file) with one
             simulated agent per replica (gRPC clients in this process that answer every LOAD
             with LOADED at once): time from the first PUT to every model Available, and the
             per-model PUT latency.

  dynamics   the cost of a lazy reload and the scale-up reaction time (placement_dynamics.py).

Run by hand, never from the test suite:
  .venv/bin/python benchmarks/placement.py [--models 10000] [--servers 10] [--replicas-per-server 10]
  .venv/bin/python benchmarks/placement.py --dynamics-only [--load-delays 0.05 0.2] [--scale-runs 3]
See benchmarks/README.md for the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import datetime
import io
import os
import platform
import pstats
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import orjson
from rich.console import Console
from rich.table import Table

from modelyard.placement import (
    ModelSpec,
    ModelState,
    ModelView,
    Placement,
    ReplicaState,
    ReplicaView,
    ServerView,
    VersionView,
    plan,
)
from modelyard.placement.manifest import spec_to_plain
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from modelyard.scheduler import SchedulerConfig, SchedulerState, start_scheduler
from placement_dynamics import add_arguments as add_dynamics_arguments
from placement_dynamics import run_dynamics

GiB = 1 << 30


@dataclass(slots=True)
class Replica:
    index: int
    memory: int
    capabilities: frozenset[str]
    reserved: int = 0


@dataclass(slots=True)
class Fleet:
    servers: dict[str, list[Replica]] = field(default_factory=dict)

    def views(self) -> list[ServerView]:
        return [
            ServerView(
                name,
                tuple(
                    ReplicaView(
                        r.index,
                        r.capabilities,
                        available_memory=r.memory,
                        reserved_memory=r.reserved,
                        total_memory=r.memory,
                    )
                    for r in replicas
                ),
            )
            for name, replicas in self.servers.items()
        ]


def build_fleet(servers: int, per_server: int, replica_memory: int) -> Fleet:
    fleet = Fleet()
    for s in range(servers):
        capabilities = frozenset({"sklearn", "xgboost"} if s % 2 == 0 else {"sklearn", "huggingface"})
        fleet.servers[f"server-{s:02d}"] = [
            Replica(i, replica_memory, capabilities) for i in range(per_server)
        ]
    return fleet


def build_models(count: int, seed: int, mean_memory: int) -> list[ModelSpec]:
    rng = random.Random(seed)
    kinds = ("sklearn", "xgboost", "huggingface")
    return [
        ModelSpec(
            name=f"model-{n:05d}",
            storage_uri=f"file:///models/{n}",
            requirements=(rng.choice(kinds),),
            memory=max(1, int(rng.expovariate(1 / mean_memory))),
            replicas=rng.choice((1, 1, 1, 2, 3)),
        )
        for n in range(count)
    ]


def run_planner(fleet: Fleet, models: list[ModelSpec]) -> dict[str, float]:
    decide: list[float] = []
    with_snapshot: list[float] = []
    failed = 0
    started = time.perf_counter()
    for spec in models:
        t0 = time.perf_counter()
        servers = fleet.views()
        t1 = time.perf_counter()
        result = plan(servers, ModelView((VersionView(1, spec),)))
        t2 = time.perf_counter()
        decide.append(t2 - t1)
        with_snapshot.append(t2 - t0)
        if isinstance(result, Placement):
            replicas = {r.index: r for r in fleet.servers[result.server or ""]}
            for change in result.changes:
                if change.state is ReplicaState.LOAD_REQUESTED:
                    replicas[change.replica].reserved += result.memory
        else:
            failed += 1
    total = time.perf_counter() - started
    return {
        "decisions": len(models),
        "failed": failed,
        "decide_p50_us": _pct(decide, 50) * 1e6,
        "decide_p99_us": _pct(decide, 99) * 1e6,
        "snapshot_p50_us": _pct(with_snapshot, 50) * 1e6,
        "snapshot_p99_us": _pct(with_snapshot, 99) * 1e6,
        "total_s": total,
    }


def _pct(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--servers", type=int, default=10)
    parser.add_argument("--replicas-per-server", type=int, default=10)
    parser.add_argument("--replica-memory-gib", type=float, default=64.0)
    parser.add_argument("--mean-model-mib", type=float, default=100.0)
    parser.add_argument("--repeat", type=int, default=3, help="planner runs; the table shows medians")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip-scheduler", action="store_true", help="time the planner only")
    parser.add_argument(
        "--scheduler-db",
        default="file",
        help="comma-separated scheduler stores, one run each: file (SQLite in a temp file), memory",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="PUTs in flight")
    parser.add_argument(
        "--scheduler-timeout", type=float, default=600.0, help="seconds per scheduler run, at most"
    )
    parser.add_argument(
        "--progress-interval", type=float, default=15.0, help="seconds between progress lines"
    )
    parser.add_argument("--profile", metavar="PATH", help="cProfile the scheduler half into PATH")
    parser.add_argument("--skip-dynamics", action="store_true", help="no lazy reload or scale-up runs")
    parser.add_argument("--dynamics-only", action="store_true", help="only the lazy reload and scale-up runs")
    add_dynamics_arguments(parser)
    args = parser.parse_args(argv)
    console = Console()
    command = "benchmarks/placement.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = datetime.datetime.now(datetime.UTC)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())

    if args.dynamics_only:
        run_dynamics(console, args)
        console.print(f"[dim]{command} · {_machine(load, started)}[/dim]")
        return 0
    models = build_models(args.models, args.seed, int(args.mean_model_mib * (1 << 20)))
    runs = []
    for _ in range(args.repeat):
        fleet = build_fleet(args.servers, args.replicas_per_server, int(args.replica_memory_gib * GiB))
        runs.append(run_planner(fleet, models))
    table = Table(
        title=f"planner: {args.models} models over {args.servers * args.replicas_per_server} replicas"
    )
    for column in (
        "decisions",
        "failed",
        "decide p50 µs",
        "decide p99 µs",
        "+snapshot p50 µs",
        "+snapshot p99 µs",
        "whole set s",
    ):
        table.add_column(column, justify="right")
    keys = (
        "decisions",
        "failed",
        "decide_p50_us",
        "decide_p99_us",
        "snapshot_p50_us",
        "snapshot_p99_us",
        "total_s",
    )
    table.add_row(*(_fmt(statistics.median(run[key] for run in runs)) for key in keys))
    console.print(table)

    if not args.skip_scheduler:
        run_scheduler(console, args, models)
    if not args.skip_dynamics:
        run_dynamics(console, args)
    scheduler = "" if args.skip_scheduler else " · scheduler: one run per store"
    console.print(
        f"[dim]{command} · planner: median of {args.repeat}{scheduler} · {_machine(load, started)}[/dim]"
    )
    return 0


def _machine(load: str, started: datetime.datetime) -> str:
    return (
        f"python {platform.python_version()} · {platform.machine()} · nproc {os.cpu_count()} · "
        f"load at start {load} · {started:%Y-%m-%d %H:%M} UTC"
    )


# --- the scheduler half ---------------------------------------------------------------------------


@dataclass(slots=True)
class SimAgent:
    """One simulated replica: one Subscribe stream; every LOAD_MODEL is answered LOADED and every
    UNLOAD_MODEL UNLOADED at once (one AgentEvent call each, in the order received), carrying the
    memory left: the replica's memory minus what it holds."""

    server: str
    index: int
    memory: int
    capabilities: tuple[str, ...]
    held: dict[tuple[str, int], int] = field(default_factory=dict)
    used: int = 0
    operations: int = 0
    refused: int = 0

    async def run(self, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            request = agent_pb2.SubscribeRequest(
                server_name=self.server,
                replica_idx=self.index,
                shared=True,
                replica_config=agent_pb2.ReplicaConfig(
                    inference_url=f"http://127.0.0.1:9/{self.server}-{self.index}",
                    memory_bytes=self.memory,
                    capabilities=self.capabilities,
                ),
                available_memory_bytes=self.memory,
            )
            async for operation in stub.Subscribe(request):
                model = operation.model_version
                key = (model.name, model.version)
                if operation.operation == agent_pb2.ModelOperation.LOAD_MODEL:
                    self.used += model.memory_bytes - self.held.get(key, 0)
                    self.held[key] = model.memory_bytes
                    event = agent_pb2.ModelEvent.LOADED
                else:
                    self.used -= self.held.pop(key, 0)
                    event = agent_pb2.ModelEvent.UNLOADED
                self.operations += 1
                try:
                    await stub.AgentEvent(
                        agent_pb2.ModelEvent(
                            server_name=self.server,
                            replica_idx=self.index,
                            model_name=model.name,
                            model_version=model.version,
                            event=event,
                            available_memory_bytes=max(0, self.memory - self.used),
                        )
                    )
                except grpc.aio.AioRpcError:
                    self.refused += 1


@dataclass(slots=True)
class FeedWatch:
    """Follows `GET /v1/feed`; done once every model is ModelAvailable with endpoints. A reader the
    scheduler drops for lagging reconnects and starts again from the new snapshot."""

    expected: int
    states: dict[str, str] = field(default_factory=dict)
    serving: set[str] = field(default_factory=set)
    lines: int = 0
    connections: int = 0
    done_at: float | None = None
    snapshot: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def _entry(self, entry: dict[str, Any]) -> None:
        name = entry["name"]
        self.states[name] = entry["state"]
        if entry["state"] == "ModelAvailable" and entry["endpoints"]:
            self.serving.add(name)
        else:
            self.serving.discard(name)

    def _line(self, line: dict[str, Any]) -> None:
        self.lines += 1
        kind = line["type"]
        if kind == "snapshot":
            self.states.clear()
            self.serving.clear()
            for entry in line["models"]:
                self._entry(entry)
            self.snapshot.set()
        elif kind == "model":
            self._entry(line)
        elif kind == "removed":
            self.states.pop(line["name"], None)
            self.serving.discard(line["name"])
        if self.done_at is None and len(self.serving) >= self.expected:
            self.done_at = time.perf_counter()
            self.done.set()

    async def watch(self, session: aiohttp.ClientSession, url: str) -> None:
        unbounded = aiohttp.ClientTimeout(total=None, sock_read=None)
        while True:
            self.connections += 1
            buffer = b""
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/v1/feed", timeout=unbounded) as response:
                    async for chunk in response.content.iter_any():
                        *lines, buffer = (buffer + chunk).split(b"\n")
                        for line in lines:
                            if line:
                                self._line(orjson.loads(line))
            await asyncio.sleep(0.1)


@dataclass(slots=True)
class SchedulerTimings:
    """Wrapped around the running scheduler's state: each placement decision (`_place`: the snapshot
    of the servers, `plan`, applying the result), the snapshot alone, each store write."""

    decide: list[float] = field(default_factory=list)
    snapshot: list[float] = field(default_factory=list)
    store: list[float] = field(default_factory=list)
    failed: int = 0

    def install(self, state: SchedulerState) -> None:
        place, views, write = state._place, state.server_views, state._store.write

        def timed_place(model: Any, now: float) -> None:
            started = time.perf_counter()
            place(model, now)
            self.decide.append(time.perf_counter() - started)
            if model.latest.status.state is ModelState.SCHEDULE_FAILED:
                self.failed += 1

        def timed_views() -> list[ServerView]:
            started = time.perf_counter()
            result = views()
            self.snapshot.append(time.perf_counter() - started)
            return result

        def timed_write(batch: Any) -> None:
            started = time.perf_counter()
            write(batch)
            self.store.append(time.perf_counter() - started)

        state._place = timed_place  # type: ignore[method-assign]
        state.server_views = timed_views  # type: ignore[method-assign]
        state._store.write = timed_write  # type: ignore[method-assign]


async def _put_all(
    session: aiohttp.ClientSession,
    url: str,
    bodies: list[tuple[str, bytes]],
    concurrency: int,
    latencies: list[float],
    errors: list[str],
) -> None:
    pending = iter(bodies)
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        for name, body in pending:  # shared: each worker takes the next model
            started = time.perf_counter()
            async with session.put(f"{url}/v1/models/{name}", data=body, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    errors.append(f"{name}: HTTP {response.status}")
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _available(state: SchedulerState) -> int:
    return sum(m.latest.status.state is ModelState.AVAILABLE for m in state.models.values())


async def _wait_connected(session: aiohttp.ClientSession, url: str, replicas: int) -> None:
    while True:
        async with session.get(f"{url}/v1/servers") as response:
            servers = (await response.json())["servers"]
        if sum(r["connected"] for s in servers for r in s["replicas"]) >= replicas:
            return
        await asyncio.sleep(0.05)


async def _scheduler_run(
    console: Console, args: argparse.Namespace, models: list[ModelSpec], db: str
) -> dict[str, Any]:
    fleet = build_fleet(args.servers, args.replicas_per_server, int(args.replica_memory_gib * GiB))
    bodies = [(spec.name, orjson.dumps(spec_to_plain(spec))) for spec in models]
    latencies: list[float] = []
    errors: list[str] = []
    timings = SchedulerTimings()
    watch = FeedWatch(len(models))
    agents = [
        SimAgent(name, r.index, r.memory, tuple(sorted(r.capabilities)))
        for name, replicas in fleet.servers.items()
        for r in replicas
    ]
    result: dict[str, Any] = {"db": db, "models": len(models), "timed_out": False}
    with tempfile.TemporaryDirectory(prefix="modelyard-bench-") as tmp:
        path = os.path.join(tmp, "scheduler.db") if db == "file" else ":memory:"
        running = await start_scheduler(SchedulerConfig(port=0, agent_port=0, db=path))
        timings.install(running.state)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency + 4))
        tasks = [asyncio.create_task(a.run(running.agent_address)) for a in agents]
        started = time.perf_counter()
        puts_done: float | None = None

        async def progress() -> None:
            while True:
                await asyncio.sleep(args.progress_interval)
                console.print(
                    f"[dim]  {db}: {time.perf_counter() - started:6.1f}s  PUT {len(latencies)}/"
                    f"{len(models)}  available {len(watch.serving)}/{len(models)} (feed), "
                    f"{_available(running.state)} (state)  decisions {len(timings.decide)}  "
                    f"agent operations {sum(a.operations for a in agents)}[/dim]"
                )

        reporter = asyncio.create_task(progress())
        follower: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(args.scheduler_timeout):
                await _wait_connected(session, running.url, len(agents))
                follower = asyncio.create_task(watch.watch(session, running.url))
                await watch.snapshot.wait()
                started = time.perf_counter()
                await _put_all(session, running.url, bodies, args.concurrency, latencies, errors)
                puts_done = time.perf_counter()
                await watch.done.wait()
        except TimeoutError:
            result["timed_out"] = True
        finally:
            elapsed = time.perf_counter() - started
            latest = [m.latest.status for m in running.state.models.values()]
            states = collections.Counter(status.state.value for status in latest)
            reasons = collections.Counter(
                f"{status.state.value}: {status.reason}"
                for status in latest
                if status.state is not ModelState.AVAILABLE
            )
            for task in (reporter, follower):
                if task is not None:
                    task.cancel()
            await running.stop()  # first: agents going away now must not move every model
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
    available = len(watch.serving)
    until = watch.done_at - started if watch.done_at is not None else None
    result.update(
        put_p50_ms=_pct(latencies, 50) * 1e3 if latencies else float("nan"),
        put_p99_ms=_pct(latencies, 99) * 1e3 if latencies else float("nan"),
        puts=len(latencies),
        puts_s=puts_done - started if puts_done is not None else None,
        available=available,
        available_s=until,
        models_per_s=available / (until if until is not None else elapsed),
        elapsed_s=elapsed,
        put_errors=len(errors),
        first_errors=errors[:3],
        refused=sum(a.refused for a in agents),
        operations=sum(a.operations for a in agents),
        states=dict(states),
        reasons=reasons.most_common(3),
        schedule_failed=states.get("ScheduleFailed", 0),
        decisions=len(timings.decide),
        failed_decisions=timings.failed,
        decide_p50_ms=_pct(timings.decide, 50) * 1e3 if timings.decide else float("nan"),
        decide_p99_ms=_pct(timings.decide, 99) * 1e3 if timings.decide else float("nan"),
        snapshot_p50_ms=_pct(timings.snapshot, 50) * 1e3 if timings.snapshot else float("nan"),
        snapshot_p99_ms=_pct(timings.snapshot, 99) * 1e3 if timings.snapshot else float("nan"),
        store_writes=len(timings.store),
        store_p50_ms=_pct(timings.store, 50) * 1e3 if timings.store else float("nan"),
        store_p99_ms=_pct(timings.store, 99) * 1e3 if timings.store else float("nan"),
        feed_connections=watch.connections,
    )
    return result


def run_scheduler(console: Console, args: argparse.Namespace, models: list[ModelSpec]) -> None:
    results = []
    profiler = cProfile.Profile() if args.profile else None
    for db in args.scheduler_db.split(","):
        if profiler is not None:
            profiler.enable()
        results.append(asyncio.run(_scheduler_run(console, args, models, db)))
        if profiler is not None:
            profiler.disable()
    replicas = args.servers * args.replicas_per_server
    client = Table(
        title=f"scheduler: {args.models} models, {replicas} sim agents, {args.concurrency} PUTs in flight"
    )
    for column in (
        "db",
        "PUT p50 ms",
        "PUT p99 ms",
        "all PUT s",
        "all Available s",
        "models/s",
        "ScheduleFailed",
        "PUT errors",
        "events refused",
    ):
        client.add_column(column, justify="right")
    inside = Table(title="inside the scheduler (wrapped in this process)")
    for column in (
        "db",
        "decisions",
        "failed",
        "decide p50 ms",
        "decide p99 ms",
        "snapshot p50 ms",
        "snapshot p99 ms",
        "store writes",
        "write p50 ms",
        "write p99 ms",
    ):
        inside.add_column(column, justify="right")
    for r in results:
        available = (
            _fmt(r["available_s"])
            if r["available_s"] is not None
            else f"timed out: {r['available']}/{r['models']} in {r['elapsed_s']:.0f}"
        )
        client.add_row(
            r["db"],
            _fmt(r["put_p50_ms"]),
            _fmt(r["put_p99_ms"]),
            _fmt(r["puts_s"]) if r["puts_s"] is not None else f"{r['puts']}/{r['models']}",
            available,
            _fmt(r["models_per_s"]),
            str(r["schedule_failed"]),
            str(r["put_errors"]),
            str(r["refused"]),
        )
        inside.add_row(
            r["db"],
            str(r["decisions"]),
            str(r["failed_decisions"]),
            _fmt(r["decide_p50_ms"]),
            _fmt(r["decide_p99_ms"]),
            _fmt(r["snapshot_p50_ms"]),
            _fmt(r["snapshot_p99_ms"]),
            str(r["store_writes"]),
            _fmt(r["store_p50_ms"]),
            _fmt(r["store_p99_ms"]),
        )
    console.print(client)
    console.print(inside)
    for r in results:
        console.print(
            f"[dim]{r['db']}: final states {r['states']}; {r['operations']} agent operations; "
            f"feed connections {r['feed_connections']}[/dim]"
        )
        if r["reasons"]:
            console.print(f"[yellow]{r['db']}: not available (most common): {r['reasons']}[/yellow]")
        if r["first_errors"]:
            console.print(f"[red]{r['db']}: first PUT errors: {r['first_errors']}[/red]")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(25)
        console.print(stream.getvalue(), markup=False, highlight=False)
        console.print(f"[dim]profile written to {args.profile}[/dim]")


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
