"""modelyard bench's progress: the time left it projects, and the bars as a user reads them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from modelyard.bench import Outcome, WorkloadSpec
from modelyard.bench.progress import BenchProgress, time_left

ANSWER = Outcome(200, 0.1, None, "w0", 100, 0, "fresh")


def test_time_left_projects_the_run_in_flight_then_each_run_to_come():
    # 5 s of start-up, then half its requests in 5 s: this run takes 15 s, and so will the 3 others.
    assert time_left([], total=4, elapsed=10.0, sending=5.0, done=0.5) == pytest.approx(5 + 3 * 15)
    # Once runs finished, the ones to come take what those took on average.
    assert time_left([14.0, 16.0], total=4, elapsed=10.0, sending=5.0, done=0.5) == pytest.approx(5 + 15)
    # Starting up (nothing sent yet): the run in flight is expected to take a finished one's time.
    assert time_left([20.0], total=3, elapsed=4.0, sending=None, done=0.0) == pytest.approx(16 + 20)
    assert time_left([20.0, 20.0], total=2, elapsed=None, sending=None, done=0.0) == 0.0  # all done


def test_time_left_is_unknown_before_any_pace():
    assert time_left([], total=4, elapsed=3.0, sending=None, done=0.0) is None
    assert time_left([], total=4, elapsed=3.0, sending=1.0, done=0.0) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shown(bench: BenchProgress) -> str:
    """The bars' text, as the terminal shows them at this moment."""
    text = io.StringIO()
    Console(file=text, width=100).print(bench.bars.make_tasks_table(bench.bars.tasks))
    return text.getvalue()


def test_the_bars_show_the_run_in_flight_and_the_whole_bench_time_left():
    clock = Clock()
    bench = BenchProgress(Console(file=io.StringIO()), WorkloadSpec(requests=10), 4, show=False, clock=clock)
    assert "0/4 runs" in _shown(bench) and "estimating" in _shown(bench)
    with bench.run("least_pending run 1/2") as run:
        assert "least_pending run 1/2" in _shown(bench) and "starting" in _shown(bench)
        clock.now += 5  # the workers and the gateway start
        run.sending()
        for _ in range(5):
            clock.now += 1
            run.sent(ANSWER)
        shown = _shown(bench)
        assert "5/10" in shown and "0/4 runs" in shown
        assert "~0:00:50 left" in shown  # 5 s for this run's rest, 15 s for each of the 3 others
        for _ in range(5):
            clock.now += 1
            run.sent(ANSWER)
    shown = _shown(bench)
    assert "1/4 runs" in shown and "least_pending" not in shown  # a finished run's bar goes
    assert "~0:00:45 left" in shown


def test_a_duration_run_counts_seconds_sent():
    clock = Clock()
    spec = WorkloadSpec(duration=30)
    bench = BenchProgress(Console(file=io.StringIO()), spec, 1, show=False, clock=clock)
    with bench.run("http://127.0.0.1:8000") as run:
        run.sending()
        clock.now += 12
        run.sent(ANSWER)
        assert "12/30 s" in _shown(bench) and "~0:00:18 left" in _shown(bench)


def _drawn(show: bool) -> str:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, force_interactive=True, width=100)
    with BenchProgress(console, WorkloadSpec(requests=2), 1, show=show) as bench, bench.run("random") as run:
        run.sending()
        run.sent(ANSWER)
    return stream.getvalue()


def test_shown_it_draws_on_its_console_and_hidden_it_writes_nothing():
    assert "1/1 runs" in _drawn(show=True)
    assert _drawn(show=False) == ""


def test_an_interrupted_run_clears_its_bar_and_paces_nothing():
    bench = BenchProgress(Console(file=io.StringIO()), WorkloadSpec(requests=10), 2, show=False)
    with pytest.raises(KeyboardInterrupt), bench.run("prefix_aware") as run:
        run.sending()
        raise KeyboardInterrupt
    shown = _shown(bench)
    assert "prefix_aware" not in shown and "0/2 runs" in shown and "estimating" in shown
