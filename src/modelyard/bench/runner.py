"""Sending a workload to an OpenAI-compatible URL and recording what each request saw.

Closed loop (`concurrency` clients, each sending its next request when the last one answered) or
open loop (`rate` requests per second, at most `concurrency` in flight). Bounded in count and in
time (`duration`, and a per-request timeout). Each outcome keeps the status, latency, time to
first token (streams), the backend that answered (`X-Modelyard-Backend`, when a gateway says),
and the prompt tokens the server served from cache (`usage.prompt_tokens_details.cached_tokens`,
as vLLM and the sim-worker report it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
import orjson

from modelyard.bench.workload import BenchRequest, WorkloadSpec

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int  # 0: no answer (connection failed, timed out)
    latency: float  # seconds
    ttft: float | None  # seconds to the first streamed chunk
    backend: str
    prompt_tokens: int
    cached_tokens: int
    kind: str  # the request's kind: repeat or fresh
    error: str = ""


def _usage(body: object) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    prompt = usage.get("prompt_tokens", 0)
    return (prompt if isinstance(prompt, int) else 0, cached if isinstance(cached, int) else 0)


async def _send(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    spec: WorkloadSpec,
    request: BenchRequest,
    request_timeout: float,
    scheduled: float | None = None,
) -> Outcome:
    # An open loop's latency counts from when the request was due, so waiting for a free client
    # slot shows (coordinated omission); a closed loop's from the send.
    started = scheduled if scheduled is not None else time.perf_counter()
    ttft = None
    try:
        async with http.post(
            url + CHAT_PATH,
            data=orjson.dumps(request.body(model, spec)),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=request_timeout),
        ) as response:
            backend = response.headers.get("X-Modelyard-Backend", "")
            prompt = cached = 0
            if spec.stream and response.status == 200:
                async for line in response.content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    if line.startswith(b"data: {"):
                        found = _usage(orjson.loads(line[6:]))
                        if found != (0, 0):
                            prompt, cached = found
            else:
                data = await response.read()
                if response.status == 200:
                    prompt, cached = _usage(orjson.loads(data))
            return Outcome(
                response.status, time.perf_counter() - started, ttft, backend, prompt, cached, request.kind
            )
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as error:
        return Outcome(0, time.perf_counter() - started, ttft, "", 0, 0, request.kind, type(error).__name__)


async def run_workload(
    url: str,
    model: str,
    spec: WorkloadSpec,
    requests: Iterable[BenchRequest],
    *,
    request_timeout: float = 120.0,
    progress: Callable[[Outcome], None] = lambda outcome: None,
) -> tuple[list[Outcome], float]:
    """Send `requests` until they run out or `spec.duration` is over, whichever comes first;
    returns the outcomes in completion order and the wall time the run took."""
    url = url.rstrip("/")
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    deadline = started + spec.duration if spec.duration else None
    connector = aiohttp.TCPConnector(limit=spec.concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        pending = iter(requests)

        def take() -> BenchRequest | None:
            if deadline is not None and time.perf_counter() >= deadline:
                return None
            return next(pending, None)

        async def record(request: BenchRequest, scheduled: float | None = None) -> None:
            outcome = await _send(http, url, model, spec, request, request_timeout, scheduled)
            outcomes.append(outcome)
            progress(outcome)

        if spec.rate is None:

            async def client() -> None:
                while (request := take()) is not None:
                    await record(request)

            await asyncio.gather(*(client() for _ in range(spec.concurrency)))
        else:
            slots = asyncio.Semaphore(spec.concurrency)
            tasks: set[asyncio.Task[None]] = set()
            interval = 1.0 / spec.rate
            due = time.perf_counter()
            while (request := take()) is not None:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))  # the open loop's pace
                scheduled = due
                due += interval
                await slots.acquire()  # at most `concurrency` in flight: later ones wait, and it shows

                async def one(request: BenchRequest = request, scheduled: float = scheduled) -> None:
                    try:
                        await record(request, scheduled)
                    finally:
                        slots.release()

                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - started
