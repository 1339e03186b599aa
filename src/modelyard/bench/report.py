"""Summaries of bench runs: the table people compare strategies by, and the JSON/CSV files.

A strategy's Summary is what the table, the files and the chart all show (with --runs, the medians
`median_of_runs` takes): none of them recomputes a number from the requests.
"""

from __future__ import annotations

import csv
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

from modelyard.bench.runner import Outcome


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (the value below which `pct` % of the values fall)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


@dataclass
class Summary:
    label: str  # the strategy, or the URL
    requests: int
    errors: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    ttft_p50_ms: float | None
    req_per_s: float
    cached_share: float  # prompt tokens served from cache / prompt tokens
    busiest_share: float | None  # the busiest backend's share of the answered ones; None: not said
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None  # over streams' mean inter-token gaps
    itl_p95_ms: float | None = None
    backends: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # why requests failed: status or error
    # The answered requests' latencies (every run's), in the order answered: the chart's dots, not
    # in the JSON/CSV.
    latencies_ms: list[float] = field(default_factory=list, repr=False)


def summarize(label: str, outcomes: Sequence[Outcome], wall: float, warmup: float = 0.0) -> Summary:
    """The requests sent after the first `warmup` seconds (all of them, for the chart too)."""
    if warmup:
        outcomes = [o for o in outcomes if o.sent >= warmup]
        wall = max(0.0, wall - warmup)
    ok = [o for o in outcomes if o.status == 200]
    latencies = [o.latency * 1000 for o in ok]
    ttfts = [o.ttft * 1000 for o in ok if o.ttft is not None]
    itls = [o.itl * 1000 for o in ok if o.itl is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    split = Counter(o.backend or "?" for o in ok)
    return Summary(
        label=label,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        p50_ms=percentile(latencies, 50),
        p95_ms=percentile(latencies, 95),
        p99_ms=percentile(latencies, 99),
        mean_ms=statistics.fmean(latencies) if latencies else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) if ttfts else None,
        req_per_s=len(ok) / wall if wall > 0 else 0.0,
        cached_share=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        # (a router that does not say which backend answered: no split to show)
        busiest_share=(max(split.values()) / len(ok) if ok else 0.0) if set(split) != {"?"} else None,
        ttft_p95_ms=percentile(ttfts, 95) if ttfts else None,
        itl_p50_ms=percentile(itls, 50) if itls else None,
        itl_p95_ms=percentile(itls, 95) if itls else None,
        backends=dict(sorted(split.items())),
        failures=dict(
            sorted(Counter(o.error or f"HTTP {o.status}" for o in outcomes if o.status != 200).items())
        ),
        latencies_ms=latencies,
    )


def median_of_runs(runs: Sequence[Summary]) -> Summary:
    """One strategy's runs as one Summary: each numeric column's median over the runs, the requests
    and errors of all of them, every run's latencies (the chart's dots), and the backend split and
    failures of the run with the median P95 (a split that adds up to one run's requests)."""
    if len(runs) == 1:
        return runs[0]
    middle = sorted(runs, key=lambda s: s.p95_ms)[len(runs) // 2]
    fields: dict[str, Any] = {}
    for name in ("p50_ms", "p95_ms", "p99_ms", "mean_ms", "req_per_s", "cached_share"):
        fields[name] = statistics.median(getattr(s, name) for s in runs)
    for name in ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "busiest_share"):
        values = [v for s in runs if (v := getattr(s, name)) is not None]
        fields[name] = statistics.median(values) if values else None
    fields["errors"] = sum(s.errors for s in runs)
    fields["requests"] = sum(s.requests for s in runs)
    fields["latencies_ms"] = [value for s in runs for value in s.latencies_ms]
    return replace(middle, **fields)


def table(summaries: Sequence[Summary], title: str) -> Table:
    out = Table(title=title)
    columns = (
        "strategy", "P50 ms", "P95 ms", "P99 ms", "mean ms", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms",
        "req/s", "errors",
    )  # fmt: skip
    for column in (*columns, "cached", "busiest", "backend split"):
        out.add_column(column, justify="left" if column in ("strategy", "backend split") else "right")
    for s in summaries:
        out.add_row(
            s.label,
            f"{s.p50_ms:.0f}",
            f"{s.p95_ms:.0f}",
            f"{s.p99_ms:.0f}",
            f"{s.mean_ms:.0f}",
            "-" if s.ttft_p50_ms is None else f"{s.ttft_p50_ms:.0f}",
            "-" if s.ttft_p95_ms is None else f"{s.ttft_p95_ms:.0f}",
            "-" if s.itl_p50_ms is None else f"{s.itl_p50_ms:.1f}",
            f"{s.req_per_s:.1f}",
            str(s.errors),
            f"{s.cached_share:.0%}",
            "-" if s.busiest_share is None else f"{s.busiest_share:.0%}",
            "-"
            if s.busiest_share is None
            else " ".join(f"{name}:{count}" for name, count in s.backends.items()),
        )
    return out


def write(path: Path, summaries: Sequence[Summary], command: str) -> None:
    """JSON (`.json`: the command and every summary) or CSV (anything else: one row each)."""
    if path.suffix == ".json":
        path.write_bytes(
            orjson.dumps(
                {"command": command, "runs": [_fields(s) for s in summaries]}, option=orjson.OPT_INDENT_2
            )
        )
        return
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        names = [f for f in Summary.__dataclass_fields__ if f not in ("backends", "failures", "latencies_ms")]
        writer.writerow([*names, "backends"])
        for s in summaries:
            row = _fields(s)
            writer.writerow([row[n] for n in names] + [" ".join(f"{k}:{v}" for k, v in s.backends.items())])


def _fields(summary: Summary) -> dict[str, object]:
    row = asdict(summary)
    del row["latencies_ms"]
    return row
