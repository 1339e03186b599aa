"""The graph engine through its Invoker protocol, with a fake invoker and no HTTP: what a client of
KServe's router sees (status, body, Content-Type), per compat spec sections 3 and 4, plus the
gateway's additions (the graph timeout, traces, the nesting limit)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from modelyard.graph import (
    MAX_DEPTH,
    Answer,
    Graph,
    GraphDocument,
    GraphFailure,
    GraphSpec,
    InferenceStep,
    Outcome,
    RunContext,
    StepTrace,
    answer,
    parse_graph,
)

Handler = Callable[[bytes], Awaitable[Outcome]]
TEXT = "text/plain; charset=utf-8"  # what Go's sniffing says for a body that is not JSON
Reply = Outcome | GraphFailure | Handler


@dataclass
class Call:
    url: str
    body: bytes
    headers: tuple[tuple[str, str], ...]


@dataclass
class FakeInvoker:
    """Answers each serviceUrl from `replies`: a fixed Outcome, a GraphFailure to raise (no answer
    at all, as a refused connection), or an async handler of the request body."""

    replies: dict[str, Reply]
    calls: list[Call] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def call(self, step: InferenceStep, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome:
        url = step.service_url
        self.calls.append(Call(url, body, tuple(headers)))
        reply = self.replies[url]
        if isinstance(reply, GraphFailure):
            raise GraphFailure(reply.status, reply.cause)
        if isinstance(reply, Outcome):
            return reply
        try:
            return await reply(body)
        except asyncio.CancelledError:
            self.cancelled.append(url)
            raise

    def urls(self) -> list[str]:
        return [c.url for c in self.calls]


def json_reply(value: Any, status: int = 200) -> Outcome:
    return Outcome(status, orjson.dumps(value))


async def echo(body: bytes) -> Outcome:
    return Outcome(200, body)


async def never(body: bytes) -> Outcome:
    await asyncio.get_running_loop().create_future()  # nothing ever resolves it
    raise AssertionError("unreachable")


class FixedPoint(random.Random):
    """An RNG whose Splitter draw is `point`; it checks the draw is over [0, 100) as KServe's."""

    def __init__(self, point: int) -> None:
        super().__init__(0)
        self.point = point

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        assert (start, stop, step) == (100, None, 1)
        return self.point


def build(nodes: dict[str, Any], **spec: Any) -> Graph:
    """A graph that passes validation, as every served graph does."""
    graph, report = parse_graph(GraphDocument("g", {"nodes": nodes, **spec}, "test"))
    assert report.ok
    return graph


def unchecked(nodes: dict[str, Any]) -> Graph:
    """A graph validation would refuse, to see what the engine itself does with it."""
    return Graph("g", GraphSpec.model_validate({"nodes": nodes}))


def step(url: str, **fields: Any) -> dict[str, Any]:
    return {"serviceUrl": url, **fields}


async def run(
    graph: Graph,
    body: bytes,
    invoker: FakeInvoker,
    *,
    rng: random.Random | None = None,
    headers: Sequence[tuple[str, str]] = (),
    trace: list[StepTrace] | None = None,
    observe: Any = None,
    enforce_timeout: bool = True,
) -> Answer:
    ctx = RunContext(invoker, headers, rng or random.Random(0), trace, observe, enforce_timeout)
    result: Outcome | GraphFailure
    try:
        result = await graph.run(body, ctx)
    except GraphFailure as failure:
        result = failure
    return answer(result)


def failure(status: int, cause: str) -> Answer:
    body = orjson.dumps({"error": "Failed to process request", "cause": cause})
    return Answer(status, body, "application/json")


# --- Sequence (3.1) -----------------------------------------------------------------------------


async def test_sequence_feeds_response_or_request_by_data() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    step("http://a/", data="$response"),  # step 0: $response means the input
                    step("http://b/", data="$response"),
                    step("http://c/", data="$request"),
                    step("http://d/"),
                ],
            }
        }
    )
    invoker = FakeInvoker(
        {
            "http://a/": json_reply({"from": "a"}),
            "http://b/": json_reply({"from": "b"}),
            "http://c/": json_reply({"from": "c"}),
            "http://d/": Outcome(201, b"last, verbatim "),
        }
    )
    result = await run(graph, b'{"in": 1}', invoker)
    assert [c.body for c in invoker.calls] == [b'{"in": 1}', b'{"from":"a"}', b'{"in": 1}', b'{"in": 1}']
    assert result == Answer(201, b"last, verbatim ", TEXT)


async def test_sequence_maps_predictions_to_instances() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    step("http://a/"),
                    step("http://b/", data="$response", mapPredictionsToInstances=True),
                ],
            }
        }
    )
    invoker = FakeInvoker(
        {"http://a/": json_reply({"predictions": [1, "<x>"], "model": "a"}), "http://b/": echo}
    )
    result = await run(graph, b"{}", invoker)
    assert invoker.calls[1].body == b'{"instances":[1,"\\u003cx\\u003e"]}'
    assert (result.status, result.body) == (200, b'{"instances":[1,"\\u003cx\\u003e"]}')


@pytest.mark.parametrize(
    ("first", "expected_calls", "expected"),
    [
        # the condition tests the previous response; met: the step runs
        (json_reply({"label": "dog"}), ["http://a/", "http://b/"], Answer(200, b"from b", TEXT)),
        # unmet: stop and answer the previous body with 200, even after a non-2xx
        (
            json_reply({"label": "cat"}, 503),
            ["http://a/"],
            Answer(200, b'{"label":"cat"}', "application/json"),
        ),
        # the previous response is not JSON: the node fails
        (Outcome(200, b"not json"), ["http://a/"], failure(500, "invalid response")),
    ],
    ids=["met", "unmet", "not-json"],
)
async def test_sequence_condition_on_the_previous_response(
    first: Outcome, expected_calls: list[str], expected: Answer
) -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [step("http://a/"), step("http://b/", condition='[@this].#(label=="dog")')],
            }
        }
    )
    invoker = FakeInvoker({"http://a/": first, "http://b/": Outcome(200, b"from b")})
    result = await run(graph, b'{"label": "dog"}', invoker)  # the input would always match
    assert invoker.urls() == expected_calls
    assert result == expected


async def test_sequence_condition_on_step_zero_fails_before_any_call() -> None:
    graph = build({"root": {"routerType": "Sequence", "steps": [step("http://a/", condition="@this")]}})
    invoker = FakeInvoker({"http://a/": echo})
    assert await run(graph, b"{}", invoker) == failure(500, "invalid response")
    assert invoker.calls == []


@pytest.mark.parametrize(
    ("dependency", "expected_calls", "expected"),
    [
        ("Hard", ["http://a/"], Answer(503, b'{"down":true}', "application/json")),
        ("Soft", ["http://a/", "http://b/"], Answer(200, b'{"down":true}', "application/json")),
        ("", ["http://a/", "http://b/"], Answer(200, b'{"down":true}', "application/json")),
    ],
)
async def test_sequence_non_2xx_stops_only_a_hard_step(
    dependency: str, expected_calls: list[str], expected: Answer
) -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [step("http://a/", dependency=dependency), step("http://b/", data="$response")],
            }
        }
    )
    invoker = FakeInvoker({"http://a/": json_reply({"down": True}, 503), "http://b/": echo})
    result = await run(graph, b"{}", invoker)
    assert invoker.urls() == expected_calls
    assert result == expected


async def test_sequence_last_status_is_the_answer_even_non_2xx() -> None:
    graph = build({"root": {"routerType": "Sequence", "steps": [step("http://a/"), step("http://b/")]}})
    invoker = FakeInvoker({"http://a/": json_reply({}), "http://b/": Outcome(502, b"bad gateway")})
    assert await run(graph, b"{}", invoker) == Answer(502, b"bad gateway", TEXT)


@pytest.mark.parametrize("dependency", ["Soft", "Hard"])
async def test_sequence_step_error_fails_at_once_whatever_the_dependency(dependency: str) -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [step("http://a/", dependency=dependency), step("http://b/")],
            }
        }
    )
    refused = 'Post "http://a/": dial tcp 127.0.0.1:1: connect: connection refused'
    invoker = FakeInvoker({"http://a/": GraphFailure(500, refused), "http://b/": echo})
    assert await run(graph, b"{}", invoker) == failure(500, refused)
    assert invoker.urls() == ["http://a/"]


async def test_sequence_without_steps_answers_status_zero() -> None:
    # KServe then panics on WriteHeader(0); validation refuses such a graph before it is served.
    result = await run(unchecked({"root": {"routerType": "Sequence"}}), b"{}", FakeInvoker({}))
    assert (result.status, result.body) == (0, b"")


# --- Switch (3.2) ----------------------------------------------------------------------------------

SWITCH = {
    "root": {
        "routerType": "Switch",
        "steps": [
            step("http://one/", condition='instances.#(modelId=="1")'),
            step("http://catch-all/", condition="@this"),
        ],
    }
}


@pytest.mark.parametrize(
    ("body", "chosen"),
    [
        (b'{"instances":[{"modelId":1}]}', "http://one/"),  # the first condition that exists wins
        (b'{"instances":[{"modelId":2}]}', "http://catch-all/"),
        (b"null", "http://catch-all/"),  # @this exists on any JSON, null included
    ],
)
async def test_switch_takes_the_first_matching_step_with_the_same_input(body: bytes, chosen: str) -> None:
    invoker = FakeInvoker({"http://one/": echo, "http://catch-all/": echo})
    result = await run(build(SWITCH), body, invoker)
    assert [(c.url, c.body) for c in invoker.calls] == [(chosen, body)]
    assert result.body == body


@pytest.mark.parametrize(
    "body",
    [
        b'{"other": 1}',
        b"not json",  # input that is not JSON matches nothing
        b"",
        b'{"a": NaN}',
    ],
)
async def test_switch_without_a_match_is_404_at_the_root(body: bytes) -> None:
    graph = build(
        {
            "root": {
                "routerType": "Switch",
                "steps": [step("http://a/", condition="a"), step("http://b/")],  # no condition: never
            }
        }
    )
    invoker = FakeInvoker({"http://a/": echo, "http://b/": echo})
    result = await run(graph, body, invoker)
    assert result == failure(404, "None of the routes matched with the switch condition")
    assert invoker.calls == []


async def test_switch_without_a_match_is_500_in_a_child_node_even_for_a_soft_step() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [{"nodeName": "pick", "dependency": "Soft"}, step("http://after/")],
            },
            "pick": {"routerType": "Switch", "steps": [step("http://a/", condition="a")]},
        }
    )
    invoker = FakeInvoker({"http://a/": echo, "http://after/": echo})
    result = await run(graph, b'{"b": 1}', invoker)
    assert result == failure(500, "None of the routes matched with the switch condition")
    assert invoker.calls == []


async def test_switch_returns_a_non_2xx_answer_as_it_is_even_from_a_hard_step() -> None:
    graph = build(
        {"root": {"routerType": "Switch", "steps": [step("http://a/", condition="a", dependency="Hard")]}}
    )
    invoker = FakeInvoker({"http://a/": json_reply({"error": "overloaded"}, 429)})
    assert await run(graph, b'{"a": 0}', invoker) == Answer(
        429, b'{"error":"overloaded"}', "application/json"
    )


# --- Splitter (3.4) ------------------------------------------------------------------------------

SPLITTER = {
    "root": {
        "routerType": "Splitter",
        "steps": [
            step("http://a/", weight=20),
            step("http://b/", weight=30, condition="never.there"),  # a Splitter ignores conditions
            step("http://c/", weight=50),
        ],
    }
}


@pytest.mark.parametrize(
    ("point", "chosen"),
    [
        (0, "http://a/"),
        (19, "http://a/"),
        (20, "http://b/"),
        (49, "http://b/"),
        (50, "http://c/"),
        (99, "http://c/"),
    ],
)
async def test_splitter_picks_the_first_step_whose_running_weight_exceeds_the_draw(
    point: int, chosen: str
) -> None:
    invoker = FakeInvoker({url: echo for url in ("http://a/", "http://b/", "http://c/")})
    result = await run(build(SPLITTER), b'{"x": 1}', invoker, rng=FixedPoint(point))
    assert [(c.url, c.body) for c in invoker.calls] == [(chosen, b'{"x": 1}')]
    assert result.body == b'{"x": 1}'


async def test_splitter_shares_traffic_by_weight() -> None:
    invoker = FakeInvoker({url: echo for url in ("http://a/", "http://b/", "http://c/")})
    graph, rng, draws = build(SPLITTER), random.Random(7), 4000
    for _ in range(draws):
        await run(graph, b"{}", invoker, rng=rng)
    counts = Counter(invoker.urls())
    for url, weight in (("http://a/", 20), ("http://b/", 30), ("http://c/", 50)):
        assert abs(counts[url] / draws - weight / 100) < 0.03, counts


async def test_splitter_draw_past_the_weights_fails() -> None:
    # weights under 100 only get past a bypassed webhook; KServe answers 500 for those draws
    graph = unchecked({"root": {"routerType": "Splitter", "steps": [step("http://a/", weight=60)]}})
    invoker = FakeInvoker({"http://a/": echo})
    assert (await run(graph, b"{}", invoker, rng=FixedPoint(59))).status == 200
    assert await run(graph, b"{}", invoker, rng=FixedPoint(60)) == failure(
        500, "no route was selected by the splitter"
    )


# --- Ensemble (3.3) --------------------------------------------------------------------------------


async def test_ensemble_merges_members_by_name_or_index_as_go_marshals() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Ensemble",
                "steps": [
                    step("http://a/", name="tree"),
                    step("http://b/"),
                    step("http://c/", name="nothing"),
                ],
            }
        }
    )
    invoker = FakeInvoker(
        {
            "http://a/": Outcome(200, b'{"z": 1.0, "a": "<b>", "n": 12345678901234567890}'),
            "http://b/": json_reply({"error": "soft failure"}, 500),  # Soft: included, node still 200
            "http://c/": Outcome(200, b"null"),
        }
    )
    result = await run(graph, b'{"in": 1}', invoker)
    assert sorted(c.body for c in invoker.calls) == [b'{"in": 1}'] * 3
    assert result == Answer(
        200,
        b'{"1":{"error":"soft failure"},"nothing":null,'
        b'"tree":{"a":"\\u003cb\\u003e","n":12345678901234567000,"z":1}}',
        "application/json",
    )


async def test_ensemble_without_steps_is_an_empty_object() -> None:
    assert await run(build({"root": {"routerType": "Ensemble"}}), b"{}", FakeInvoker({})) == Answer(
        200, b"{}", "application/json"
    )


async def test_ensemble_calls_its_members_concurrently() -> None:
    arrived = {"http://a/": asyncio.Event(), "http://b/": asyncio.Event()}

    def meet(me: str, other: str) -> Handler:
        async def handler(body: bytes) -> Outcome:
            arrived[me].set()
            await arrived[other].wait()  # only returns if the other call started meanwhile
            return json_reply({"me": me})

        return handler

    graph = build({"root": {"routerType": "Ensemble", "steps": [step("http://a/"), step("http://b/")]}})
    invoker = FakeInvoker(
        {"http://a/": meet("http://a/", "http://b/"), "http://b/": meet("http://b/", "http://a/")}
    )
    async with asyncio.timeout(5):  # one call after the other would never finish
        result = await run(graph, b"{}", invoker)
    assert result.body == b'{"0":{"me":"http://a/"},"1":{"me":"http://b/"}}'


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # the first Hard non-2xx in step order answers, re-encoded, with its own status
        (
            json_reply({"x": 1}, 200),
            Outcome(503, b'{ "busy" : true, "a": 1.0 }'),
            Answer(503, b'{"a":1,"busy":true}', "application/json"),
        ),
        (
            json_reply({"first": 1}, 502),
            json_reply({"second": 1}, 503),
            Answer(502, b'{"first":1}', "application/json"),
        ),
        # null from a Hard member re-encodes as null
        (json_reply({}, 200), Outcome(500, b"null"), Answer(500, b"null", "application/json")),
    ],
)
async def test_ensemble_hard_member_non_2xx_answers_for_the_node(
    a: Outcome, b: Outcome, expected: Answer
) -> None:
    graph = build(
        {
            "root": {
                "routerType": "Ensemble",
                "steps": [step("http://a/", dependency="Hard"), step("http://b/", dependency="Hard")],
            }
        }
    )
    assert await run(graph, b"{}", FakeInvoker({"http://a/": a, "http://b/": b})) == expected


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        (b"Internal Server Error", "invalid character 'I' looking for beginning of value"),
        (b"[1, 2]", "json: cannot unmarshal array into Go value of type map[string]interface {}"),
        (b'"text"', "json: cannot unmarshal string into Go value of type map[string]interface {}"),
    ],
)
async def test_ensemble_member_that_is_not_a_json_object_fails_the_node(body: bytes, cause: str) -> None:
    # even from a Soft member, and even with a 5xx status
    graph = build({"root": {"routerType": "Ensemble", "steps": [step("http://a/"), step("http://b/")]}})
    invoker = FakeInvoker({"http://a/": json_reply({}), "http://b/": Outcome(500, body)})
    assert await run(graph, b"{}", invoker) == failure(500, cause)


async def test_ensemble_member_error_ends_the_node_at_once_and_cancels_the_rest() -> None:
    graph = build({"root": {"routerType": "Ensemble", "steps": [step("http://slow/"), step("http://down/")]}})
    invoker = FakeInvoker({"http://slow/": never, "http://down/": GraphFailure(500, "connection refused")})
    async with asyncio.timeout(5):  # waiting on member 0 must not hide member 1's error
        result = await run(graph, b"{}", invoker)
    assert result == failure(500, "connection refused")
    assert invoker.cancelled == ["http://slow/"]


async def test_ensemble_hard_failure_cancels_members_still_running() -> None:
    # KServe leaks those goroutines; here they are cancelled
    graph = build(
        {
            "root": {
                "routerType": "Ensemble",
                "steps": [step("http://a/", dependency="Hard"), step("http://slow/")],
            }
        }
    )
    invoker = FakeInvoker({"http://a/": json_reply({"no": 1}, 503), "http://slow/": never})
    async with asyncio.timeout(5):
        assert await run(graph, b"{}", invoker) == Answer(503, b'{"no":1}', "application/json")
    assert invoker.cancelled == ["http://slow/"]


# --- nested nodes, headers, unknown nodes, depth ------------------------------------------------


async def test_nested_nodes_get_the_step_request_and_every_call_gets_the_headers() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [step("http://first/"), {"nodeName": "both", "data": "$response"}],
            },
            "both": {"routerType": "Ensemble", "steps": [step("http://a/", name="a"), {"nodeName": "pick"}]},
            "pick": {"routerType": "Switch", "steps": [step("http://b/", condition="step")]},
        }
    )
    invoker = FakeInvoker({"http://first/": json_reply({"step": 1}), "http://a/": echo, "http://b/": echo})
    headers = [("X-Request-Id", "42"), ("Authorization", "Bearer t")]
    result = await run(graph, b'{"in": 0}', invoker, headers=headers)
    assert sorted((c.url, c.body) for c in invoker.calls) == [
        ("http://a/", b'{"step":1}'),
        ("http://b/", b'{"step":1}'),
        ("http://first/", b'{"in": 0}'),
    ]
    assert all(c.headers == tuple(headers) for c in invoker.calls)
    assert result == Answer(200, b'{"1":{"step":1},"a":{"step":1}}', "application/json")


async def test_a_node_name_that_names_no_node_fails_like_kserve() -> None:
    graph = unchecked({"root": {"routerType": "Sequence", "steps": [{"nodeName": "ghost"}]}})
    assert await run(graph, b"{}", FakeInvoker({})) == failure(500, "invalid route type: ")


async def test_a_cycle_fails_the_request_at_the_depth_limit() -> None:
    # KServe recurses until Go's stack overflows and the whole router dies
    graph = unchecked({"root": {"routerType": "Sequence", "steps": [{"nodeName": "root"}]}})
    trace: list[StepTrace] = []
    result = await run(graph, b"{}", FakeInvoker({}), trace=trace)
    assert result == failure(500, f"graph nesting deeper than {MAX_DEPTH} nodes at node 'root'")
    assert len(trace) == MAX_DEPTH + 1


# --- timeouts: the gateway enforces spec.timeout (KServe's router never reads it) ---------------


async def test_graph_timeout_cancels_pending_calls_and_answers_504() -> None:
    graph = build(
        {"root": {"routerType": "Ensemble", "steps": [step("http://fast/"), step("http://stuck/")]}},
        timeout=1,
    )
    invoker = FakeInvoker({"http://fast/": json_reply({}), "http://stuck/": never})
    async with asyncio.timeout(10):
        result = await run(graph, b"{}", invoker)
    assert result == failure(504, "graph 'g' did not finish within its timeout of 1s")
    assert invoker.cancelled == ["http://stuck/"]


async def test_graph_timeout_is_not_enforced_where_kserve_compatibility_asks() -> None:
    release = asyncio.Event()

    async def held(body: bytes) -> Outcome:
        await release.wait()
        return Outcome(200, b"late")

    graph = build({"root": {"routerType": "Sequence", "steps": [step("http://held/")]}}, timeout=1)
    invoker = FakeInvoker({"http://held/": held})
    running = asyncio.ensure_future(run(graph, b"{}", invoker, enforce_timeout=False))
    done, _ = await asyncio.wait({running}, timeout=1.5)  # past the graph's timeout, still running
    assert not done
    release.set()
    assert (await running).body == b"late"
    assert invoker.cancelled == []


# --- trace and observe ------------------------------------------------------------------------------


async def test_trace_and_observe_see_every_step_inner_first() -> None:
    graph = build(
        {
            "root": {
                "routerType": "Sequence",
                "steps": [step("http://a/", name="first"), {"nodeName": "child"}, step("http://down/")],
            },
            "child": {"routerType": "Splitter", "steps": [step("http://b/", name="only", weight=100)]},
        }
    )
    invoker = FakeInvoker(
        {
            "http://a/": json_reply({}),
            "http://b/": json_reply({}, 503),
            "http://down/": GraphFailure(500, "connection refused"),
        }
    )
    trace: list[StepTrace] = []
    observed: list[tuple[str, str, int, float]] = []
    result = await run(graph, b"{}", invoker, trace=trace, observe=lambda *event: observed.append(event))
    assert result == failure(500, "connection refused")
    expected = [
        ("root", "first", "http://a/", 200),
        ("child", "only", "http://b/", 503),
        ("root", "1", "child", 503),  # an unnamed step is labelled by its index; its target is the node
        ("root", "2", "http://down/", 500),  # no answer at all is traced as 500
    ]
    assert [(t.node, t.step, t.target, t.status) for t in trace] == expected
    assert all(t.ms >= 0 for t in trace)
    assert [(node, label, status) for node, label, status, _ in observed] == [
        (node, label, status) for node, label, _, status in expected
    ]
    assert all(seconds >= 0 for *_, seconds in observed)


async def test_no_trace_or_observer_is_required() -> None:
    graph = build({"root": {"routerType": "Sequence", "steps": [step("http://a/")]}})
    assert await run(graph, b"[1]", FakeInvoker({"http://a/": echo})) == Answer(
        200, b"[1]", "application/json"
    )
