"""What a bench shows while it runs: a bar for the whole bench (runs done, time elapsed, time left)
and one for the run in flight (requests answered, or seconds sent with `--duration`).

It draws on its own console (stderr, so the table on stdout stays as it is when piped) and clears
itself before the table is printed. Hidden, it costs nothing: rich's Progress with `disable`.

Time left is projected from what the bench has seen: a run costs its start-up (spawning workers
and a gateway) plus its sending, and strategies differ little in either, so each run still to come
takes about what the finished ones took (before any finished, what the run in flight is projected
to take at its pace so far).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from modelyard.bench.runner import Outcome
from modelyard.bench.workload import WorkloadSpec


def time_left(
    finished: Sequence[float], total: int, elapsed: float | None, sending: float | None, done: float
) -> float | None:
    """Seconds the bench still needs. `finished`: how long each finished run took; `total`: runs in
    all; `elapsed`: seconds since the run in flight began (None between runs); `sending`: seconds
    since it began sending (None while it starts); `done`: the share of its work done (0 to 1).
    None until there is a pace to project from."""
    projected = None
    if elapsed is not None and sending is not None and done > 0:
        projected = (elapsed - sending) + sending / done  # its start-up, then the sending at its pace
    typical = statistics.fmean(finished) if finished else projected
    if typical is None:
        return None
    in_flight = 0.0
    if elapsed is not None:
        in_flight = max(0.0, (projected if projected is not None else typical) - elapsed)
    not_begun = total - len(finished) - (1 if elapsed is not None else 0)
    return in_flight + typical * max(0, not_begun)


def _clock_text(seconds: float) -> str:
    return str(timedelta(seconds=max(0, round(seconds))))


class RunProgress:
    """One run's bar, from `BenchProgress.run`: `sending()` when its gateway is ready, `sent` for
    each outcome (run_workload's `progress` callback)."""

    def __init__(self, owner: BenchProgress, task: TaskID, title: str) -> None:
        self._owner = owner
        self._task = task
        self._title = title
        self.began = owner.clock()
        self.sending_since: float | None = None
        self.answered = 0

    def sending(self) -> None:
        self.sending_since = self._owner.clock()
        self._owner.bars.reset(self._task, done=self._owner.unit_text(0))

    def sent(self, outcome: Outcome) -> None:
        self.answered += 1
        self._owner.bars.update(
            self._task, completed=self.work_done(), done=self._owner.unit_text(self.work_done())
        )
        self._owner.moved()

    def work_done(self) -> float:
        """Requests answered, or seconds sent (`--duration`)."""
        duration = self._owner.spec.duration
        if duration is None:
            return float(self.answered)
        if self.sending_since is None:
            return 0.0
        return min(duration, self._owner.clock() - self.sending_since)


class _TimeLeftColumn(ProgressColumn):
    """The whole bench's time left, on its row only."""

    def __init__(self, owner: BenchProgress) -> None:
        super().__init__()
        self._owner = owner

    def render(self, task: Task) -> Text:
        if not task.fields.get("whole"):
            return Text("")
        left = self._owner.seconds_left()
        if left is None:
            return Text("estimating", style="progress.remaining")
        return Text(f"~{_clock_text(left)} left", style="progress.remaining")


class BenchProgress:
    """The bars of a bench of `runs` runs of `spec` (strategies x --runs). A context manager:
    shown from entry to exit, then cleared (on Ctrl-C too)."""

    def __init__(
        self,
        console: Console,
        spec: WorkloadSpec,
        runs: int,
        *,
        show: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self._runs = runs
        self._finished: list[float] = []
        self._current: RunProgress | None = None
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),  # room for the rest in 80 columns
            TextColumn("{task.fields[done]}"),
            TimeElapsedColumn(),
            _TimeLeftColumn(self),
            console=console,
            transient=True,
            disable=not show,
            get_time=clock,
            # Nothing else writes while the bars run; what would must not move to the bars' stream.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._whole = self.bars.add_task("bench", total=runs, done=self._runs_text(), whole=True)

    def __enter__(self) -> BenchProgress:
        self.bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.bars.stop()

    @contextmanager
    def run(self, title: str) -> Iterator[RunProgress]:
        """A run's bar, from its start-up (spawning) to its last outcome."""
        total = self.spec.duration if self.spec.duration is not None else self.spec.requests
        task = self.bars.add_task(title, total=total, done="starting")
        run = self._current = RunProgress(self, task, title)
        try:
            yield run
        finally:
            self._current = None
            self.bars.remove_task(task)
        # Only a run that ended well paces the others (an interrupted one says nothing of them).
        self._finished.append(self.clock() - run.began)
        self.bars.update(self._whole, completed=len(self._finished), done=self._runs_text())

    def moved(self) -> None:
        run = self._current
        share = run.work_done() / self._work_per_run() if run is not None else 0.0
        self.bars.update(self._whole, completed=len(self._finished) + share)

    def seconds_left(self) -> float | None:
        run = self._current  # one read: the bars' thread calls this while the runs go on
        if run is None:
            return time_left(self._finished, self._runs, None, None, 0.0)
        now = self.clock()
        sending = None if run.sending_since is None else now - run.sending_since
        done = run.work_done() / self._work_per_run()
        return time_left(self._finished, self._runs, now - run.began, sending, done)

    def unit_text(self, done: float) -> str:
        """Requests answered of the run's, or seconds sent of its --duration."""
        if self.spec.duration is not None:
            return f"{done:.0f}/{self.spec.duration:g} s"
        return f"{done:.0f}/{self.spec.requests}"

    def _work_per_run(self) -> float:
        return self.spec.duration if self.spec.duration is not None else float(self.spec.requests)

    def _runs_text(self) -> str:
        return f"{len(self._finished)}/{self._runs} runs"
