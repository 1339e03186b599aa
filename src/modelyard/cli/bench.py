"""`modelyard bench`: send a workload to an OpenAI-compatible URL, or spawn workers and a gateway per
strategy and compare them in one table."""

from __future__ import annotations

import asyncio
import shlex
import signal
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from modelyard.balancing import check_strategy_name
from modelyard.bench import (
    PROFILES,
    Summary,
    WorkloadSpec,
    build_requests,
    iter_requests,
    run_workload,
    summarize,
)
from modelyard.bench import chart as charts
from modelyard.bench.progress import BenchProgress
from modelyard.bench.report import median_of_runs, table, write
from modelyard.bench.spawn import MODEL, spawned
from modelyard.bench.workload import (
    BenchRequest,
    Conversation,
    SimShape,
    cacheable_share,
    capacity,
    iter_conversations,
    mean_turns,
)
from modelyard.config import PrefixAwareConfig
from modelyard.errors import ModelyardError, UnknownStrategy

_WORKLOAD_FLAGS = {
    "requests": "--requests",
    "duration": "--duration",
    "concurrency": "--concurrency",
    "rate": "--rate",
    "repeat_share": "--repeat-share",
    "pool_size": "--pool-size",
    "zipf_s": "--zipf",
    "shared_prefix_share": "--shared-prefix-share",
    "system_prompts": "--system-prompts",
    "system_prompt_tokens": "--system-prompt-tokens",
    "prompt_tokens": "--prompt-tokens",
    "output_tokens": "--output-tokens",
    "stream": "--stream",
    "seed": "--seed",
    "turns": "--turns",
    "prompt_spread": "--prompt-spread",
    "output_spread": "--output-spread",
    "think_seconds": "--think-seconds",
    "agent_share": "--agent-share",
    "warmup": "--warmup",
}


def bench(
    url: Annotated[
        str | None, typer.Argument(help="An OpenAI-compatible base URL (omit with --spawn).")
    ] = None,
    model: Annotated[str, typer.Option(help="The model name requests carry (with a URL).")] = "sim-model",
    spawn: Annotated[
        int, typer.Option(help="Start this many sim-workers and a gateway of our own per strategy.")
    ] = 0,
    strategies: Annotated[
        str, typer.Option(help="With --spawn: comma-separated strategies, one fresh run each.")
    ] = "least_pending,prefix_aware",
    gateway_workers: Annotated[
        int, typer.Option(help="With --spawn: the spawned gateway's --workers (processes on its port).")
    ] = 1,
    target: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=URL: also run the workload against this OpenAI-compatible URL, as it is. "
            "NAME=COMMAND (with --spawn): start fresh workers and this router over them instead of "
            "our gateway, e.g. 'vllm-router=vllm-router --worker-urls {workers} --port {port}' "
            "({workers}: the workers' URLs, as separate arguments, or comma-separated inside a word). "
            "Repeatable; one row each.",
        ),
    ] = None,
    profile: Annotated[
        str | None, typer.Option(help=f"A named workload and worker shape: {', '.join(PROFILES)}.")
    ] = None,
    runs: Annotated[int, typer.Option(help="Runs per strategy; the table shows each column's median.")] = 1,
    requests: Annotated[int | None, typer.Option(help="Requests per run.")] = None,
    duration: Annotated[float | None, typer.Option(help="Seconds per run instead of a count.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests in flight (closed loop).")] = None,
    rate: Annotated[
        float | None,
        typer.Option(
            help="Requests per second, open loop (Poisson); with conversations, conversations per second."
        ),
    ] = None,
    repeat_share: Annotated[float | None, typer.Option(help="Share of prompts repeated from a pool.")] = None,
    pool_size: Annotated[int | None, typer.Option(help="Prompts in the repeated pool.")] = None,
    zipf: Annotated[float | None, typer.Option(help="Zipf exponent of the pool's popularity.")] = None,
    shared_prefix_share: Annotated[
        float | None, typer.Option(help="Share of prompts starting with a shared system prompt.")
    ] = None,
    system_prompts: Annotated[int | None, typer.Option(help="Distinct shared system prompts.")] = None,
    system_prompt_tokens: Annotated[int | None, typer.Option(help="Words per system prompt.")] = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="Words per user prompt.")] = None,
    output_tokens: Annotated[int | None, typer.Option(help="max_tokens of each request.")] = None,
    stream: Annotated[bool | None, typer.Option("--stream/--no-stream", help="Stream the answers.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the prompts.")] = None,
    turns: Annotated[
        float | None,
        typer.Option(help="Mean turns of a conversation; above 1 each turn resends the conversation so far."),
    ] = None,
    prompt_spread: Annotated[
        float | None, typer.Option(help="Lognormal sigma of a message's words around --prompt-tokens.")
    ] = None,
    output_spread: Annotated[
        float | None, typer.Option(help="Lognormal sigma of a turn's max_tokens around --output-tokens.")
    ] = None,
    think_seconds: Annotated[
        float | None, typer.Option(help="Mean pause before a conversation's next turn (exponential).")
    ] = None,
    agent_share: Annotated[
        float | None, typer.Option(help="Share of conversations that are agent loops over long instructions.")
    ] = None,
    warmup: Annotated[
        float | None, typer.Option(help="Seconds from the start whose requests are sent but not counted.")
    ] = None,
    load: Annotated[
        float | None,
        typer.Option(
            help="With --spawn: send open loop at this share of the workers' capacity (requests per "
            "second they serve with every slot busy and nothing cached), instead of --rate."
        ),
    ] = None,
    batch_slowdown: Annotated[
        float | None,
        typer.Option(help="With --spawn: a decode step's extra cost per other request in the batch."),
    ] = None,
    slots: Annotated[int | None, typer.Option(help="With --spawn: request slots per worker.")] = None,
    prefill_ms: Annotated[
        float | None, typer.Option(help="With --spawn: prefill ms per uncached token.")
    ] = None,
    decode_ms: Annotated[float | None, typer.Option(help="With --spawn: decode ms per output token.")] = None,
    cache_blocks: Annotated[
        int | None, typer.Option(help="With --spawn: prefix cache blocks per worker.")
    ] = None,
    prefix_aware: Annotated[
        str | None,
        typer.Option(
            help="With --spawn: prefix_aware settings of the gateway, as JSON (e.g. '{\"load_margin\": 1}')."
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Also write the summaries to FILE (.json, else CSV).")
    ] = None,
    chart: Annotated[
        Path | None,
        typer.Option(
            help="Also draw a PNG: per strategy, each request's latency (the table's P50 and P95 "
            "marked), the share of prompt tokens served from cache, and the backend split. Needs "
            "matplotlib (the bench extra). With --out and no --chart, it is drawn beside the file "
            "(its name with .png) when matplotlib is installed."
        ),
    ] = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Show progress bars and the time left on stderr (default: only when it is a terminal).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Measure latency, throughput, backend split and prompt-cache reuse of a workload.

    Against a URL it runs the workload once. With --spawn N it starts N sim-workers and a gateway
    over them for each of --strategies (fresh ones per run, so no strategy inherits another's
    caches) and prints one row per strategy. --profile inferflow reproduces the shape of
    InferFlow's published experiment; --profile quick is its shape with fewer requests, for a
    comparison in about a minute.
    """
    # Piped or captured, rich would fold the table to 80 columns: give it room instead.
    console = Console(width=None if sys.stdout.isatty() else 170)
    chosen = PROFILES.get(profile) if profile else None
    if profile and chosen is None:
        _fail(f"--profile: unknown profile {profile!r}; one of: {', '.join(PROFILES)}")
    base = chosen.workload if chosen else WorkloadSpec()
    sims = chosen.sims if chosen else SimShape()
    overrides = {
        "requests": requests,
        "duration": duration,
        "concurrency": concurrency,
        "rate": rate,
        "repeat_share": repeat_share,
        "pool_size": pool_size,
        "zipf_s": zipf,
        "shared_prefix_share": shared_prefix_share,
        "system_prompts": system_prompts,
        "system_prompt_tokens": system_prompt_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "stream": stream,
        "seed": seed,
        "turns": turns,
        "prompt_spread": prompt_spread,
        "output_spread": output_spread,
        "think_seconds": think_seconds,
        "agent_share": agent_share,
        "warmup": warmup,
    }
    try:
        spec = WorkloadSpec.model_validate(
            {**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        )
    except ValidationError as exc:
        problem = exc.errors()[0]
        flag = (
            _WORKLOAD_FLAGS.get(str(problem["loc"][0]), str(problem["loc"][0]))
            if problem["loc"]
            else "options"
        )
        _fail(f"{flag}: {problem['msg']}")
    shape: dict[str, Any] = {
        "max_concurrency": slots,
        "prefill_ms_per_token": prefill_ms,
        "decode_ms_per_token": decode_ms,
        "cache_blocks": cache_blocks,
        "batch_slowdown": batch_slowdown,
    }
    if batch_slowdown is not None and batch_slowdown < 0:
        _fail("--batch-slowdown: must be 0 or more")
    sims = replace(sims, **{k: v for k, v in shape.items() if v is not None})
    if load is None and rate is None and chosen is not None and chosen.load is not None:
        if not spawn:
            _fail(
                f"--profile {profile}: sent open loop at a share of the servers' capacity, which is "
                "known only for workers it starts (--spawn); against a URL give --rate"
            )
        load = chosen.load
    if load is not None:
        if not spawn:
            _fail(
                "--load: needs --spawn (the capacity of servers it did not start is not known); give --rate"
            )
        if rate is not None:
            _fail("--load and --rate: give one")
        if not 0 < load <= 10:
            _fail("--load: a share of the capacity, above 0 (e.g. 0.7)")
        # (conversations arrive at `rate`; each is mean_turns requests)
        spec = spec.model_copy(update={"rate": load * capacity(spec, sims, spawn) / mean_turns(spec)})
    if runs < 1:
        _fail("--runs: must be at least 1")
    if gateway_workers < 1:
        _fail("--gateway-workers: must be at least 1")
    settings = None
    if prefix_aware is not None:
        try:
            settings = PrefixAwareConfig.model_validate_json(prefix_aware).model_dump(exclude_unset=True)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(p) for p in problem["loc"])
            _fail(f"--prefix-aware: {where + ': ' if where else ''}{problem['msg']}")
    targets = _targets(target or [], spawn)
    if spawn < 0 or (spawn and url is not None) or (not spawn and url is None and not targets):
        _fail("give a URL, or --spawn N (N >= 1) to start workers and a gateway per strategy")
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    if spawn and not names:
        _fail("--strategies: name at least one strategy")
    if spawn and (clash := sorted(set(names) & set(targets))):
        _fail(f"--target: {clash[0]!r} is also a strategy: name it otherwise")
    if spawn:
        try:
            for name in names:
                named, _, mode = name.partition(":")
                check_strategy_name(named)
                if mode and (mode != "precise" or named != "prefix_aware"):
                    _fail(f"--strategies: {name!r}: only prefix_aware has a mode (prefix_aware:precise)")
        except UnknownStrategy as error:
            _fail(f"--strategies: {error.message}")
    if chart is not None and not charts.available():
        _fail(f"--chart: needs matplotlib: {charts.INSTALL}")
    if chart is not None and not chart.parent.is_dir():
        _fail(f"--chart: {chart.parent}: no such directory")
    command = "modelyard bench " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])
    # On stderr, and only at a terminal unless asked: piped or captured, stdout and stderr stay as
    # they were (isatty, not rich's guess, which FORCE_COLOR in CI turns on).
    show = sys.stderr.isatty() if progress is None else progress
    bars = BenchProgress(
        Console(stderr=True, force_terminal=show, force_interactive=show),
        spec,
        runs * (len(names) if spawn else 1),
        show=show,
    )
    # SIGTERM stops the run as Ctrl-C does, so the spawned workers and gateway are stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with bars:
            summaries: list[Summary] = asyncio.run(
                _bench(bars, url, model, spawn, names, spec, sims, runs, settings, gateway_workers, targets)
            )
    except ModelyardError as error:
        _fail(error.message)
    if spec.conversations:
        pace = f", {spec.rate:.3g} conversations/s" if spec.rate else ""
        pace += f" ({load:g} of capacity)" if load is not None else ""
        pace += f", conversations of {mean_turns(spec):.1f} turns"
    else:
        pace = f", {spec.rate:g} req/s" if spec.rate else ""
    where = f"{spawn} spawned sim-workers" if spawn else str(url or ", ".join(targets))
    if spawn and gateway_workers > 1:
        where += f" (gateway: {gateway_workers} workers)"
    if spec.warmup:
        pace += f", the first {spec.warmup:g} s not counted"
    title = (
        f"{spec.requests if not spec.duration else f'{spec.duration:g}s of'} requests, "
        f"concurrency {spec.concurrency}{pace}, against {where}"
    )
    console.print(table(summaries, title + (f" (median of {runs} runs)" if runs > 1 else "")))
    bound = None
    if not spec.duration and not spec.conversations:  # (a conversation's prompts quote its answers)
        # The bound on the "cached" column: what this workload repeats at all.
        bound = cacheable_share(build_requests(spec), sims.block_tokens)
        console.print(f"an unbounded prefix cache would serve {bound:.0%} of these prompt tokens")
    console.print(f"[dim]{command}[/dim]")
    if out is not None:
        write(out, summaries, command)
        console.print(f"wrote {out}")
    many = f" (median of {runs} runs; dots: every run's requests; split: the median-P95 run's)"
    _draw(console, summaries, title + (many if runs > 1 else ""), bound, chart, out)
    failed = [s for s in summaries if s.requests and s.errors == s.requests]
    if failed:
        for s in failed:
            reasons = ", ".join(f"{why} x{count}" for why, count in s.failures.items())
            typer.echo(f"error: {s.label}: every request failed ({reasons})", err=True)
        raise typer.Exit(1)


def _draw(
    console: Console,
    summaries: list[Summary],
    title: str,
    cache_bound: float | None,
    chart: Path | None,
    out: Path | None,
) -> None:
    """The chart asked for, or one beside --out when matplotlib is there to draw it."""
    if chart is None:
        if out is None or out.suffix.lower() == ".png":
            return
        if not charts.available():
            console.print(f"[dim]no chart beside {out}: {escape(charts.INSTALL)} for one[/dim]")
            return
        chart = out.with_suffix(".png")
    try:
        charts.write_chart(summaries, chart, title, cache_bound)
    except ModelyardError as error:
        _fail(f"--chart: {error.message}")
    except OSError as error:
        _fail(f"--chart: {chart}: {error.strerror or error}")
    console.print(f"wrote {chart}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _fail(line: str) -> None:
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(1)


def _is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def _targets(given: list[str], spawn: int) -> dict[str, str]:
    """--target NAME=URL or NAME=COMMAND, by name (one line and exit 1 for a bad one)."""
    targets: dict[str, str] = {}
    for entry in given:
        name, _, aim = entry.partition("=")
        name, aim = name.strip(), aim.strip()
        if not name or not aim:
            _fail(f"--target: {entry!r}: expected NAME=URL or NAME=COMMAND")
        if name in targets:
            _fail(f"--target: {name!r} is named twice")
        if not _is_url(aim):
            if not spawn:
                _fail(f"--target {name}: a command needs --spawn (the workers it routes to)")
            if "{port}" not in aim or "{workers}" not in aim:
                _fail(f"--target {name}: the command must take {{port}} and {{workers}}")
        targets[name] = aim
    return targets


async def _bench(
    bars: BenchProgress,
    url: str | None,
    model: str,
    spawn: int,
    strategies: list[str],
    spec: WorkloadSpec,
    sims: SimShape,
    runs: int,
    prefix_settings: dict[str, object] | None = None,
    gateway_workers: int = 1,
    targets: dict[str, str] | None = None,
) -> list[Summary]:
    summaries = []
    targets = targets or {}
    labels = (strategies if spawn else [url] if url else []) + list(targets)
    for label in labels:
        aimed = targets.get(label)
        per_run = []
        for number in range(1, runs + 1):
            title = f"{label} run {number}/{runs}" if runs > 1 else label
            requests: Iterable[BenchRequest] | Iterable[Conversation]
            if spec.conversations:
                requests = iter_conversations(spec)  # (the runner stops at spec.requests turns)
            else:
                requests = iter_requests(spec) if spec.duration else build_requests(spec)
            with bars.run(title) as run:
                if aimed is not None and _is_url(aimed):
                    run.sending()
                    outcomes, wall = await run_workload(aimed, model, spec, requests, progress=run.sent)
                elif spawn:
                    async with spawned(
                        label,
                        spawn,
                        sims,
                        seed=spec.seed,
                        prefix_aware=prefix_settings,
                        gateway_workers=gateway_workers,
                        target=aimed,
                    ) as gateway:
                        run.sending()
                        outcomes, wall = await run_workload(gateway, MODEL, spec, requests, progress=run.sent)
                else:
                    assert url is not None
                    run.sending()
                    outcomes, wall = await run_workload(url, model, spec, requests, progress=run.sent)
            per_run.append(summarize(label, outcomes, wall, spec.warmup))
        summaries.append(median_of_runs(per_run))
    return summaries
