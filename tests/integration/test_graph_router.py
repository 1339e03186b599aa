"""The stand-alone graph router over real HTTP: KServe InferenceGraph answers (compat spec 3, 4, 5, 10).

Every service is a real aiohttp server on a loopback port 0 (or a sim worker): it answers a set
status and body per path, records what it received, and can hold its answer until the test (or
another request's arrival) releases it, always within a bounded wait.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from modelyard.graph import MAX_DEPTH, GraphDocument, parse_graph
from modelyard.graph.headers import compile_patterns
from modelyard.graphrouter import RunningRouter, start_router
from modelyard.simworker import SimWorker, SimWorkerConfig

GATE_TIMEOUT = 5.0  # the longest any fixture service holds an answer
WAIT = 5.0  # the longest a test waits for an event it expects


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def error_body(cause: str) -> bytes:
    return json.dumps({"error": "Failed to process request", "cause": cause}, separators=(",", ":")).encode()


NO_MATCH = error_body("None of the routes matched with the switch condition")


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"{}"
    content_type: str | None = "application/json"
    gate: asyncio.Event | None = None  # answer only once this is set (bounded by GATE_TIMEOUT)
    echo: bool = False  # answer with the request body
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers (Location...)


@dataclass
class Received:
    method: str
    path: str
    body: bytes
    headers: CIMultiDictProxy[str]
    raw_headers: tuple[tuple[bytes, bytes], ...]


@dataclass
class Service:
    """A recording HTTP service; `url(path)` is where the graph should POST."""

    replies: dict[str, Reply] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    arrived: dict[str, asyncio.Event] = field(default_factory=dict)
    cancelled: dict[str, asyncio.Event] = field(default_factory=dict)
    finished: dict[str, asyncio.Event] = field(default_factory=dict)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def on(self, path: str, reply: Reply | None = None, **fields: Any) -> str:
        self.replies[path] = reply or Reply(**fields)
        return self.url(path)

    def event(self, kind: dict[str, asyncio.Event], path: str) -> asyncio.Event:
        return kind.setdefault(path, asyncio.Event())

    def bodies(self, path: str) -> list[bytes]:
        return [r.body for r in self.received if r.path == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        self.received.append(
            Received(request.method, path, body, request.headers, tuple(request.raw_headers))
        )
        self.event(self.arrived, path).set()
        reply = self.replies.get(path, Reply())
        try:
            if reply.gate is not None:
                try:
                    async with asyncio.timeout(GATE_TIMEOUT):
                        await reply.gate.wait()
                except TimeoutError:
                    return web.Response(status=599, text="gate timed out")
            headers = {"Content-Type": reply.content_type} if reply.content_type else {}
            headers.update(reply.headers)
            response = web.Response(
                status=reply.status, body=body if reply.echo else reply.body, headers=headers
            )
            if not reply.content_type:
                response.headers.pop("Content-Type", None)
            return response
        except asyncio.CancelledError:
            self.event(self.cancelled, path).set()
            raise
        finally:
            self.event(self.finished, path).set()


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    svc = Service()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", svc.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    svc.port = runner.addresses[0][1]
    yield svc
    await runner.cleanup()


@pytest.fixture
async def doublers() -> AsyncIterator[list[SimWorker]]:
    """Two sim workers whose KServe v1 `:predict` doubles every number."""
    workers = [
        SimWorker(
            SimWorkerConfig(port=0, prefill_ms_per_token=0, decode_ms_per_token=0, oip_scale=2.0, seed=i)
        )
        for i in range(2)
    ]
    for worker in workers:
        await worker.start()
    yield workers
    for worker in workers:
        await worker.stop()


Start = Callable[..., Any]


@pytest.fixture
async def router() -> AsyncIterator[Start]:
    """`await router(spec, services=..., patterns=..., seed=...)` starts a graph router on port 0."""
    started: list[RunningRouter] = []

    async def start(
        spec: dict[str, Any],
        *,
        name: str = "g",
        services: dict[str, str] | None = None,
        patterns: str | None = None,
        seed: int | None = None,
    ) -> RunningRouter:
        graph, _report = parse_graph(GraphDocument(name, spec, "<test>"))
        running = await start_router(
            graph,
            host="127.0.0.1",
            port=0,
            services=services,
            patterns=compile_patterns(patterns),
            seed=seed,
        )
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


@dataclass
class Answer:
    status: int
    body: bytes
    content_type: str | None
    headers: Any


async def call(
    http: aiohttp.ClientSession,
    running: RunningRouter,
    body: bytes | str = b"{}",
    *,
    method: str = "POST",
    path: str = "/",
    headers: Any = None,
) -> Answer:
    data = body.encode() if isinstance(body, str) else body
    async with http.request(method, running.url + path, data=data, headers=headers) as response:
        payload = await response.read()
        return Answer(response.status, payload, response.headers.get("Content-Type"), response.headers)


def seq(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"routerType": "Sequence", "steps": list(steps)}


def graph(root: dict[str, Any], **nodes: dict[str, Any]) -> dict[str, Any]:
    return {"nodes": {"root": root, **nodes}}


async def wait_for(event: asyncio.Event) -> None:
    async with asyncio.timeout(WAIT):
        await event.wait()


# Sequence (compat 3.1) ----------------------------------------------------------------------------


async def test_sequence_chains_sim_workers_through_map_predictions(
    router: Start, doublers: list[SimWorker], http: aiohttp.ClientSession
) -> None:
    first, second = (f"{w.url}/v1/models/m:predict" for w in doublers)
    running = await router(
        graph(
            seq(
                {"name": "x2", "serviceUrl": first},
                {"name": "x4", "serviceUrl": second, "data": "$response", "mapPredictionsToInstances": True},
            )
        )
    )
    answer = await call(http, running, b'{"instances": [1, 2.5, [3]]}')
    # x2: {"predictions":[2,5.0,[6]]} -> mapped and re-encoded by Go: {"instances":[2,5,[6]]} -> x2 again
    assert (answer.status, answer.body, answer.content_type) == (
        200,
        b'{"predictions":[4,10,[12]]}',
        "application/json",
    )


async def test_map_predictions_reencodes_like_go(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    upstream = service.on(
        "/first",
        body=b'{"predictions": [2.0, 1e21, 12345678901234567890, "<a&b>", {"y": 1, "x": 0.5}], '
        b'"instances": [0], "id": "r"}',
    )
    recorder = service.on("/second", echo=True)
    running = await router(
        graph(
            seq(
                {"serviceUrl": upstream},
                {"serviceUrl": recorder, "data": "$response", "mapPredictionsToInstances": True},
            )
        )
    )
    answer = await call(http, running, b"{}")
    mapped = b'{"instances":[2,1e+21,12345678901234567000,"\\u003ca\\u0026b\\u003e",{"x":0.5,"y":1}]}'
    assert service.bodies("/second") == [mapped]
    assert (answer.status, answer.body, answer.content_type) == (200, mapped, "application/json")


async def test_map_predictions_leaves_other_bodies_unchanged(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    upstream = service.on("/first", body=b'{"predictions": "dog"}')
    recorder = service.on("/second", echo=True)
    running = await router(
        graph(
            seq(
                {"serviceUrl": upstream},
                {"serviceUrl": recorder, "data": "$response", "mapPredictionsToInstances": True},
            )
        )
    )
    answer = await call(http, running)
    assert answer.body == b'{"predictions": "dog"}'


async def test_map_predictions_on_step_0_maps_the_graph_input(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    recorder = service.on("/r", echo=True)
    running = await router(graph(seq({"serviceUrl": recorder, "mapPredictionsToInstances": True})))
    await call(http, running, b'{"predictions": [1.0, "a"], "other": true}')
    assert service.bodies("/r") == [b'{"instances":[1,"a"]}']


async def test_response_on_step_0_is_ignored_and_default_data_is_the_node_input(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    a = service.on("/a", body=b'{"from": "a"}')
    b = service.on("/b", body=b'{"from": "b"}')
    c = service.on("/c", body=b'{"from": "c"}')
    running = await router(
        graph(
            seq(
                {"serviceUrl": a, "data": "$response"},
                {"serviceUrl": b, "data": "$request"},
                {"serviceUrl": c},
            )
        )
    )
    raw = b' {"graph": "input"}  '
    answer = await call(http, running, raw)
    assert service.bodies("/a") == [raw]
    assert service.bodies("/b") == [raw]
    assert service.bodies("/c") == [raw]
    assert (answer.status, answer.body) == (200, b'{"from": "c"}')


async def test_response_chains_the_previous_body_verbatim(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    a = service.on("/a", body=b'{ "b": 1.0,\n "a": [1] }', content_type="text/html")
    b = service.on("/b", echo=True)
    running = await router(graph(seq({"serviceUrl": a}, {"serviceUrl": b, "data": "$response"})))
    answer = await call(http, running)
    assert service.bodies("/b") == [b'{ "b": 1.0,\n "a": [1] }']
    assert (answer.status, answer.body, answer.content_type) == (
        200,
        b'{ "b": 1.0,\n "a": [1] }',
        "application/json",
    )


async def test_condition_tests_the_previous_response(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    classify = service.on("/classify", body=b'{"predictions": [{"label": "dog"}]}')
    dogs = service.on("/dogs", body=b'{"breed": "corgi"}')
    running = await router(
        graph(seq({"serviceUrl": classify}, {"serviceUrl": dogs, "condition": 'predictions.#(label=="dog")'}))
    )
    answer = await call(
        http, running, b'{"predictions": [{"label": "cat"}]}'
    )  # the input is not what is tested
    assert (answer.status, answer.body) == (200, b'{"breed": "corgi"}')
    assert service.bodies("/dogs") == [b'{"predictions": [{"label": "cat"}]}']


async def test_unmet_condition_returns_the_previous_body_with_200_even_after_a_500(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    classify = service.on("/classify", status=500, body=b'{"predictions": [{"label": "cat"}]}')
    dogs = service.on("/dogs")
    running = await router(
        graph(seq({"serviceUrl": classify}, {"serviceUrl": dogs, "condition": 'predictions.#(label=="dog")'}))
    )
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (
        200,
        b'{"predictions": [{"label": "cat"}]}',
        "application/json",
    )
    assert service.bodies("/dogs") == []


async def test_condition_on_step_0_fails_with_invalid_response(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t")
    running = await router(graph(seq({"serviceUrl": target, "condition": "@this"})))
    answer = await call(http, running, b'{"a": 1}')
    assert (answer.status, answer.body, answer.content_type) == (
        500,
        error_body("invalid response"),
        "application/json",
    )
    assert service.received == []


async def test_condition_after_a_non_json_response_fails_with_invalid_response(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    text = service.on("/text", body=b"not json", content_type="text/plain")
    target = service.on("/t")
    running = await router(graph(seq({"serviceUrl": text}, {"serviceUrl": target, "condition": "@this"})))
    answer = await call(http, running)
    assert (answer.status, answer.body) == (500, error_body("invalid response"))


async def test_hard_step_non_2xx_stops_the_sequence(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    failing = service.on("/fail", status=503, body=b"model unavailable", content_type="text/plain")
    never = service.on("/never")
    running = await router(graph(seq({"serviceUrl": failing, "dependency": "Hard"}, {"serviceUrl": never})))
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (
        503,
        b"model unavailable",
        "text/plain; charset=utf-8",
    )
    assert service.bodies("/never") == []


async def test_soft_step_non_2xx_continues_and_the_last_status_wins(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    failing = service.on("/fail", status=500, body=b'{"error": "boom"}')
    last = service.on("/last", status=404, body=b'{"detail": "not found"}')
    running = await router(
        graph(seq({"serviceUrl": failing, "dependency": "Soft"}, {"serviceUrl": last, "data": "$response"}))
    )
    answer = await call(http, running)
    assert service.bodies("/last") == [b'{"error": "boom"}']
    assert (answer.status, answer.body, answer.content_type) == (
        404,
        b'{"detail": "not found"}',
        "application/json",
    )


async def test_hard_step_2xx_continues(router: Start, service: Service, http: aiohttp.ClientSession) -> None:
    ok = service.on("/ok", status=201, body=b'{"a": 1}')
    last = service.on("/last", status=202, body=b'{"b": 2}')
    running = await router(
        graph(seq({"serviceUrl": ok, "dependency": "Hard"}, {"serviceUrl": last, "dependency": "Hard"}))
    )
    answer = await call(http, running)
    assert (answer.status, answer.body) == (202, b'{"b": 2}')


# Switch (compat 3.2) ------------------------------------------------------------------------------


def switch(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"routerType": "Switch", "steps": list(steps)}


async def test_switch_first_matching_condition_wins_and_passes_through_verbatim(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    model_2 = service.on("/model-2")
    error = service.on("/error", status=202, body=b'{ "z" : 1.0,  "a":2 }\n', content_type="text/plain")
    model_1 = service.on("/model-1", body=b'{"chosen": "model-1"}')
    running = await router(
        graph(
            switch(
                {"serviceUrl": model_2, "condition": 'instances.#(modelId=="2")'},
                {"serviceUrl": error, "condition": "[@this].#(decision_picker==ERROR)"},
                {"serviceUrl": model_1, "condition": 'instances.#(modelId=="1")'},
            )
        )
    )
    both = b'{"decision_picker": "ERROR", "instances": [{"modelId": 1}]}'
    answer = await call(http, running, both)
    assert (answer.status, answer.body, answer.content_type) == (
        202,
        b'{ "z" : 1.0,  "a":2 }\n',
        "application/json",
    )
    assert service.bodies("/error") == [both]

    answer = await call(http, running, b'{"instances": [{"modelId": 1}]}')  # "1" matches the number 1
    assert (answer.status, answer.body) == (200, b'{"chosen": "model-1"}')
    assert service.bodies("/model-2") == []


async def test_switch_chosen_step_gets_the_input_unchanged(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t", echo=True)
    running = await router(
        graph(
            switch(
                {
                    "serviceUrl": target,
                    "condition": "@this",
                    "data": "$response",
                    "mapPredictionsToInstances": True,
                    "dependency": "Hard",
                }
            )
        )
    )
    answer = await call(http, running, b'{"predictions": [1.0]}')
    assert service.bodies("/t") == [b'{"predictions": [1.0]}']
    assert answer.body == b'{"predictions": [1.0]}'


async def test_switch_non_2xx_is_returned_as_is(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t", status=500, body=b"Internal Server Error", content_type=None)
    running = await router(graph(switch({"serviceUrl": target, "condition": "@this", "dependency": "Hard"})))
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (
        500,
        b"Internal Server Error",
        "text/plain; charset=utf-8",
    )


async def test_switch_no_match_at_root_is_404(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t")
    running = await router(
        graph(
            switch(
                {"serviceUrl": target, "condition": "[@this].#(decision_picker==ERROR)"},
                {"serviceUrl": target},  # no condition: never chosen, there is no default route
            )
        )
    )
    for body in (b'{"decision_picker": "SUCCESS"}', b"not json", b"", b'{"a": NaN}'):
        answer = await call(http, running, body)
        assert (answer.status, answer.body, answer.content_type) == (404, NO_MATCH, "application/json"), body
    assert service.received == []


async def test_nested_switch_no_match_is_500(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t")
    running = await router(
        graph(
            seq({"nodeName": "pick", "dependency": "Soft"}, {"serviceUrl": target}),
            pick=switch({"serviceUrl": target, "condition": "nothing.here"}),
        )
    )
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (500, NO_MATCH, "application/json")
    assert service.received == []


@pytest.mark.parametrize(
    ("condition", "body", "chosen"),
    [
        ("a", b'{"a": null}', True),  # null exists
        ("a", b'{"a": {}}', True),
        ("a", b'{"b": 1}', False),
        ("{ .input.userId == 1 }", b'{"input": {"userId": 2}}', True),  # Go doc pseudo-syntax: always exists
        ("instances.#(strval%*red-server*)", b'{"instances": [{"strval": "a-red-server-1"}]}', True),
        ("instances.#(intval>10)", b'{"instances": [{"intval": "20"}]}', True),  # string compare: "20" > "10"
        ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", b'{"instances": [{"data": 0.1}]}', True),
    ],
)
async def test_switch_conditions_follow_go_gjson(
    router: Start, service: Service, http: aiohttp.ClientSession, condition: str, body: bytes, chosen: bool
) -> None:
    target = service.on("/t", body=b'{"chosen": true}')
    running = await router(graph(switch({"serviceUrl": target, "condition": condition})))
    answer = await call(http, running, body)
    assert (answer.status, answer.body) == ((200, b'{"chosen": true}') if chosen else (404, NO_MATCH))


# Splitter (compat 3.4) ----------------------------------------------------------------------------


async def test_splitter_distributes_by_weight_and_ignores_conditions(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    a = service.on("/a", body=b'{"model": "a"}')
    b = service.on("/b", status=201, body=b"b")
    running = await router(
        {
            "nodes": {
                "root": {
                    "routerType": "Splitter",
                    "steps": [
                        {"serviceUrl": a, "weight": 70, "condition": "never.exists"},
                        {"serviceUrl": b, "weight": 30, "condition": "never.exists"},
                    ],
                }
            }
        },
        seed=1234,
    )
    limit = asyncio.Semaphore(16)

    async def one() -> tuple[int, bytes]:
        async with limit:
            answer = await call(http, running, b'{"x": 1}')
            return answer.status, answer.body

    answers = await asyncio.gather(*(one() for _ in range(400)))
    assert set(answers) == {(200, b'{"model": "a"}'), (201, b"b")}
    to_a = answers.count((200, b'{"model": "a"}'))
    assert 240 <= to_a <= 320  # 70% of 400 = 280; 4+ standard deviations either way
    assert len(service.bodies("/a")) + len(service.bodies("/b")) == 400


# Ensemble (compat 3.3) ----------------------------------------------------------------------------


def ensemble(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"routerType": "Ensemble", "steps": list(steps)}


async def test_ensemble_merges_sorted_compact_and_reencoded(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    zeta = service.on("/zeta", body=b'{"b": 1.0, "a": "<x&y>"}')
    unnamed = service.on(
        "/unnamed", body=b'{ "n": 1e21, "m": 12345678901234567890 }', content_type="text/plain"
    )
    alpha = service.on("/alpha", body=b"null")
    running = await router(
        graph(
            ensemble(
                {"name": "zeta", "serviceUrl": zeta},
                {"serviceUrl": unnamed},
                {"name": "alpha", "serviceUrl": alpha},
            )
        )
    )
    answer = await call(http, running, b'{"in": 1}')
    assert (answer.status, answer.content_type) == (200, "application/json")
    assert answer.body == (
        b'{"1":{"m":12345678901234567000,"n":1e+21},"alpha":null,"zeta":{"a":"\\u003cx\\u0026y\\u003e","b":1}}'
    )
    for path in ("/zeta", "/unnamed", "/alpha"):
        assert service.bodies(path) == [b'{"in": 1}']


async def test_ensemble_soft_failure_is_included_with_200(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    ok = service.on("/ok", body=b'{"score": 0.5}')
    failing = service.on("/fail", status=500, body=b'{"error": "boom"}')
    running = await router(
        graph(ensemble({"name": "ok", "serviceUrl": ok}, {"name": "bad", "serviceUrl": failing}))
    )
    answer = await call(http, running)
    assert (answer.status, answer.body) == (200, b'{"bad":{"error":"boom"},"ok":{"score":0.5}}')


async def test_ensemble_hard_failure_returns_that_member_reencoded(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    ok = service.on("/ok", body=b'{"score": 0.5}')
    failing = service.on("/fail", status=503, body=b'{ "z": 1.0, "a": [1, "<"] }', content_type="text/plain")
    running = await router(
        graph(
            ensemble(
                {"name": "ok", "serviceUrl": ok, "dependency": "Hard"},
                {"serviceUrl": failing, "dependency": "Hard"},
            )
        )
    )
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (
        503,
        b'{"a":[1,"\\u003c"],"z":1}',
        "application/json",
    )


@pytest.mark.parametrize(
    ("status", "body", "cause"),
    [
        (200, b"[1, 2]", "json: cannot unmarshal array into Go value of type map[string]interface {}"),
        (200, b'"text"', "json: cannot unmarshal string into Go value of type map[string]interface {}"),
        (500, b"Internal Server Error", "invalid character 'I' looking for beginning of value"),
        (200, b"", "unexpected end of JSON input"),
    ],
)
async def test_ensemble_member_that_is_not_an_object_fails_the_node(
    router: Start, service: Service, http: aiohttp.ClientSession, status: int, body: bytes, cause: str
) -> None:
    ok = service.on("/ok", body=b'{"score": 0.5}')
    odd = service.on("/odd", status=status, body=body, content_type=None)
    running = await router(graph(ensemble({"serviceUrl": ok}, {"serviceUrl": odd, "dependency": "Soft"})))
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (500, error_body(cause), "application/json")


async def test_ensemble_member_with_an_out_of_range_number_fails_cleanly(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    odd = service.on("/odd", body=b'{"x": 1e400}')
    running = await router(graph(ensemble({"serviceUrl": odd})))
    answer = await call(http, running)
    assert (answer.status, answer.content_type) == (500, "application/json")
    failure = json.loads(answer.body)
    assert failure["error"] == "Failed to process request"
    assert failure["cause"].startswith("json: cannot unmarshal number 1e400 into Go ")


async def test_ensemble_key_collision_later_index_wins(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    first = service.on("/first", body=b'{"from": "named 1"}')
    second = service.on("/second", body=b'{"from": "index 1"}')
    running = await router(graph(ensemble({"name": "1", "serviceUrl": first}, {"serviceUrl": second})))
    answer = await call(http, running)
    assert (answer.status, answer.body) == (200, b'{"1":{"from":"index 1"}}')


async def test_ensemble_with_no_steps_is_an_empty_object(router: Start, http: aiohttp.ClientSession) -> None:
    running = await router(graph(ensemble()))
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (200, b"{}", "application/json")


async def test_ensemble_members_run_concurrently(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    # Each member answers only once the other has arrived: run one after the other, they would
    # wait out GATE_TIMEOUT and answer 599.
    a = service.on("/a", body=b'{"m": "a"}', gate=service.event(service.arrived, "/b"))
    b = service.on("/b", body=b'{"m": "b"}', gate=service.event(service.arrived, "/a"))
    running = await router(graph(ensemble({"name": "a", "serviceUrl": a}, {"name": "b", "serviceUrl": b})))
    answer = await call(http, running)
    assert (answer.status, answer.body) == (200, b'{"a":{"m":"a"},"b":{"m":"b"}}')


def _member_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "").endswith("._member")]


async def test_ensemble_hard_failure_cancels_the_slow_member(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    failing = service.on("/fail", status=400, body=b'{"error": "bad input"}')
    slow = service.on("/slow", gate=release)
    running = await router(
        graph(ensemble({"serviceUrl": failing, "dependency": "Hard"}, {"serviceUrl": slow}))
    )
    try:
        answer = await call(http, running)
        assert (answer.status, answer.body) == (400, b'{"error":"bad input"}')
        await wait_for(service.event(service.cancelled, "/slow"))  # the slow call's connection was dropped
        assert _member_tasks() == []
    finally:
        release.set()


async def test_ensemble_member_error_ends_the_node_at_once_and_cancels_the_others(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    slow = service.on("/slow", gate=release)
    broken = service.on("/broken", body=b"[]")
    running = await router(graph(ensemble({"serviceUrl": slow}, {"serviceUrl": broken})))
    try:
        answer = await call(http, running)
        assert (answer.status, answer.body) == (
            500,
            error_body("json: cannot unmarshal array into Go value of type map[string]interface {}"),
        )
        await wait_for(service.event(service.cancelled, "/slow"))
        assert _member_tasks() == []
    finally:
        release.set()


async def test_ensemble_waits_without_spinning(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    slow = service.on("/slow", body=b'{"s": 1}', gate=release)
    fast = service.on("/fast", body=b'{"f": 1}')
    running = await router(graph(ensemble({"serviceUrl": slow}, {"serviceUrl": fast})))
    request = asyncio.create_task(call(http, running))
    await wait_for(service.event(service.finished, "/fast"))
    await wait_for(service.event(service.arrived, "/slow"))
    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.get_running_loop().call_later(0.4, release.set)  # the window measured, not a race
    answer = await request
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert (answer.status, answer.body) == (200, b'{"0":{"s":1},"1":{"f":1}}')
    assert cpu < 0.5 * wall, f"{cpu:.3f}s of CPU in {wall:.3f}s waiting for one member"


# Nesting ------------------------------------------------------------------------------------------


async def test_sequence_step_into_an_ensemble_node_of_sim_workers(
    router: Start, doublers: list[SimWorker], service: Service, http: aiohttp.ClientSession
) -> None:
    recorder = service.on("/combine", echo=True)
    running = await router(
        graph(
            seq({"nodeName": "both", "dependency": "Hard"}, {"serviceUrl": recorder, "data": "$response"}),
            both=ensemble(
                {"name": "left", "serviceUrl": f"{doublers[0].url}/v1/models/left:predict"},
                {"name": "right", "serviceUrl": f"{doublers[1].url}/v1/models/right:predict"},
            ),
        )
    )
    answer = await call(http, running, b'{"instances": [[1.5, 2]]}')
    expected = b'{"left":{"predictions":[[3,4]]},"right":{"predictions":[[3,4]]}}'
    assert service.bodies("/combine") == [expected]
    assert (answer.status, answer.body, answer.content_type) == (200, expected, "application/json")


async def test_deep_nesting_runs_up_to_max_depth(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    leaf = service.on("/leaf", body=b'{"deep": true}')

    def chain(levels: int) -> dict[str, Any]:
        names = ["root", *(f"n{i}" for i in range(1, levels + 1))]
        nodes = {a: seq({"nodeName": b}) for a, b in itertools.pairwise(names)}
        nodes[names[-1]] = seq({"serviceUrl": leaf})
        return {"nodes": nodes}

    deepest = await router(chain(MAX_DEPTH))  # root at depth 0, n64 at depth 64
    answer = await call(http, deepest)
    assert (answer.status, answer.body) == (200, b'{"deep": true}')

    too_deep = await router(chain(MAX_DEPTH + 1))
    answer = await call(http, too_deep)
    assert (answer.status, answer.content_type) == (500, "application/json")
    assert json.loads(answer.body)["error"] == "Failed to process request"
    assert len(service.bodies("/leaf")) == 1


# Header propagation (compat 5) --------------------------------------------------------------------


async def test_matching_headers_reach_every_service_call(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    urls = {p: service.on(p, body=b'{"ok": 1}') for p in ("/s0", "/e0", "/e1", "/sw", "/split")}
    running = await router(
        graph(
            seq({"serviceUrl": urls["/s0"]}, {"nodeName": "ens"}, {"nodeName": "sw"}, {"nodeName": "split"}),
            ens=ensemble({"serviceUrl": urls["/e0"]}, {"serviceUrl": urls["/e1"]}),
            sw=switch({"serviceUrl": urls["/sw"], "condition": "@this"}),
            split={"routerType": "Splitter", "steps": [{"serviceUrl": urls["/split"], "weight": 100}]},
        ),
        patterns="Authorization,Test-Header-*,*Trace-Id*",
    )
    headers = [
        ("Authorization", "Bearer token"),
        ("test-header-key", "one"),  # sent in lower case; matched and forwarded as Test-Header-Key
        ("test-header-key", "two"),
        ("X-B3-Trace-Id", "abc"),  # *Trace-Id* is not a valid regexp: skipped
        ("X-Other", "no"),
    ]
    answer = await call(http, running, b'{"in": 1}', headers=headers)
    assert answer.status == 200
    assert sorted(r.path for r in service.received) == ["/e0", "/e1", "/s0", "/split", "/sw"]
    for received in service.received:
        assert received.headers.getall("Authorization") == ["Bearer token"], received.path
        assert received.headers.getall("Test-Header-Key") == ["one", "two"], received.path
        assert "X-B3-Trace-Id" not in received.headers
        assert "X-Other" not in received.headers
        assert received.headers.getall("Content-Type") == ["application/json"]
        assert received.headers["Host"] == f"127.0.0.1:{service.port}"


@pytest.mark.parametrize(
    ("patterns", "propagated"),
    [
        ("Id", True),  # unanchored: matches X-Request-Id
        ("^X-Request-Id$", True),
        ("x-request-id", False),  # case-sensitive against the canonical name
        ("^Request", False),
        (None, False),  # no PROPAGATE_HEADERS: nothing is propagated
        ("", False),
    ],
)
async def test_patterns_match_canonical_names_unanchored_and_case_sensitively(
    router: Start, service: Service, http: aiohttp.ClientSession, patterns: str | None, propagated: bool
) -> None:
    target = service.on("/t")
    running = await router(graph(seq({"serviceUrl": target})), patterns=patterns)
    await call(http, running, headers={"x-request-id": "r-1", "Authorization": "Bearer t"})
    (received,) = service.received
    assert received.headers.get("X-Request-Id") == ("r-1" if propagated else None)
    if patterns is None:
        assert "Authorization" not in received.headers


async def test_content_type_defaults_to_json_unless_propagated(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/t")
    plain = await router(graph(seq({"serviceUrl": target})), patterns="Authorization")
    await call(http, plain, b"text", headers={"Content-Type": "text/plain"})
    propagating = await router(graph(seq({"serviceUrl": target})), patterns="Content-Type")
    await call(http, propagating, b"text", headers={"Content-Type": "text/plain"})
    assert [r.headers.getall("Content-Type") for r in service.received] == [
        ["application/json"],
        ["text/plain"],
    ]
    assert [r.body for r in service.received] == [b"text", b"text"]


async def test_host_is_never_propagated(router: Start, service: Service, http: aiohttp.ClientSession) -> None:
    target = service.on("/t")
    running = await router(graph(seq({"serviceUrl": target})), patterns="Host,Authorization")
    await call(http, running, headers={"Authorization": "a"})
    (received,) = service.received
    assert received.headers.getall("Host") == [f"127.0.0.1:{service.port}"]
    assert received.headers["Authorization"] == "a"


async def test_propagating_every_header_keeps_one_content_length(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    first = service.on("/first", body=b'{"predictions": [1, 2, 3]}')
    second = service.on("/second", echo=True)
    running = await router(
        graph(
            seq(
                {"serviceUrl": first},
                {"serviceUrl": second, "data": "$response", "mapPredictionsToInstances": True},
            )
        ),
        patterns=".*",
    )
    answer = await call(http, running, b'{"x": 1}', headers={"Authorization": "a"})
    assert (answer.status, answer.body) == (200, b'{"instances":[1,2,3]}')
    for received in service.received:
        assert received.headers.getall("Content-Length") == [str(len(received.body))]


# Answers: Content-Type, paths, methods, readiness (compat 3, 3.6) --------------------------------


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"a": 1}', "application/json"),
        (b" [1, 2] \n", "application/json"),
        (b'"just a string"', "application/json"),
        (b"42", "application/json"),
        (b"plain text answer", "text/plain; charset=utf-8"),
        (b'{"a": NaN}', "text/plain; charset=utf-8"),
        (b"<html><body>hi</body></html>", "text/html; charset=utf-8"),
        (b"", None),
    ],
)
async def test_response_content_type_is_json_only_when_the_body_is_json(
    router: Start, service: Service, http: aiohttp.ClientSession, body: bytes, content_type: str | None
) -> None:
    target = service.on("/t", status=200, body=body, content_type="application/x-upstream")
    running = await router(graph(seq({"serviceUrl": target})))
    answer = await call(http, running)
    assert (answer.status, answer.body, answer.content_type) == (200, body, content_type)


async def test_any_path_and_method_runs_the_graph(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    target = service.on("/v1/models/m:predict", echo=True)
    running = await router(graph(seq({"serviceUrl": target + "?from=graph"})))
    get = await call(http, running, b"", method="GET", path="/foo?x=1")
    put = await call(http, running, b'{"put": 1}', method="PUT", path="/v2/models/x/infer")
    assert (get.status, get.body, get.content_type) == (200, b"", None)
    assert (put.status, put.body) == (200, b'{"put": 1}')
    assert [(r.method, r.path, r.body) for r in service.received] == [
        ("POST", "/v1/models/m:predict", b""),
        ("POST", "/v1/models/m:predict", b'{"put": 1}'),
    ]


async def test_readyz_then_draining(router: Start, service: Service, http: aiohttp.ClientSession) -> None:
    running = await router(graph(seq({"serviceUrl": service.on("/t")})))
    ready = await call(http, running, b"", method="GET", path="/readyz")
    assert (ready.status, ready.body, ready.content_type) == (200, b"", None)
    running.server.begin_drain()
    draining = await call(http, running, b"", method="GET", path="/readyz")
    assert (draining.status, draining.body, draining.content_type) == (
        503,
        b"shutting down\n",
        "text/plain; charset=utf-8",
    )
    still_serving = await call(http, running)
    assert still_serving.status == 200
    assert len(service.received) == 1


async def test_readyz_answers_any_method(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    running = await router(graph(seq({"serviceUrl": service.on("/t")})))
    answer = await call(http, running, b"{}", method="POST", path="/readyz")
    assert (answer.status, answer.body) == (200, b"")
    assert service.received == []


# Errors and timeouts (compat 3.0, 6) ---------------------------------------------------------------


async def test_connection_refused_reads_like_go(router: Start, http: aiohttp.ClientSession) -> None:
    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}/v1/models/m:predict"
    running = await router(graph(seq({"serviceUrl": url})))
    answer = await call(http, running)
    assert (answer.status, answer.content_type) == (500, "application/json")
    assert answer.body == error_body(f'Post "{url}": dial tcp 127.0.0.1:{port}: connect: connection refused')


async def test_error_in_a_nested_node_is_500_whatever_the_dependency(
    router: Start, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/x"
    running = await router(
        graph(seq({"nodeName": "child", "dependency": "Soft"}), child=seq({"serviceUrl": url}))
    )
    answer = await call(http, running)
    assert answer.status == 500
    assert json.loads(answer.body)["cause"].startswith(
        f'Post "{url}": dial tcp 127.0.0.1:{port}: connect: connection refused'
    )


async def test_unparsable_url_reads_like_go(router: Start, http: aiohttp.ClientSession) -> None:
    url = "http://single-1.default.{$your-domain}/switch"
    running = await router(graph(seq({"serviceUrl": url})))
    answer = await call(http, running)
    assert (answer.status, answer.body) == (
        500,
        error_body(f'parse "{url}": invalid character "{{" in host name'),
    )


async def test_service_name_steps_resolve_through_services(
    router: Start, doublers: list[SimWorker], http: aiohttp.ClientSession
) -> None:
    spec = graph(
        seq(
            {"serviceName": "doubler"},
            {"serviceName": "doubler", "data": "$response", "mapPredictionsToInstances": True},
        )
    )
    running = await router(spec, services={"doubler": f"{doublers[0].url}/v1/models/doubler:predict"})
    answer = await call(http, running, b'{"instances": [1]}')
    assert (answer.status, answer.body) == (200, b'{"predictions":[4]}')

    unresolved = await router(graph(seq({"serviceName": "unknown"})))
    answer = await call(http, unresolved)
    assert (answer.status, answer.body) == (500, error_body('Post "": unsupported protocol scheme ""'))


async def test_the_router_ignores_the_graph_timeout_as_kserve_does(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    # KServe's router never reads spec.timeout (Knative enforces it in front of the router), so
    # the drop-in answers a slow graph normally; the gateway's /v1/graphs does enforce it.
    release = asyncio.Event()
    slow = service.on("/slow", gate=release, body=b'{"late":true}')
    running = await router({**graph(seq({"serviceUrl": slow})), "timeout": 1})
    pending = asyncio.create_task(call(http, running))
    await wait_for(service.event(service.arrived, "/slow"))
    await asyncio.sleep(1.2)  # past the spec's timeout: the router must still be waiting
    assert not pending.done()
    release.set()
    answer = await pending
    assert (answer.status, answer.body) == (200, b'{"late":true}')


async def test_service_client_timeout_reads_like_go(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    slow = service.on("/slow", gate=release)
    running = await router({**graph(seq({"serviceUrl": slow})), "routerTimeouts": {"serviceClient": 1}})
    try:
        answer = await call(http, running)
        assert (answer.status, answer.body, answer.content_type) == (
            500,
            error_body(
                f'Post "{slow}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
            ),
            "application/json",
        )
        await wait_for(service.event(service.cancelled, "/slow"))
    finally:
        release.set()


async def test_server_write_timeout_closes_the_connection_and_cancels_the_call(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    # Go's WriteTimeout: the client sees the connection close, not an HTTP error.
    release = asyncio.Event()
    slow = service.on("/slow", gate=release)
    running = await router({**graph(seq({"serviceUrl": slow})), "routerTimeouts": {"serverWrite": 1}})
    try:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with http.post(running.url + "/", data=b"{}") as response:
                await response.read()
        await wait_for(service.event(service.cancelled, "/slow"))
    finally:
        release.set()


async def test_in_an_istio_mesh_https_services_are_called_over_http(
    service: Service, http: aiohttp.ClientSession
) -> None:
    # KServe's router asks the sidecar's admin port once; when it answers 200, the sidecar does TLS.
    plain = service.on("/predict", body=b'{"ok":true}')
    sidecar = service.on("/admin", body=b"")
    spec = graph(seq({"serviceUrl": plain.replace("http://", "https://")}))
    parsed, _ = parse_graph(GraphDocument("g", spec, "<test>"))
    running = await start_router(parsed, host="127.0.0.1", port=0, mesh_probe_url=sidecar)
    try:
        answer = await call(http, running)
        assert (answer.status, answer.body) == (200, b'{"ok":true}')
    finally:
        await running.stop()


async def test_outside_a_mesh_https_stays_https(service: Service, http: aiohttp.ClientSession) -> None:
    # No sidecar (refused): the https URL is called as https; a plain-HTTP server cannot answer it.
    plain = service.on("/predict", body=b'{"ok":true}')
    parsed, _ = parse_graph(
        GraphDocument("g", graph(seq({"serviceUrl": plain.replace("http://", "https://")})), "<t>")
    )
    no_sidecar = f"http://127.0.0.1:{free_port()}/"
    running = await start_router(parsed, host="127.0.0.1", port=0, mesh_probe_url=no_sidecar)
    try:
        answer = await call(http, running)
        assert answer.status == 500
        assert service.bodies("/predict") == []
    finally:
        await running.stop()


async def test_redirects_are_followed_as_gos_client_does(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    # 307 repeats the POST with its body; 302 turns it into a GET without one.
    service.on("/final", echo=True)
    kept = service.on("/moved-307", status=307, body=b"", content_type=None, headers={"Location": "/final"})
    running = await router(graph(seq({"serviceUrl": kept})))
    answer = await call(http, running, b'{"x": 1}')
    assert (answer.status, answer.body) == (200, b'{"x": 1}')
    assert [(r.method, r.body) for r in service.received if r.path == "/final"] == [("POST", b'{"x": 1}')]

    service.on("/moved-302", status=302, body=b"", content_type=None, headers={"Location": "/final"})
    running = await router(graph(seq({"serviceUrl": service.url("/moved-302")})))
    answer = await call(http, running, b'{"x": 2}')
    assert answer.status == 200 and answer.body == b""  # the echo of a GET without a body
    assert [(r.method, r.body) for r in service.received if r.path == "/final"][-1] == ("GET", b"")


async def test_a_redirect_loop_stops_after_ten_like_go(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    loop = service.on("/loop", status=307, body=b"", content_type=None, headers={"Location": "/loop"})
    running = await router(graph(seq({"serviceUrl": loop})))
    answer = await call(http, running)
    assert answer.status == 500
    assert answer.body == error_body(f'Post "{loop}": stopped after 10 redirects')
    assert len([r for r in service.received if r.path == "/loop"]) == 10


async def test_an_unparsable_service_url_answers_kserves_error_json(
    router: Start, http: aiohttp.ClientSession
) -> None:
    running = await router(graph(seq({"serviceUrl": "http://[::1/x"})))
    answer = await call(http, running)
    assert answer.status == 500 and answer.content_type == "application/json"
    failure = json.loads(answer.body)
    assert failure["error"] == "Failed to process request"
    assert failure["cause"].startswith('parse "http://[::1/x"')


async def test_service_url_paths_are_percent_encoded(
    router: Start, service: Service, http: aiohttp.ClientSession
) -> None:
    # A raw space or non-ASCII byte in the request line would be refused (400) by the server.
    service.on("/a b/é", body=b'{"ok":1}')  # the fixture keys replies by the decoded path
    running = await router(graph(seq({"serviceUrl": service.url("/a b/é")})))
    answer = await call(http, running)
    assert (answer.status, answer.body) == (200, b'{"ok":1}')
