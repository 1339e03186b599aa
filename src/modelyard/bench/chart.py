"""The bench chart: one PNG, a row per strategy, three panels: each answered request's latency (a
dot each, every run's) with the P50 and P95 marked; the share of prompt tokens served from cache;
the share of the requests each backend answered (and the failed ones).

Every number drawn is the table's: the marks, the labels and the cached bars are the Summary's
columns (with --runs, their medians), the split is the table's backend split; only the dots are
the requests themselves.

matplotlib is optional (`modelyard[bench]`) and imported only here, when a chart is drawn. The chart
is a Figure of its own on the Agg canvas: no pyplot, no global backend or state.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from modelyard.bench.report import Summary
from modelyard.errors import ModelyardError

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.typing import ColorType

INSTALL = "pip install 'modelyard[bench]'"


def available() -> bool:
    """Whether matplotlib is installed (found, not imported: that takes a while)."""
    return importlib.util.find_spec("matplotlib") is not None


FAILED = "failed"
CACHED_TITLE = "served from cache"


def split_shares(summary: Summary) -> list[tuple[str, float]]:
    """Each backend's share of one run's requests, then the failed ones' (when any). The split and
    the failures are one run's, as in the table (with --runs, the run with the median P95), while
    `requests` and `errors` count every run, so the shares are of what that run sent."""
    parts = list(summary.backends.items())
    failed = sum(summary.failures.values())
    if failed:
        parts.append((FAILED, failed))
    sent = sum(count for _, count in parts)
    return [(name, count / sent) for name, count in parts] if sent else []


def row_label(summary: Summary) -> str:
    """A row's name: the strategy, its P50 and P95 and its failed requests, as the table has them."""
    if summary.requests > summary.errors:
        label = f"{summary.label}\nP50 {summary.p50_ms:.0f} · P95 {summary.p95_ms:.0f} ms"
    else:
        label = f"{summary.label}\nno answers"
    return label + (f" · {summary.errors} failed" if summary.errors else "")


def write_chart(
    results: Sequence[Summary], path: Path, title: str = "", cache_bound: float | None = None
) -> None:
    """Draw `results` (see `draw`) as a PNG at `path`. Raises ModelyardError, saying what to
    install, without matplotlib."""
    draw(results, title, cache_bound).savefig(path, format="png", dpi=110)


def draw(results: Sequence[Summary], title: str = "", cache_bound: float | None = None) -> Figure:
    """The chart of `results`, a row each in order (the dots are each summary's `latencies_ms`);
    `cache_bound`, when known, is the share an unbounded cache would serve (dotted)."""
    try:
        from matplotlib import colormaps
        from matplotlib.artist import Artist
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import PercentFormatter
    except ImportError:
        raise ModelyardError(f"a chart needs matplotlib: {INSTALL}") from None

    rows = range(len(results))
    figure = Figure(figsize=(13, 1.9 + 0.7 * max(len(results), 2)), layout="constrained")
    FigureCanvasAgg(figure)
    latency, cached, split = figure.subplots(1, 3, sharey=True, width_ratios=(5, 2, 3))
    if title:
        figure.suptitle(title, fontsize=10)

    # Latency: a strip of dots (jittered up and down so that equal latencies stay visible).
    jitter = random.Random(0)
    for row, summary in zip(rows, results, strict=True):
        values = summary.latencies_ms
        ys = [row + jitter.uniform(-0.28, 0.28) for _ in values]
        alpha = min(0.6, max(0.08, 12 / len(values) ** 0.5)) if values else 0.0
        latency.scatter(values, ys, s=12, color="C0", alpha=alpha, linewidths=0, zorder=3)
        if summary.requests > summary.errors:
            # Behind the dots, which they would hide.
            latency.vlines([summary.p50_ms], row - 0.4, row + 0.4, color="black", linewidth=2, zorder=2)
            latency.vlines([summary.p95_ms], row - 0.4, row + 0.4, color="C3", linewidth=2, zorder=2)
    latency.set_yticks(list(rows), [row_label(summary) for summary in results], fontsize=9)
    latency.set_ylim(len(results) - 0.5, -0.5)  # the first strategy on top, as in the table
    latency.set_xlim(left=0)
    latency.set_xlabel("latency ms (answered requests)")
    latency.set_title("latency per request", fontsize=10)
    latency.grid(axis="x", alpha=0.3)

    # Cached share: what prefix-aware routing is for, beside what it costs in latency.
    for row, summary in zip(rows, results, strict=True):
        cached.barh(row, summary.cached_share, height=0.6, color="C2")
        cached.text(summary.cached_share, row, f" {summary.cached_share:.0%}", va="center", fontsize=8)
    if cache_bound is not None:
        cached.axvline(cache_bound, color="0.3", linestyle=":", linewidth=1)
    cached.set_xlim(0, 1)
    cached.set_xticks([0, 0.25, 0.5, 0.75, 1])  # a narrow panel: fewer ticks, apart from the next's
    cached.xaxis.set_major_formatter(PercentFormatter(1.0))
    cached.set_xlabel("of prompt tokens" + ("\n(dotted: an unbounded cache)" if cache_bound else ""))
    cached.set_title(CACHED_TITLE, fontsize=10)
    cached.grid(axis="x", alpha=0.3)

    # Backend split: stacked shares of all the requests sent, a colour per backend (from a palette
    # apart from the latency panel's blue and red).
    backends = sorted({name for summary in results for name in summary.backends})
    palette = colormaps["Set2"]
    colours = {name: palette(i % palette.N) for i, name in enumerate(backends)}
    for row, summary in zip(rows, results, strict=True):
        left = 0.0
        for name, share in split_shares(summary):
            colour: ColorType = colours.get(name, "0.75")
            hatch = "//" if name == FAILED else ""
            split.barh(row, share, left=left, height=0.6, color=colour, hatch=hatch, edgecolor="white")
            if share >= 0.07:
                split.text(
                    left + share / 2, row, f"{name}\n{share:.0%}", ha="center", va="center", fontsize=8
                )
            left += share
    if backends:
        # An even split's boundaries, to see at a glance how far each strategy is from one.
        for boundary in range(1, len(backends)):
            split.axvline(boundary / len(backends), color="0.3", linestyle=":", linewidth=1)
    split.set_xlim(0, 1)
    split.xaxis.set_major_formatter(PercentFormatter(1.0))
    split.set_xlabel("share of the requests (dotted: an even split)")
    split.set_title("backend split", fontsize=10)
    handles: list[Artist] = [
        Line2D([], [], linestyle="", marker="o", markersize=4, color="C0", label="a request"),
        Line2D([], [], color="black", linewidth=2, label="P50"),
        Line2D([], [], color="C3", linewidth=2, label="P95"),
    ]
    handles += [Patch(color=colours[name], label=name) for name in backends]
    if any(summary.errors for summary in results):
        handles.append(Patch(facecolor="0.75", hatch="//", edgecolor="white", label="failed"))
    figure.legend(
        handles=handles, loc="outside lower center", ncol=min(len(handles), 10), frameon=False, fontsize=9
    )
    return figure
