"""`--spawn N`: N sim-workers and a gateway over them, as child processes, fresh for each strategy.

Child processes (not tasks in the bench's own loop), so the load generator, the gateway and the
workers do not share an event loop: what the table measures is the gateway's routing, as it would
be in front of real servers. The ports are picked free on 127.0.0.1; every child is stopped (SIGTERM,
then SIGKILL after 5 s) when the run ends, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from modelyard.bench.tokenizer import write_word_tokenizer
from modelyard.bench.workload import SimShape
from modelyard.config import PrefixAwareConfig
from modelyard.errors import ModelyardError

MODEL = "bench"
# Characters per sim-worker token: words from the bench vocabulary average ~6 letters and a space.
_CHARS_PER_TOKEN = 7


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def gateway_config(
    strategy: str,
    worker_urls: list[str],
    sims: SimShape,
    port: int,
    prefix_aware: dict[str, object] | None = None,
    kv_events: list[tuple[str, str]] | None = None,
    tokenizer: Path | None = None,
) -> dict[str, object]:
    """The gateway's config for one run: one model over the workers, the strategy under test, and
    prefix_aware told what the workers are: its index sized like their prefix caches, its queue
    model given their request slots."""
    cache_chars = sims.cache_blocks * sims.block_tokens * _CHARS_PER_TOKEN
    chunk = (prefix_aware or {}).get("chunk_chars")
    # Size the index with the chunk size the gateway will use (a bad override: the gateway says so).
    chunk_chars = chunk if isinstance(chunk, int) and chunk >= 1 else PrefixAwareConfig().chunk_chars
    sized: dict[str, object] = {
        "chunk_chars": chunk_chars,
        "max_chunks_per_endpoint": max(1, cache_chars // chunk_chars),
        "slots": sims.max_concurrency,
    }
    endpoints: list[dict[str, object]] = [{"url": url, "name": f"w{i}"} for i, url in enumerate(worker_urls)]
    if kv_events is not None and tokenizer is not None:  # precise mode: the workers' KV-cache events
        for endpoint, (events, replay) in zip(endpoints, kv_events, strict=True):
            endpoint["kv_events"], endpoint["kv_replay"] = events, replay
        sized["tokenizer"] = str(tokenizer)
    return {
        "listen": {"host": "127.0.0.1", "port": port, "drain_seconds": 0},
        "models": [
            {
                "name": MODEL,
                "strategy": strategy,
                "endpoints": endpoints,
                "prefix_aware": sized | (prefix_aware or {}),
            }
        ],
    }


async def _wait_ready(url: str, process: subprocess.Popen[bytes], within: float = 30.0) -> None:
    until = time.monotonic() + within
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            if process.poll() is not None:
                raise ModelyardError(f"{' '.join(process.args)} exited with {process.returncode}")  # type: ignore[arg-type]
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)  # a bounded poll for a child process that is starting
    raise ModelyardError(f"{url} was not ready within {within:g}s")


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """To the process, or to its whole session when it leads one (a --target command)."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            _signal(process, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait(timeout=5)


_COMMAND = [sys.executable, "-m", "modelyard"]


def _child(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its own copy of the file
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen([*_COMMAND, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def _launch_workers(
    workers: int,
    sims: SimShape,
    seed: int,
    log: Path,
    processes: list[subprocess.Popen[bytes]],
    tokenizer: Path | None = None,
) -> tuple[list[str], list[tuple[str, str]]]:
    """Start the workers (appended to `processes` as they start); their URLs and, with a
    tokenizer, their KV-event and replay endpoints."""
    urls = []
    events: list[tuple[str, str]] = []
    for i, port in enumerate(_free_ports(workers)):
        args = [
            "sim-worker",
            "--port", str(port),
            "--model", MODEL,
            "--max-concurrency", str(sims.max_concurrency),
            "--prefill-ms-per-token", str(sims.prefill_ms_per_token),
            "--decode-ms-per-token", str(sims.decode_ms_per_token),
            "--cache-blocks", str(sims.cache_blocks),
            "--block-tokens", str(sims.block_tokens),
            "--batch-slowdown", str(sims.batch_slowdown),
            "--seed", str(seed + i),
        ]  # fmt: skip
        if tokenizer is not None:
            publish, replay = _free_ports(2)
            args += [
                "--tokenizer",
                str(tokenizer),
                "--kv-events-port",
                str(publish),
                "--kv-replay-port",
                str(replay),
            ]
            events.append((f"tcp://127.0.0.1:{publish}", f"tcp://127.0.0.1:{replay}"))
        processes.append(_child(args, log))
        urls.append(f"http://127.0.0.1:{port}")
    return urls, events


def _launch_target(template: str, worker_urls: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    args: list[str] = []
    for word in shlex.split(template):
        if word == "{workers}":
            args += worker_urls
        else:
            args.append(word.replace("{port}", str(port)).replace("{workers}", ",".join(worker_urls)))
    try:
        with log.open("ab") as out:
            # a session of its own: a wrapper (bash -c, uv run) and the router it starts stop together
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise ModelyardError(f"cannot run {args[0]!r}: {exc.strerror or exc}") from None


def _launch_gateway(
    config: dict[str, object], tmp: Path, log: Path, workers: int = 1
) -> subprocess.Popen[bytes]:
    path = tmp / "gateway.yaml"
    path.write_text(json.dumps(config))
    return _child(["serve", "-c", str(path), "--log-level", "warning", "--workers", str(workers)], log)


@contextlib.asynccontextmanager
async def spawned(
    strategy: str,
    workers: int,
    sims: SimShape,
    seed: int = 0,
    prefix_aware: dict[str, object] | None = None,
    gateway_workers: int = 1,
    target: str | None = None,
) -> AsyncIterator[str]:
    """Start the workers, then (once they answer, so its first health checks pass) a gateway
    routing with `strategy` (as `gateway_workers` processes); yields the gateway's URL.
    `prefix_aware:precise`: prefix_aware fed the workers' KV-cache events (bench/tokenizer.py).
    `target`: instead of our gateway, this command (another router), its `{port}` and `{workers}`
    (the workers' URLs, as separate arguments) filled in; ready once its /health answers 200."""
    with tempfile.TemporaryDirectory(prefix="modelyard-bench-") as tmp:
        log = Path(tmp) / "children.log"
        processes: list[subprocess.Popen[bytes]] = []
        strategy, _, mode = strategy.partition(":")
        tokenizer = write_word_tokenizer(Path(tmp) / "tokenizer") if mode == "precise" else None
        try:
            urls, events = _launch_workers(workers, sims, seed, log, processes, tokenizer)
            for url, process in zip(urls, processes, strict=True):
                await _wait_ready(url + "/health", process)
            (port,) = _free_ports(1)
            gateway_url = f"http://127.0.0.1:{port}"
            if target is not None:
                front = _launch_target(target, urls, port, log)
                processes.append(front)
                await _wait_ready(gateway_url + "/health", front, within=60.0)
            else:
                config = gateway_config(strategy, urls, sims, port, prefix_aware, events or None, tokenizer)
                gateway = _launch_gateway(config, Path(tmp), log, gateway_workers)
                processes.append(gateway)
                await _wait_ready(gateway_url + "/readyz", gateway)
            yield gateway_url
        except ModelyardError as error:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ModelyardError(f"{error.message}\n{tail}") from None
        finally:
            await asyncio.to_thread(_stop, processes)
