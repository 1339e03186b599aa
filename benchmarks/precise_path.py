"""prefix_aware's precise mode on the request path: a gateway routing on the servers' KV-cache
events against the same gateway guessing (approximate), at 1 and 32 connections.

    .venv/bin/python benchmarks/precise_path.py                 # about 2 minutes
    .venv/bin/python benchmarks/precise_path.py --duration 5 --repeat 3 --history-words 2000

Three sim-workers with no prefill or decode cost (so the gateway is what is measured) publish
their KV-cache events (bench/tokenizer.py's word tokenizer, as `modelyard bench
--strategies prefix_aware:precise` runs them); one gateway process (`--workers 1`) routes with
prefix_aware over them, in precise mode (the endpoints name their events and the model the
tokenizer) or not. wrk sends chat requests shaped like a conversation's next turn: a system prompt
and a history of `--history-words` words, shared by every request, then a new user message of 24
words nobody sent before (so the servers store new blocks and publish events all along, as a
busy vLLM does; an endpoint whose events stop falls back to approximate). The modes alternate,
`--repeat` runs each; the table shows medians: requests per second, latency, and the gateway's
CPU per request (its process, from /proc), whose difference is precise mode's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import CHAT_PATH, process_tree_cpu, require_binaries, run_wrk
from modelyard.bench.spawn import (
    _free_ports,
    _launch_gateway,
    _launch_workers,
    _stop,
    _wait_ready,
    gateway_config,
)
from modelyard.bench.tokenizer import write_word_tokenizer
from modelyard.bench.workload import _VOCABULARY, SimShape

SIMS = SimShape(max_concurrency=64, prefill_ms_per_token=0.0, decode_ms_per_token=0.0, cache_blocks=4096)
OUTPUT_TOKENS = 4

# Each request's new user message: 24 words spelled from the request's number by wrk (digits to
# words, in three orders), so no two requests share it and every one stores new blocks.
WRK_LUA = """\
local n = 0
local digits = {{{digits}}}
local head = '{head}'
local tail = '"}}],"max_tokens":{output},"stream":false}}'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  n = n + 1
  local s = string.format("%08d", n + {offset})
  local words = {{}}
  for round = 0, 2 do
    for i = 1, 8 do
      local d = tonumber(s:sub(i, i))
      words[#words + 1] = digits[((d + round * 3) % 10) + 1]
    end
  end
  return wrk.format(nil, nil, nil, head .. table.concat(words, " ") .. tail)
end
"""


def conversation_head(history_words: int) -> str:
    """The JSON of every request up to its new message: the model, a system prompt and a history."""
    words = [_VOCABULARY[(i * 7) % len(_VOCABULARY)] for i in range(history_words)]
    third = history_words // 3
    messages = [
        {"role": "system", "content": "system 0: " + " ".join(words[:third])},
        {"role": "user", "content": "chat 1.0: " + " ".join(words[third : 2 * third])},
        {"role": "assistant", "content": " ".join(words[2 * third :])},
    ]
    body = json.dumps({"model": "bench", "messages": messages}, separators=(",", ":"))
    return body[: -len("]}")] + ',{"role":"user","content":"'


def make_live(gateway: str, workers: list[str], head: str) -> None:
    """Every endpoint's event index live: each worker is sent a new message straight (the gateway
    sends a prompt where it is cached, and a worker that gets nothing publishes nothing), until the
    gateway has heard from all of them (its subscriptions connect within a second or two)."""
    for attempt in range(50):  # bounded: about 10 s
        if [kv.get("state") for kv in overview_kv(gateway)] == ["live"] * len(workers):
            return
        for n, worker in enumerate(workers):
            # (32 words of the vocabulary no other message has: new blocks, so new events)
            words = " ".join(
                _VOCABULARY[(attempt * 31 + n * 17 + i * i) % len(_VOCABULARY)] for i in range(32)
            )
            body = (head + words + '"}],"max_tokens":1}').encode()
            request = urllib.request.Request(worker + CHAT_PATH, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10):
                pass
        time.sleep(0.2)
    sys.exit(f"precise mode is not live: {overview_kv(gateway)}")


def overview_kv(url: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(url + "/admin/overview", timeout=5) as response:
        overview = json.loads(response.read())
    endpoints = overview["models"][0]["endpoints"]
    return [e.get("kv_events") or {} for e in endpoints]


async def one_gateway(
    mode: str, args: argparse.Namespace, tmp: Path, lua: str, head: str
) -> dict[int, tuple[float, float, float, float]]:
    """Start three fresh workers and a gateway in `mode` over them, and load it at each connection
    count: (req/s, p50 ms, p99 ms, gateway CPU ms per request) by connection count. (Fresh workers:
    a gateway that joins a worker whose replay buffer no longer holds the blocks its hot prefix was
    stored in cannot tell which blocks later ones chain from, and stays `rebuilding`.)"""
    precise = mode == "precise"
    tokenizer = tmp / "tokenizer"
    processes: list[subprocess.Popen[bytes]] = []
    rows = {}
    try:
        urls, events = _launch_workers(3, SIMS, 0, tmp / "children.log", processes, tokenizer)
        for url, process in zip(urls, processes, strict=True):
            await _wait_ready(url + "/health", process)
        (port,) = _free_ports(1)
        config = gateway_config(
            "prefix_aware",
            urls,
            SIMS,
            port,
            kv_events=events if precise else None,
            tokenizer=tokenizer if precise else None,
        )
        gateway = _launch_gateway(config, tmp, tmp / "children.log")
        processes.append(gateway)
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(url + "/readyz", gateway)
        if precise:
            await asyncio.to_thread(make_live, url, urls, head)
        for connections in args.connections:
            script = tmp / "wrk.lua"
            script.write_text(lua.replace("{offset}", str(next(OFFSETS))))
            run_wrk(mode, url + CHAT_PATH, script, connections, 1.0)  # warm-up
            script.write_text(lua.replace("{offset}", str(next(OFFSETS))))  # (no message sent before)
            before = process_tree_cpu(gateway.pid)
            result = run_wrk(mode, url + CHAT_PATH, script, connections, args.duration)
            cpu = process_tree_cpu(gateway.pid) - before
            if result.errors or not result.requests:
                sys.exit(f"{mode}: {result.errors} errors\n{result.raw}")
            if precise and [kv.get("precise") for kv in overview_kv(url)] != [True] * 3:
                sys.exit(f"precise mode fell back during the run: {overview_kv(url)}")
            cpu_ms = cpu / result.requests * 1000
            rows[connections] = (result.requests_per_s, result.p50_ms, result.p99_ms, cpu_ms)
    finally:
        _stop(processes)
    return rows


OFFSETS = itertools.count(0, 1_000_000)


async def measure(args: argparse.Namespace) -> dict[tuple[str, int], list[tuple[float, float, float, float]]]:
    """Each mode's runs, alternating."""
    require_binaries("wrk")
    digits = ", ".join(f'"{w}"' for w in _VOCABULARY[:10])
    head = conversation_head(args.history_words)
    lua = WRK_LUA.format(digits=digits, head=head, output=OUTPUT_TOKENS, offset="{offset}")
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="modelyard-precise-") as folder:
        tmp = Path(folder)
        write_word_tokenizer(tmp / "tokenizer")
        for _ in range(args.repeat):
            for mode in ("approximate", "precise"):
                for connections, row in (await one_gateway(mode, args, tmp, lua, head)).items():
                    results.setdefault((mode, connections), []).append(row)
    return results


def report(
    args: argparse.Namespace, results: dict[tuple[str, int], list[tuple[float, float, float, float]]]
) -> None:
    print(f"$ {' '.join(sys.argv)}")
    print(
        f"3 zero-cost sim-workers publishing KV events, one gateway process, a {args.history_words}-word "
        f"history + 24 new words per request, {args.duration:g} s x {args.repeat} per row, medians"
    )
    print(f"{'mode':<13}{'conns':>6}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/req':>12}{'more CPU':>10}")
    for connections in args.connections:
        base = None
        for mode in ("approximate", "precise"):
            runs = results[(mode, connections)]
            rps, p50, p99, cpu = (statistics.median(r[k] for r in runs) for k in range(4))
            extra = f"{cpu - base:>+10.3f}" if base is not None else f"{'':>10}"
            base = cpu if base is None else base
            print(f"{mode:<13}{connections:>6}{rps:>9.0f}{p50:>9.2f}{p99:>9.2f}{cpu:>12.3f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode and connection count")
    parser.add_argument("--connections", type=lambda s: [int(c) for c in s.split(",")], default=[1, 32])
    parser.add_argument("--history-words", type=int, default=1000)
    args = parser.parse_args()
    report(args, asyncio.run(measure(args)))


if __name__ == "__main__":
    main()
