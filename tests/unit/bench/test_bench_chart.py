"""modelyard bench's chart: a PNG from summaries that draws the table's numbers (with --runs, their
medians) and the cached share, and one clear error without matplotlib."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from modelyard.bench import Outcome, Summary, summarize
from modelyard.bench.chart import CACHED_TITLE, FAILED, available, draw, row_label, split_shares, write_chart
from modelyard.bench.report import median_of_runs, percentile, table
from modelyard.errors import ModelyardError

PNG = b"\x89PNG\r\n\x1a\n"


def _outcome(latency: float, backend: str, status: int = 200, cached: int = 0) -> Outcome:
    return Outcome(status, latency, None, backend, 100, cached, "fresh")


def _summaries():
    even = [_outcome(0.25 + 0.01 * (i % 7), f"w{i % 3}") for i in range(30)]
    skewed = [_outcome(0.3 + 0.05 * (i % 5), "w0" if i % 4 else "w1") for i in range(28)]
    skewed += [_outcome(0.0, "", status=0)] * 2
    return [summarize("least_pending", even, wall=1.0), summarize("random", skewed, wall=1.0)]


def test_the_chart_is_a_png_of_both_panels(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "bench.png"
    write_chart(_summaries(), path, "30 requests, concurrency 3")
    assert path.read_bytes().startswith(PNG)
    height, width = image.imread(path).shape[:2]
    assert width == 1430 and 300 < height < 1000  # 13 inches at 110 dpi; two rows


def test_a_strategy_without_answers_still_gets_its_row(tmp_path):
    pytest.importorskip("matplotlib")
    failed = summarize("kv_aware", [_outcome(0.0, "", status=0)] * 3, wall=1.0)
    path = tmp_path / "failed.png"
    write_chart([*_summaries(), failed], path)
    assert path.read_bytes().startswith(PNG)


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # found by no import, loaded or not
    assert not available()
    with pytest.raises(ModelyardError, match=r"pip install 'modelyard\[bench\]'"):
        write_chart(_summaries(), tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


def test_the_split_is_of_one_run_and_the_label_says_the_tables_failures():
    one = _summaries()[1]  # 28 answered (w0 21, w1 7), 2 failed
    assert split_shares(one) == [("w0", 21 / 30), ("w1", 7 / 30), (FAILED, 2 / 30)]
    assert row_label(one).endswith(" ms · 2 failed")
    # --runs 2: the table's requests and errors add both runs up, and so does the label; the split
    # is the median run's, as the table's backend split column is
    merged = replace(one, requests=2 * one.requests, errors=5)
    assert row_label(merged).endswith(" ms · 5 failed") and split_shares(merged) == split_shares(one)
    assert row_label(_summaries()[0]).endswith(" ms")  # no failures, none said


def _runs(label: str, slow: float, cached: int) -> Summary:
    """Two runs of a strategy, the second slower and with more cached, as the bench merges them."""
    first = [_outcome(0.2 + 0.01 * (i % 10), f"w{i % 2}", cached=cached) for i in range(40)]
    second = [_outcome(0.2 + slow * (i % 10), f"w{i % 3}", cached=2 * cached) for i in range(40)]
    return median_of_runs([summarize(label, first, wall=2.0), summarize(label, second, wall=2.5)])


def _table_cells(summaries: list[Summary]) -> dict[str, dict[str, str]]:
    """Each row of the printed table: column header -> cell text."""
    columns = table(summaries, "").columns
    labels = [str(cell) for cell in columns[0].cells]
    return {
        label: {str(column.header): str(list(column.cells)[row]) for column in columns}
        for row, label in enumerate(labels)
    }


def _marks(axes) -> list[tuple[float, float]]:
    """The P50/P95 marks of the latency panel: (x, the row it is on)."""
    from matplotlib.collections import LineCollection

    marks = []
    for collection in axes.collections:
        if isinstance(collection, LineCollection):
            for (x, y0), (_, y1) in collection.get_segments():
                marks.append((float(x), (y0 + y1) / 2))
    return marks


def test_the_chart_draws_the_tables_numbers_the_medians_over_runs():
    pytest.importorskip("matplotlib")
    summaries = [_runs("least_pending", slow=0.03, cached=20), _runs("prefix_aware", slow=0.05, cached=35)]
    cells = _table_cells(summaries)
    figure = draw(summaries, cache_bound=0.8)
    latency, cached, _split = figure.axes
    for row, summary in enumerate(summaries):
        shown = cells[summary.label]
        p50, p95 = sorted(x for x, y in _marks(latency) if round(y) == row)
        assert (f"{p50:.0f}", f"{p95:.0f}") == (shown["P50 ms"], shown["P95 ms"])
        assert (
            f"P50 {shown['P50 ms']} · P95 {shown['P95 ms']} ms" in latency.get_yticklabels()[row].get_text()
        )
        bar = cached.patches[row]
        assert f"{bar.get_width():.0%}" == shown["cached"]
        # The medians, not the numbers of the run whose dots one could take for the whole
        assert p95 != percentile(summary.latencies_ms[40:], 95)
        assert len(summary.latencies_ms) == 80  # every run's requests are dots


def test_the_chart_has_the_cached_share_beside_the_latency(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    summaries = _summaries()
    summaries[1] = replace(summaries[1], cached_share=0.38)
    figure = draw(summaries, cache_bound=0.52)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["latency per request", CACHED_TITLE, "backend split"]
    cached = figure.axes[1]
    assert [bar.get_width() for bar in cached.patches] == [0.0, 0.38]
    assert [text.get_text().strip() for text in cached.texts] == ["0%", "38%"]
    (bound,) = cached.get_lines()  # the dotted line an unbounded cache would reach
    assert list(bound.get_xdata()) == [0.52, 0.52]
    path = tmp_path / "bench.png"
    write_chart(summaries, path, cache_bound=0.52)
    assert image.imread(path).shape[1] == 1430
