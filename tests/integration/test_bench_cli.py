"""`modelyard bench` end to end: spawned workers and gateways per strategy, a URL, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from modelyard.cli.main import app


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in a process of its own (it runs its own event loop and children)."""
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "bench", *args], capture_output=True, text=True, timeout=120
    )


def test_spawn_compares_strategies_in_one_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = bench(
        "--spawn", "2", "--strategies", "least_pending,prefix_aware", "--requests", "16",
        "--concurrency", "2", "--prompt-tokens", "20", "--system-prompt-tokens", "40",
        "--output-tokens", "3", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "least_pending" in done.stdout and "prefix_aware" in done.stdout and "P95 ms" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["least_pending", "prefix_aware"]
    for run in runs:
        assert run["requests"] == 16 and run["errors"] == 0
        assert set(run["backends"]) == {"w0", "w1"}  # through the spawned gateway
        assert run["cached_share"] > 0  # repeated prompts were served from the workers' caches


async def test_a_url_is_benched_as_it_is(sim_workers, tmp_path):
    (worker,) = await sim_workers(1)
    out = tmp_path / "bench.csv"
    done = await _in_thread(
        worker.url,
        "--requests",
        "10",
        "--concurrency",
        "2",
        "--stream",
        "--output-tokens",
        "3",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert worker.url in done.stdout
    header, row = out.read_text().splitlines()[:2]
    assert header.startswith("label,requests,errors") and row.startswith(f"{worker.url},10,0")


async def _in_thread(*args: str) -> subprocess.CompletedProcess[str]:
    import asyncio

    return await asyncio.to_thread(bench, *args)


def test_bad_input_is_one_line_and_exit_1():
    runner = CliRunner()
    cases = [
        (["bench"], "give a URL, or --spawn N"),
        (["bench", "--spawn", "2", "--strategies", "fastest"], "--strategies: unknown strategy"),
        (["bench", "--spawn", "2", "--profile", "nope"], "--profile: unknown profile 'nope'"),
        (["bench", "http://127.0.0.1:1", "--repeat-share", "2"], "--repeat-share: "),
        (["bench", "http://127.0.0.1:1", "--spawn", "2"], "give a URL, or --spawn N"),
        (["bench", "--spawn", "2", "--strategies", ","], "--strategies: name at least one strategy"),
        (["bench", "--spawn", "2", "--prefix-aware", '{"load_margin": -1}'], "--prefix-aware: load_margin"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert expected in result.output, (args, result.output)


def test_a_run_where_every_request_failed_says_why_and_exits_1(tmp_path):
    done = bench("http://127.0.0.1:9", "--requests", "3")  # the discard port: nothing listens
    assert done.returncode == 1
    assert "every request failed (ClientConnectorError x3)" in done.stderr
