"""Sending a workload to an OpenAI-compatible URL and recording what each request saw.

Closed loop (`concurrency` clients, each sending its next request when the last one answered) or
open loop (`rate` requests per second, Poisson arrivals, at most `concurrency` in flight); with
conversations, the same of whole conversations, each playing its turns in order. Bounded in count and in
time (`duration`, and a per-request timeout). Each outcome keeps the status, latency, time to
first token (streams), the backend that answered (`X-Modelyard-Backend`, when a gateway says),
and the prompt tokens the server served from cache (`usage.prompt_tokens_details.cached_tokens`,
as vLLM and the sim-worker report it).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import aiohttp
import orjson

from modelyard.bench.workload import BenchRequest, Conversation, WorkloadSpec

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
    itl: float | None = None  # a stream's mean seconds between chunks after the first (inter-token)
    text: str = ""  # the answer's text (a conversation's next turn quotes it)
    sent: float = 0.0  # seconds after the run started that it was sent (the warm-up is left out)


def _usage(body: object) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    prompt = usage.get("prompt_tokens", 0)
    return (prompt if isinstance(prompt, int) else 0, cached if isinstance(cached, int) else 0)


def _delta(chunk: object, pieces: list[str]) -> bool:
    """A stream chunk's text, added to `pieces`; whether it carried any (a token)."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choices[0].get("text")
    if isinstance(text, str) and text:
        pieces.append(text)
        return True
    return False


def _message(answer: object, pieces: list[str]) -> None:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        text = message.get("content") if isinstance(message, dict) else choices[0].get("text")
        if isinstance(text, str):
            pieces.append(text)


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
    last = first = 0.0
    chunks = 0
    pieces: list[str] = []
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
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    chunk = orjson.loads(line[6:])
                    if _delta(chunk, pieces):  # (from the first token: not a chunk with only a role)
                        if ttft is None:
                            ttft, first = now - started, now
                        last, chunks = now, chunks + 1
                    found = _usage(chunk)
                    if found != (0, 0):
                        prompt, cached = found
            else:
                data = await response.read()
                if response.status == 200:
                    answer = orjson.loads(data)
                    prompt, cached = _usage(answer)
                    _message(answer, pieces)
            itl = (last - first) / (chunks - 1) if chunks > 1 else None
            return Outcome(
                response.status, time.perf_counter() - started, ttft, backend, prompt, cached, request.kind,
                itl=itl, text="".join(pieces),
            )  # fmt: skip
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as error:
        return Outcome(0, time.perf_counter() - started, ttft, "", 0, 0, request.kind, type(error).__name__)


async def run_workload(
    url: str,
    model: str,
    spec: WorkloadSpec,
    requests: Iterable[BenchRequest] | Iterable[Conversation],
    *,
    request_timeout: float = 120.0,
    progress: Callable[[Outcome], None] = lambda outcome: None,
) -> tuple[list[Outcome], float]:
    """Send `requests` (or play `Conversation`s, turn after turn, each turn carrying the answers
    before it) until they run out, `spec.requests` requests were sent (conversations), or
    `spec.duration` is over; returns the outcomes in completion order and the wall time it took.
    Open loop (`spec.rate`): requests, or conversations, arrive as a Poisson process (seeded)."""
    url = url.rstrip("/")
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    deadline = started + spec.duration if spec.duration else None
    budget = None if spec.duration or not spec.conversations else spec.requests
    sent = 0
    arrivals = random.Random(spec.seed + 1)  # (the gaps only: a conversation's pauses are its own)
    connector = aiohttp.TCPConnector(limit=spec.concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        pending: Iterator[BenchRequest | Conversation] = iter(requests)

        def running() -> bool:
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            return budget is None or sent < budget

        def take() -> BenchRequest | Conversation | None:
            return next(pending, None) if running() else None

        # Open loop: at most `concurrency` requests in flight (a user thinking holds none); one
        # that waits for room counts its latency from when it was due, so the wait shows.
        slots = asyncio.Semaphore(spec.concurrency) if spec.rate is not None else None

        async def record(request: BenchRequest, due: float | None = None) -> Outcome | None:
            nonlocal sent
            if slots is not None:
                await slots.acquire()
            try:
                if not running():  # (checked with the slot held: the budget is never overrun)
                    return None
                sent += 1
                at = time.perf_counter() - started
                outcome = replace(await _send(http, url, model, spec, request, request_timeout, due), sent=at)
            finally:
                if slots is not None:
                    slots.release()
            outcomes.append(outcome)
            progress(outcome)
            return outcome

        async def play(item: BenchRequest | Conversation, due: float | None = None) -> None:
            if isinstance(item, BenchRequest):
                await record(item, due)
                return
            answers: list[str] = []
            for index in range(len(item.messages)):
                if index:
                    if item.pauses[index - 1]:
                        await asyncio.sleep(item.pauses[index - 1])  # the user reads, then writes
                    due = time.perf_counter() if due is not None else None  # (sent now, in an open loop)
                outcome = await record(item.turn(index, answers), due)
                if outcome is None or outcome.status != 200:
                    return  # the run is over, or a user whose turn failed does not go on
                answers.append(outcome.text)

        if spec.rate is None:

            async def client() -> None:
                while (item := take()) is not None:
                    await play(item)

            await asyncio.gather(*(client() for _ in range(spec.concurrency)))
        else:
            tasks: set[asyncio.Task[None]] = set()
            due = time.perf_counter()
            while (item := take()) is not None:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))  # the open loop's pace
                task = asyncio.create_task(play(item, due))
                due += arrivals.expovariate(spec.rate)  # Poisson arrivals
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - started
