"""Running a graph: KServe's router semantics, node by node (compat spec section 3).

The engine does no I/O of its own: service calls go through an `Invoker`, randomness comes from
the RNG it is given, and the clock from the caller's timeout. It answers `Outcome(status, body)`
or raises `GraphFailure(status, cause)`, which the server renders as KServe's error JSON.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from modelyard.graph import go_json
from modelyard.graph.condition import Condition, compile_condition, condition_exists, parse_json_strict
from modelyard.graph.model import ROOT, GraphSpec, InferenceRouter, InferenceStep

MAX_DEPTH = 64  # nested node calls; KServe has no limit and dies of stack overflow


class GraphFailure(Exception):
    """A failed run: KServe answers `status` (500, or 404 for a root Switch with no match) and
    `{"error":"Failed to process request","cause":<cause>}`."""

    def __init__(self, status: int, cause: str) -> None:
        super().__init__(cause)
        self.status = status
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    body: bytes


class Invoker(Protocol):
    """Calls one step's service. Returns (status, body) for any HTTP answer, 5xx included;
    raises GraphFailure(500, cause) when there is no answer (refused, timed out, bad URL)."""

    async def call(self, step: InferenceStep, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome: ...


class StepSpan(Protocol):
    """A traced step (telemetry/graph.py): `headers` are the step's call headers with its trace
    context; `nested` traces the steps of the node a step runs; `end` records the status."""

    @property
    def headers(self) -> Sequence[tuple[str, str]]: ...

    def nested(self) -> StepSpans: ...
    def end(self, status: int) -> None: ...


class StepSpans(Protocol):
    """Where step spans come from, when the caller traces (the engine itself does no I/O)."""

    def start(
        self, node: str, step: str, router_type: str, target: str, headers: Sequence[tuple[str, str]]
    ) -> StepSpan: ...


@dataclass(slots=True)
class StepTrace:
    node: str
    step: str
    target: str
    status: int
    ms: float


@dataclass(slots=True)
class RunContext:
    invoker: Invoker
    headers: Sequence[tuple[str, str]]  # propagated to every service call
    rng: random.Random
    trace: list[StepTrace] | None = None
    observe: Any = None  # optional callable(node, step_name, status, seconds) for metrics
    enforce_timeout: bool = True  # the gateway enforces spec.timeout; KServe's router never reads it
    spans: StepSpans | None = None  # tracing on: a span per step, its context sent with the call


class Graph:
    """A validated graph with its conditions compiled once. Build with `validate_graph` first."""

    def __init__(self, name: str, spec: GraphSpec) -> None:
        self.name = name
        self.spec = spec
        self.conditions: dict[tuple[str, int], Condition] = {
            (node_name, i): compile_condition(step.condition)
            for node_name, node in spec.nodes.items()
            for i, step in enumerate(node.steps)
            if step.condition
        }

    @property
    def timeout(self) -> float | None:
        return float(self.spec.timeout) if self.spec.timeout else None

    async def run(self, body: bytes, ctx: RunContext) -> Outcome:
        """Run from `root`. The graph's `timeout` is enforced (KServe ignores it): past it every
        pending call is cancelled and the run fails with 504."""
        timeout = self.timeout if ctx.enforce_timeout else None
        if timeout is None or timeout <= 0:
            return await self._node(ROOT, body, ctx, 0)
        try:
            async with asyncio.timeout(timeout):
                return await self._node(ROOT, body, ctx, 0)
        except TimeoutError:
            raise GraphFailure(
                504, f"graph {self.name!r} did not finish within its timeout of {timeout:g}s"
            ) from None

    async def _node(self, name: str, data: bytes, ctx: RunContext, depth: int) -> Outcome:
        node = self.spec.nodes.get(name)
        if node is None or not node.router_type:
            raise GraphFailure(500, f"invalid route type: {node.router_type if node else ''}")
        if depth > MAX_DEPTH:
            raise GraphFailure(500, f"graph nesting deeper than {MAX_DEPTH} nodes at node {name!r}")
        if node.router_type == "Sequence":
            return await self._sequence(name, node, data, ctx, depth)
        if node.router_type == "Switch":
            return await self._switch(name, node, data, ctx, depth)
        if node.router_type == "Ensemble":
            return await self._ensemble(name, node, data, ctx, depth)
        return await self._splitter(name, node, data, ctx, depth)

    async def _step(
        self, node: str, index: int, step: InferenceStep, data: bytes, ctx: RunContext, depth: int
    ) -> Outcome:
        started = time.perf_counter()
        status = 500
        label = step.name or str(index)
        span = None
        headers = ctx.headers
        if ctx.spans is not None:
            span = ctx.spans.start(node, label, self.spec.nodes[node].router_type, step.target, headers)
            headers = span.headers
        try:
            if step.node_name:
                inner = ctx if span is None else replace(ctx, spans=span.nested())
                try:
                    outcome = await self._node(step.node_name, data, inner, depth + 1)
                except GraphFailure as failure:
                    raise GraphFailure(500, failure.cause) from None  # a child's 404 becomes 500
            else:
                outcome = await ctx.invoker.call(step, data, headers)
            status = outcome.status
            return outcome
        finally:
            if span is not None:
                span.end(status)
            seconds = time.perf_counter() - started
            if ctx.trace is not None:
                ctx.trace.append(StepTrace(node, label, step.target, status, round(seconds * 1000, 3)))
            if ctx.observe is not None:
                ctx.observe(node, label, status, seconds)

    async def _sequence(
        self, name: str, node: InferenceRouter, data: bytes, ctx: RunContext, depth: int
    ) -> Outcome:
        previous = Outcome(0, b"")
        for i, step in enumerate(node.steps):
            request = previous.body if step.data == "$response" and i > 0 else data
            if step.map_predictions_to_instances:
                predictions = go_json.decode_predictions(request)
                if predictions is not None:
                    request = go_json.marshal({"instances": predictions})
            if step.condition:
                exists = condition_exists(self.conditions[(name, i)], previous.body)
                if exists is None:
                    raise GraphFailure(500, "invalid response")
                if not exists:
                    return Outcome(200, previous.body)
            previous = await self._step(name, i, step, request, ctx, depth)
            if step.hard and not _ok(previous.status):
                return previous
        return previous

    async def _switch(
        self, name: str, node: InferenceRouter, data: bytes, ctx: RunContext, depth: int
    ) -> Outcome:
        valid, document = parse_json_strict(data)  # KServe: input that is not JSON matches nothing
        if valid:
            for i, step in enumerate(node.steps):
                if step.condition and self.conditions[(name, i)].exists(document):
                    return await self._step(name, i, step, data, ctx, depth)
        raise GraphFailure(404, "None of the routes matched with the switch condition")

    async def _splitter(
        self, name: str, node: InferenceRouter, data: bytes, ctx: RunContext, depth: int
    ) -> Outcome:
        point = ctx.rng.randrange(100)
        end = 0
        for i, step in enumerate(node.steps):
            end += step.weight or 0
            if point < end:
                return await self._step(name, i, step, data, ctx, depth)
        raise GraphFailure(500, "no route was selected by the splitter")

    async def _ensemble(
        self, name: str, node: InferenceRouter, data: bytes, ctx: RunContext, depth: int
    ) -> Outcome:
        tasks = [
            asyncio.create_task(self._member(name, i, step, data, ctx, depth))
            for i, step in enumerate(node.steps)
        ]
        try:
            merged: dict[str, Any] = {}
            for i, (step, task) in enumerate(zip(node.steps, tasks, strict=True)):
                # While waiting for member i, a failure of any member ends the node at once.
                while not task.done():
                    pending = [t for t in tasks if not t.done()]
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for finished in tasks:
                        if finished.done() and not finished.cancelled() and finished.exception() is not None:
                            raise finished.exception()  # type: ignore[misc]
                status, decoded = task.result()
                if step.hard and not _ok(status):
                    return Outcome(status, go_json.marshal(decoded))
                merged[step.name or str(i)] = decoded
            return Outcome(200, go_json.marshal(merged))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _member(
        self, name: str, index: int, step: InferenceStep, data: bytes, ctx: RunContext, depth: int
    ) -> tuple[int, Any]:
        outcome = await self._step(name, index, step, data, ctx, depth)
        try:
            return outcome.status, go_json.decode_object(outcome.body)
        except go_json.GoJsonError as exc:
            raise GraphFailure(500, str(exc)) from None


def _ok(status: int) -> bool:
    return 200 <= status <= 299
