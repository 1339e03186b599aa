"""Placement speed: 10,000 models over 100 replicas, in the planner alone and through the scheduler.

  planner    `modelyard.placement.plan` called once per model, in order, each decision seeing the
             reservations of the ones before it (as the scheduler applies them). Times the decision
             alone and the decision plus building its snapshot (the ServerViews).
  scheduler  a real `modelyard scheduler` (in this process, SQLite in a temp file) with one
             simulated agent per replica (gRPC clients in this process that answer every LOAD
             with LOADED at once): time from the first PUT to every model Available, and the
             per-model PUT latency.

Run by hand, never from the test suite:
  .venv/bin/python benchmarks/placement.py [--models 10000] [--servers 10] [--replicas-per-server 10]
See benchmarks/README.md for the figures.
"""

from __future__ import annotations

import argparse
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from modelyard.placement import (
    ModelSpec,
    ModelView,
    Placement,
    ReplicaState,
    ReplicaView,
    ServerView,
    VersionView,
    plan,
)

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
    args = parser.parse_args(argv)
    console = Console()
    command = "benchmarks/placement.py " + shlex.join(argv if argv is not None else sys.argv[1:])

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
    console.print(
        f"[dim]{command} · median of {args.repeat} · python {platform.python_version()} · "
        f"{platform.machine()}[/dim]"
    )
    return 0


def run_scheduler(console: Console, args: argparse.Namespace, models: list[ModelSpec]) -> None:
    console.print("[yellow]scheduler half: not written yet[/yellow]")


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
