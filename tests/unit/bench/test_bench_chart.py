"""modelyard bench's chart: a PNG from summaries, and one clear error without matplotlib."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from modelyard.bench import Outcome, summarize
from modelyard.bench.chart import FAILED, available, row_label, split_shares, write_chart
from modelyard.errors import ModelyardError

PNG = b"\x89PNG\r\n\x1a\n"


def _outcome(latency: float, backend: str, status: int = 200) -> Outcome:
    return Outcome(status, latency, None, backend, 100, 0, "fresh")


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


def test_the_split_and_the_label_are_of_the_run_drawn_not_of_every_run():
    one = _summaries()[1]  # 28 answered (w0 21, w1 7), 2 failed
    assert split_shares(one) == [("w0", 21 / 30), ("w1", 7 / 30), (FAILED, 2 / 30)]
    assert row_label(one).endswith(" ms · 2 failed")
    # --runs 2: the table's requests and errors add both runs up; the chart draws the median run
    merged = replace(one, requests=2 * one.requests, errors=5)
    assert row_label(merged) == row_label(one)
    assert row_label(_summaries()[0]).endswith(" ms")  # no failures, none said
