"""Tracing as a user sees it: a gateway with telemetry on exports its spans over OTLP/HTTP to a
real receiver (tests/otlp_receiver.py), joins the client's trace, and hands each backend the
context of the try that called it. Export is made deterministic with the tracer's force_flush
(run off the loop: the exporter posts to a receiver served by this same loop)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from modelyard.config import validate_config
from modelyard.gateway import GATEWAY, RunningGateway, start_gateway
from modelyard.state.memory import MemoryState
from otlp_receiver import OtlpReceiver, ReceivedSpan
from raw_http import request as raw_request
from raw_http import send
from support import (
    ONE_SLOT,
    cancel_while_queued,
    free_ports,
    metric_value,
    model_config,
    sim_stats,
    wait_until,
)

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"

GRAPH = {
    "nodes": {
        "root": {
            "routerType": "Sequence",
            "steps": [
                {"name": "first", "serviceName": "m"},
                {"name": "second", "nodeName": "inner"},
            ],
        },
        "inner": {"routerType": "Sequence", "steps": [{"name": "only", "serviceName": "m"}]},
    }
}


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    started = await OtlpReceiver().start()
    yield started
    await started.stop()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


async def grpc_infer(port: int | None, headers: dict[str, str] | None = None) -> None:
    """One ModelInfer of model `echo` through the gateway's gRPC port, with tritonclient."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        tensor = grpcclient.InferInput("x", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        await asyncio.to_thread(client.infer, "echo", [tensor], headers=headers, client_timeout=10)
    finally:
        await asyncio.to_thread(client.close)


async def flush(gateway: RunningGateway) -> None:
    tracer = gateway.app[GATEWAY].tracer
    assert tracer is not None
    assert await asyncio.to_thread(tracer.force_flush)


def ids(traceparent: str) -> tuple[str, str]:
    """A traceparent's trace id and parent (span) id; its flags are the SDK's (sampled, and
    W3C level 2's random trace id bit for a trace the gateway began)."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1
    return trace_id, span_id


def only(spans: list[ReceivedSpan]) -> ReceivedSpan:
    assert len(spans) == 1, spans
    return spans[0]


async def test_the_request_span_joins_the_clients_trace_and_the_backend_gets_the_tries_context(
    sim_workers, gateways, http, receiver
):
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    headers = {"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "traced-1"}
    async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
        assert response.status == 200
        await response.read()
    await flush(gateway)

    assert receiver.content_types == ["application/x-protobuf"]
    request = only([s for s in receiver.spans if s.kind == "server"])
    assert (request.service, request.name) == ("modelyard-gateway", "POST m")
    assert (request.trace_id, request.parent_span_id) == (TRACE_ID, CLIENT_SPAN)
    assert request.attributes == {
        "http.request.method": "POST",
        "url.path": CHAT,
        "modelyard.model": "m",
        "modelyard.route": "default",
        "modelyard.subset": "*",  # the default route: every subset
        "modelyard.strategy": "round_robin",
        "modelyard.request_id": "traced-1",
        "modelyard.backend": "w0",
        "modelyard.attempts": 1,
        "http.response.status_code": 200,
    }
    assert not request.error
    attempt = only(receiver.children(request))
    assert (attempt.kind, attempt.name, attempt.trace_id) == ("client", "POST w0", TRACE_ID)
    assert attempt.attributes["url.full"] == worker.url + CHAT
    assert attempt.attributes["modelyard.retry"] == 0
    assert attempt.attributes["http.response.status_code"] == 200
    # The backend was called with the try's context, not the client's.
    assert (await sim_stats(http, worker))["traceparents"] == [f"00-{TRACE_ID}-{attempt.span_id}-01"]


async def test_a_request_without_traceparent_starts_a_trace_the_backend_joins(
    sim_workers, gateways, http, receiver
):
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    assert request.parent_span_id == ""
    (sent,) = (await sim_stats(http, worker))["traceparents"]
    assert ids(sent) == (request.trace_id, only(receiver.children(request)).span_id)


async def test_a_retried_request_has_a_span_per_try_each_sent_with_its_own_context(
    sim_workers, gateways, http, receiver
):
    failing = await sim_workers(1, fail_rate=1.0)
    working = await sim_workers(1)
    routes = [
        {
            "name": "retrying",
            "destinations": [{"subset": "default"}],
            "retries": {"attempts": 1, "retry_on": ["5xx"], "base_interval": 0, "max_interval": 0},
        }
    ]
    config = model_config("m", [*failing, *working], strategy="round_robin", routes=routes)
    gateway = await gateways([config], telemetry={"otlp_endpoint": receiver.url})
    for _ in range(2):  # round robin: one of the two starts at the failing endpoint
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            assert response.status == 200
    await flush(gateway)

    retried = only(
        [s for s in receiver.spans if s.kind == "server" and s.attributes["modelyard.attempts"] == 2]
    )
    first, second = sorted(receiver.children(retried), key=lambda s: s.attributes["modelyard.retry"])
    assert (first.attributes["modelyard.backend"], first.attributes["modelyard.retry"]) == ("w0", 0)
    assert first.error and first.attributes["http.response.status_code"] == 500
    assert (second.attributes["modelyard.backend"], second.attributes["modelyard.retry"]) == ("w1", 1)
    assert not second.error
    assert retried.attributes["modelyard.backend"] == "w1"
    (sent_failing,) = (await sim_stats(http, failing[0]))["traceparents"]
    assert ids(sent_failing) == (retried.trace_id, first.span_id)
    sent_working = (await sim_stats(http, working[0]))["traceparents"]
    assert (retried.trace_id, second.span_id) in [ids(t) for t in sent_working]


async def test_an_upstream_failure_marks_the_span_as_an_error(sim_workers, gateways, http, receiver):
    (worker,) = await sim_workers(1, fail_rate=1.0)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 500
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    assert request.error
    assert request.attributes["http.response.status_code"] == 500


async def test_a_streams_span_ends_when_the_stream_ends(sim_workers, gateways, http, receiver):
    (worker,) = await sim_workers(1, decode_ms_per_token=25.0)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    async with http.post(gateway.url + CHAT, json=chat(stream=True, max_tokens=10)) as response:
        assert response.status == 200
        body = await response.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    attempt = only(receiver.children(request))
    # The try's span ends at the answer's head; the request's when the last event was relayed
    # (10 tokens at 25 ms each).
    assert request.seconds >= 0.2 > attempt.seconds
    assert request.attributes["http.response.status_code"] == 200


async def test_a_graph_request_has_a_span_per_step_and_each_model_call_joins_it(
    sim_workers, gateways, http, receiver
):
    (worker,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("m", [worker], protocol="v2")],
        graphs={"g": GRAPH},
        telemetry={"otlp_endpoint": receiver.url},
    )
    inputs = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    headers = {"traceparent": CLIENT_TRACEPARENT}
    async with http.post(gateway.url + "/v1/graphs/g", json=inputs, headers=headers) as response:
        assert response.status == 200, await response.text()
    await flush(gateway)

    graph = only(receiver.named("graph g"))
    assert (graph.kind, graph.trace_id, graph.parent_span_id) == ("server", TRACE_ID, CLIENT_SPAN)
    first, second = sorted(receiver.children(graph), key=lambda s: s.name)
    assert first.name == "step root/first"
    assert first.attributes["modelyard.graph.router_type"] == "Sequence"
    assert first.attributes["modelyard.graph.target"] == "m"
    assert second.attributes["modelyard.graph.target"] == "inner"
    assert second.name == "step root/second"
    nested = only(receiver.children(second))
    assert nested.name == "step inner/only"
    # Each serviceName step is a routed model call under its step, and its try under that call.
    sent = (await sim_stats(http, worker))["traceparents"]
    for step in (first, nested):
        call = only(receiver.children(step))
        assert (call.kind, call.name, call.attributes["modelyard.model"]) == ("internal", "POST m", "m")
        attempt = only(receiver.children(call))
        assert f"00-{TRACE_ID}-{attempt.span_id}-01" in sent
    assert len(sent) == 2


async def test_tracing_off_adds_no_traceparent_and_forwards_the_clients(sim_workers, gateways, http):
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])])
    assert gateway.app[GATEWAY].tracer is None
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200
    assert (await sim_stats(http, worker))["traceparents"] == []
    async with http.post(
        gateway.url + CHAT, json=chat(), headers={"traceparent": CLIENT_TRACEPARENT}
    ) as response:
        assert response.status == 200
    assert (await sim_stats(http, worker))["traceparents"] == [CLIENT_TRACEPARENT]


async def test_an_unreachable_collector_fails_no_request_and_delays_the_stop_at_most_its_timeout(
    sim_workers, http
):
    (worker,) = await sim_workers(1)
    (port,) = free_ports(1)
    config = {
        "listen": {"port": 0},
        "models": [model_config("m", [worker])],
        "telemetry": {"otlp_endpoint": f"http://127.0.0.1:{port}", "timeout": "300ms"},
    }
    gateway = await start_gateway(validate_config(config, "<test>"))
    try:
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            assert response.status == 200
        assert len((await sim_stats(http, worker))["traceparents"]) == 1
    finally:
        started = time.monotonic()
        await gateway.stop()
    assert time.monotonic() - started < 3.0  # the export's 300 ms, and the server's own stop


async def test_an_oip_grpc_call_is_traced_from_the_clients_metadata(sim_workers, gateways, http, receiver):
    (worker,) = await sim_workers(1, models=["echo"])
    gateway = await gateways(
        [model_config("echo", [worker])],
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
        telemetry={"otlp_endpoint": receiver.url},
    )
    await grpc_infer(gateway.grpc_port, {"traceparent": CLIENT_TRACEPARENT})
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    assert (request.trace_id, request.parent_span_id) == (TRACE_ID, CLIENT_SPAN)
    assert request.attributes["url.path"] == "/v2/models/echo/infer"
    assert request.attributes["http.response.status_code"] == 200
    attempt = only(receiver.children(request))
    assert ids((await sim_stats(http, worker))["traceparents"][-1]) == (TRACE_ID, attempt.span_id)


async def test_graph_serve_traces_each_step_and_sends_its_context(sim_workers, http):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from modelyard.config import TelemetryConfig
    from modelyard.graph import GraphDocument, parse_graph
    from modelyard.graphrouter import start_router
    from modelyard.telemetry import build_tracer

    (worker,) = await sim_workers(1)
    spec = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [{"name": "s", "serviceUrl": f"{worker.url}/v1/models/m:predict"}],
            }
        }
    }
    graph, _ = parse_graph(GraphDocument("g", spec, "test"))
    exported = InMemorySpanExporter()
    tracer = build_tracer(TelemetryConfig(), "modelyard-graph-router", exporter=exported)
    router = await start_router(graph, host="127.0.0.1", port=0, mesh_probe_url=None, tracer=tracer)
    try:
        headers = {"traceparent": CLIENT_TRACEPARENT}
        async with http.post(router.url + "/", json={"instances": [1]}, headers=headers) as response:
            assert response.status == 200
    finally:
        await router.stop()
    spans = {s.name: s for s in exported.get_finished_spans()}
    request, step = spans["graph g"], spans["step root/s"]
    assert f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert step.parent.span_id == request.context.span_id
    assert request.attributes["http.response.status_code"] == 200
    assert ids((await sim_stats(http, worker))["traceparents"][-1]) == (
        TRACE_ID,
        f"{step.context.span_id:016x}",
    )


async def test_a_shadow_copy_has_a_span_of_its_own_not_a_try_of_the_request(
    sim_workers, gateways, http, receiver
):
    (primary,) = await sim_workers(1)
    (canary,) = await sim_workers(1)
    config = model_config("m", [primary, canary])
    config["endpoints"][0]["subset"], config["endpoints"][1]["subset"] = "v1", "v2"
    destinations = [{"subset": "v1", "weight": 1}, {"subset": "v2", "weight": 0}]
    config["routes"] = [
        {"name": "shadowed", "destinations": destinations, "mirror": {"subset": "v2", "percent": 100}}
    ]
    gateway = await gateways([config], telemetry={"otlp_endpoint": receiver.url})
    headers = {"traceparent": CLIENT_TRACEPARENT}
    async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
        assert response.status == 200
        await response.read()

    async def compared() -> bool:  # the copy has ended (its outcome counted for the canary)
        name = "modelyard_canary_requests_total"
        return await metric_value(http, gateway.url, name, subset="v2") == 1

    await wait_until(compared)
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    children = receiver.children(request)
    attempt = only([s for s in children if "modelyard.retry" in s.attributes])
    assert attempt.attributes["modelyard.backend"] == "w0" and request.attributes["modelyard.attempts"] == 1
    shadow = only([s for s in children if s.attributes.get("modelyard.shadow")])
    assert (shadow.name, shadow.attributes["modelyard.subset"]) == ("shadow m", "v2")
    assert shadow.attributes["http.response.status_code"] == 200 and not shadow.error
    assert receiver.children(shadow) == []  # no try span of its own to count
    # The canary joins the trace under the shadow span, not as the request's try (nor the client's).
    assert (await sim_stats(http, canary))["traceparents"] == [f"00-{TRACE_ID}-{shadow.span_id}-01"]
    assert (await sim_stats(http, primary))["traceparents"] == [f"00-{TRACE_ID}-{attempt.span_id}-01"]


@pytest.mark.parametrize(
    "tracestate",
    ["k=" + "x" * 600, ",,,=,==", ",".join(f"k{i}=v" for i in range(40)), "a=1,a=2", "K=v", "k=v\u00e9"],
)
async def test_a_malformed_tracestate_is_dropped_without_a_log_line(
    sim_workers, gateways, http, receiver, caplog, tracestate
):
    caplog.set_level(logging.DEBUG)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    headers = {"traceparent": CLIENT_TRACEPARENT, "tracestate": tracestate}
    async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
        assert response.status == 200
    await flush(gateway)
    request = only([s for s in receiver.spans if s.kind == "server"])
    assert (request.trace_id, request.parent_span_id) == (TRACE_ID, CLIENT_SPAN)  # the parent is kept
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


async def test_a_request_id_that_is_not_utf8_is_traced_without_a_log_line(
    sim_workers, gateways, receiver, caplog
):
    caplog.set_level(logging.DEBUG)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], telemetry={"otlp_endpoint": receiver.url})
    for request_id in (b"ok-1", b"a\xffb", b"ok-2"):
        head = raw_request(
            "POST", CHAT, b'{"model":"m","messages":[]}', X_Request_Id="RID", Connection="close"
        )
        assert (await send(gateway.url, head.replace(b"RID", request_id))).status == 200
    await flush(gateway)
    requests = [s for s in receiver.spans if s.kind == "server"]
    assert [s.attributes["modelyard.request_id"] for s in requests] == ["ok-1", "a\\udcffb", "ok-2"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_request_cancelled_while_queued_ends_its_span_as_client_closed(
    sim_workers, gateways, http, receiver
):
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways(
        [model_config("m", [worker], circuit_breakers=ONE_SLOT)], telemetry={"otlp_endpoint": receiver.url}
    )
    await cancel_while_queued(http, gateway.url, gateway.app[GATEWAY].clusters["m"], "q")
    await flush(gateway)
    request = only([s for s in receiver.spans if s.attributes.get("modelyard.request_id") == "q"])
    assert request.attributes["http.response.status_code"] == 499
    assert request.attributes["modelyard.attempts"] == 0 and receiver.children(request) == []


async def test_a_try_relayed_as_grpc_has_rpc_attributes_and_a_rest_trys_url_no_query(
    sim_workers, gateways, http, receiver
):
    (worker,) = await sim_workers(1, models=["echo"], grpc_port=0)
    endpoints = [{"name": "w0", "url": worker.url, "grpc_url": worker.grpc_url}]
    gateway = await gateways(
        [{"name": "echo", "endpoints": endpoints, "health_check": {"interval": "60s"}}],
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
        telemetry={"otlp_endpoint": receiver.url},
    )
    await grpc_infer(gateway.grpc_port)
    inputs = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    async with http.post(gateway.url + "/v2/models/echo/infer?token=secret", json=inputs) as response:
        assert response.status == 200
    await flush(gateway)
    tries = [only(receiver.children(s)) for s in receiver.spans if s.kind == "server"]
    (grpc_try,) = [t for t in tries if "rpc.system" in t.attributes]
    (rest_try,) = [t for t in tries if "rpc.system" not in t.attributes]
    port = int(worker.grpc_url.rsplit(":", 1)[1])
    assert grpc_try.attributes == {
        "modelyard.backend": "w0",
        "modelyard.retry": 0,
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "server.address": "127.0.0.1",
        "server.port": port,
        "http.response.status_code": 200,
    }
    assert rest_try.attributes["url.full"] == worker.url + "/v2/models/echo/infer"
    assert not [s for s in receiver.spans if any("secret" in str(v) for v in s.attributes.values())]


class SlowState(MemoryState):
    """A store that takes 200 ms to answer a lookup (a far Redis): before the request's span."""

    async def get(self, key: str) -> str | None:
        await asyncio.sleep(0.2)
        return await super().get(key)


async def test_the_request_span_and_access_line_cover_the_whole_request_from_its_arrival(
    sim_workers, http, receiver, caplog
):
    caplog.set_level(logging.INFO, logger="modelyard.access")
    (worker,) = await sim_workers(1)
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [model_config("m", [worker], strategy="kv_aware")],  # looks up the prompt's affinity
        "telemetry": {"otlp_endpoint": receiver.url},
        "logging": {"access_log": True},
    }
    gateway = await start_gateway(validate_config(config, "<test>"), state=SlowState())
    try:
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            assert response.status == 200
        await flush(gateway)
    finally:
        await gateway.stop()
    request = only([s for s in receiver.spans if s.kind == "server"])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "modelyard.access"]
    assert request.seconds >= 0.2
    assert orjson.loads(line)["duration_ms"] >= 200
