"""`modelyard bench` end to end: spawned workers and gateways per strategy, a URL, the chart, the
progress bars (asked for, or none when piped), Ctrl-C, and bad input."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modelyard.cli.main import app

PNG = b"\x89PNG\r\n\x1a\n"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in a process of its own (it runs its own event loop and children)."""
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "bench", *args], capture_output=True, text=True, timeout=120
    )


def test_spawn_compares_strategies_in_one_table_and_writes_json_and_a_chart(tmp_path):
    pytest.importorskip("matplotlib")
    out, chart = tmp_path / "bench.json", tmp_path / "chart.png"
    # The quick profile (the README's first bench), made smaller still by the flags.
    done = bench(
        "--spawn", "2", "--profile", "quick", "--strategies", "least_pending,prefix_aware",
        "--requests", "16", "--concurrency", "2", "--prompt-tokens", "20", "--system-prompt-tokens",
        "40", "--output-tokens", "3", "--out", str(out), "--chart", str(chart), "--progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "16 requests, concurrency 2, against 2 spawned sim-workers" in done.stdout
    assert "least_pending" in done.stdout and "prefix_aware" in done.stdout and "P95 ms" in done.stdout
    # Asked for, the bars go to stderr: each strategy's run, and the whole bench's runs and time left
    assert "least_pending" in done.stderr and "prefix_aware" in done.stderr, done.stderr
    assert "2/2 runs" in done.stderr and " left" in done.stderr
    assert "\x1b" not in done.stdout  # the table is as plain as without them
    assert chart.read_bytes().startswith(PNG) and f"wrote {chart}" in done.stdout
    assert not (tmp_path / "bench.png").exists()  # --chart says where: none beside --out
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["least_pending", "prefix_aware"]
    for run in runs:
        assert run["requests"] == 16 and run["errors"] == 0
        assert "latencies_ms" not in run  # the chart's, not the summary's
        assert set(run["backends"]) == {"w0", "w1"}  # through the spawned gateway
        assert run["cached_share"] > 0  # repeated prompts were served from the workers' caches
    # The bound printed under the table: no run caches more than the workload repeats.
    bound = re.search(r"an unbounded prefix cache would serve (\d+)% of these prompt tokens", done.stdout)
    assert bound is not None, done.stdout
    assert all(run["cached_share"] * 100 <= int(bound[1]) + 0.5 for run in runs)


def test_conversations_precise_mode_and_another_router_in_one_table(tmp_path):
    """The chat profile (small), prefix_aware in precise mode (the spawned workers publish their
    KV-cache events), and a --target command started over fresh workers in our gateway's place
    (here a stand-in that serves like a server: what is tested is that it is started with the
    workers' URLs and its port, waited for and benched)."""
    router = tmp_path / "router.py"
    router.write_text(
        "import os, sys\n"
        "port, workers = sys.argv[1], sys.argv[2:]\n"
        "assert workers and all(w.startswith('http://127.0.0.1:') for w in workers), workers\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'modelyard', 'sim-worker', '--port', port])\n"
    )
    out = tmp_path / "bench.json"
    done = bench(
        "--spawn", "2", "--profile", "chat", "--requests", "24", "--warmup", "0",
        "--strategies", "prefix_aware:precise",
        "--target", f"stand-in={sys.executable} {router} {{port}} {{workers}}", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "conversations/s (0.7 of capacity)" in done.stdout and "TTFT p95 ms" in done.stdout
    runs = {r["label"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"prefix_aware:precise", "stand-in"}
    assert all(r["requests"] == 24 and r["errors"] == 0 for r in runs.values())
    assert set(runs["prefix_aware:precise"]["backends"]) <= {"w0", "w1"}
    assert runs["prefix_aware:precise"]["cached_share"] > 0.3  # later turns resend earlier ones
    assert runs["stand-in"]["backends"] == {"?": 24} and runs["stand-in"]["busiest_share"] is None
    assert runs["prefix_aware:precise"]["itl_p50_ms"] is not None


async def test_a_url_is_benched_as_it_is_with_a_chart_beside_out(sim_workers, tmp_path):
    pytest.importorskip("matplotlib")
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
    assert done.stderr == "" and "\x1b" not in done.stdout  # piped: no bars, no terminal codes
    header, row = out.read_text().splitlines()[:2]
    assert header.startswith("label,requests,errors") and row.startswith(f"{worker.url},10,0")
    assert (tmp_path / "bench.png").read_bytes().startswith(PNG)  # matplotlib is there: drawn beside


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
        (["bench", "http://127.0.0.1:1", "--load", "0.7"], "--load: needs --spawn"),
        (["bench", "--spawn", "2", "--load", "0.7", "--rate", "3"], "--load and --rate: give one"),
        (["bench", "--spawn", "2", "--load", "0"], "--load: a share of the capacity"),
        (["bench", "http://127.0.0.1:1", "--turns", "0.5"], "--turns: "),
        (["bench", "http://127.0.0.1:1", "--agent-share", "2"], "--agent-share: "),
        (["bench", "--spawn", "2", "--batch-slowdown", "-1"], "--batch-slowdown: must be 0 or more"),
        (["bench", "--spawn", "2", "--strategies", "least_pending:precise"], "only prefix_aware has a mode"),
        (["bench", "--spawn", "2", "--target", "x"], "--target: 'x': expected NAME=URL or NAME=COMMAND"),
        (["bench", "--target", "r=vllm-router --port {port} {workers}"], "a command needs --spawn"),
        (["bench", "--spawn", "2", "--target", "r=vllm-router --port 9"], "must take {port} and {workers}"),
        (["bench", "--spawn", "2", "--target", "a=http://x", "--target", "a=http://y"], "'a' is named twice"),
        (["bench", "--spawn", "2", "--target", "prefix_aware=http://x"], "is also a strategy"),
        (["bench", "http://127.0.0.1:1", "--profile", "chat"], "against a URL give --rate"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert expected in result.output, (args, result.output)


def test_a_chart_without_matplotlib_fails_before_the_run(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(app, ["bench", "--spawn", "2", "--chart", str(tmp_path / "c.png")])
    assert result.exit_code == 1
    assert "error: --chart: needs matplotlib: pip install 'modelyard[bench]'" in result.output


def test_a_run_where_every_request_failed_says_why_and_exits_1(tmp_path):
    done = bench("http://127.0.0.1:9", "--requests", "3")  # the discard port: nothing listens
    assert done.returncode == 1
    assert "every request failed (ClientConnectorError x3)" in done.stderr


def test_ctrl_c_stops_the_bench_its_workers_and_gateway_and_clears_the_bars():
    args = ["--spawn", "1", "--strategies", "least_pending", "--requests", "100000", "--progress"]
    process = subprocess.Popen(
        [sys.executable, "-m", "modelyard", "bench", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        shown = _read_until(process, re.compile(rb"[1-9]\d*/100000"), within=60)  # it is sending
        children = _children(process.pid)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and out == b"", err[-2000:]
    assert b"Traceback" not in err  # it stops quietly, as a Ctrl-C should
    stderr = shown + err
    assert stderr.rfind(b"\x1b[?25h") > stderr.rfind(b"\x1b[?25l")  # the bars hid the cursor: it is back
    assert len(children) == 2  # a worker and a gateway, both stopped with it
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


def _read_until(process: subprocess.Popen[bytes], pattern: re.Pattern[bytes], within: float) -> bytes:
    """What the process wrote to stderr until `pattern` showed (bounded in time)."""
    assert process.stderr is not None
    seen = b""
    until = time.monotonic() + within
    while not pattern.search(seen):
        left = until - time.monotonic()
        ready, _, _ = select.select([process.stderr], [], [], max(0.0, left))
        assert ready, f"not seen within {within:g}s: {seen[-500:]!r}"
        chunk = os.read(process.stderr.fileno(), 65536)
        assert chunk, f"stderr closed: {seen[-500:]!r}"
        seen += chunk
    return seen


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from each process's /proc/N/stat (every Linux has it;
    /proc/PID/task/PID/children needs a kernel option)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def test_a_target_command_that_cannot_run_is_one_clear_line_and_exit_1():
    done = bench(
        "--spawn", "1", "--requests", "2", "--target", "r=/nonexistent/router --port {port} {workers}"
    )
    assert done.returncode == 1 and "cannot run '/nonexistent/router'" in done.stderr + done.stdout
