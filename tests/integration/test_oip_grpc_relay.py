"""OIP v2 over gRPC relayed as gRPC: endpoints with a `grpc_url` get the client's call itself, its
message unconverted, through the same routing, retries and error mapping as the REST translation.

The backends are sim-workers serving gRPC too (`grpc_port`), which count a gRPC inference apart
from a REST one (`oip_infer_grpc` against `oip_infer`), and a recording gRPC server built on the
gateway's own `rpc.OipServer`. tritonclient.grpc is the client, unchanged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from aiohttp import web
from grpc import aio
from test_oip_grpc import _input, off_loop, stream_answers, triton_client
from tritonclient.utils import InferenceServerException

from modelyard.errors import ModelServerAnswered
from modelyard.gateway.gateway import GATEWAY
from modelyard.rpc import OipCall, OipServer
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb
from support import free_ports, metric_value, wait_until

GRPC_LISTEN = {"host": "127.0.0.1", "port": 0, "grpc_port": 0}


def _relayed(name: str, workers: list[Any], **fields: Any) -> dict[str, Any]:
    """A model over `workers`, each endpoint with its REST url and its grpc_url."""
    endpoints = [{"name": f"w{i}", "url": w.url, "grpc_url": w.grpc_url} for i, w in enumerate(workers)]
    return {"name": name, "endpoints": endpoints, "health_check": {"interval": "60s"}, **fields}


def _ways(worker: Any) -> tuple[int, int]:
    """(REST, gRPC) inferences the worker served."""
    by = worker.stats.requests_by_endpoint
    return by.get("oip_infer", 0), by.get("oip_infer_grpc", 0)


async def test_a_call_reaches_a_grpc_endpoint_as_grpc(sim_workers, gateways, http):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"], grpc_port=0)
    gateway = await gateways([_relayed("echo", workers)], listen=GRPC_LISTEN)
    fp32 = np.array([[1.0, 2.5], [3.0, -4.0]], dtype=np.float32)
    text = np.array([b"hello", "wörld".encode()], dtype=np.object_)
    async with triton_client(gateway) as client:
        for request_id in ("r1", "r2"):
            inputs = [_input("a", fp32, "FP32"), _input("c", text, "BYTES")]
            result = await off_loop(client.infer, "echo", inputs, request_id=request_id)
            assert result.get_response().id == request_id
            assert result.as_numpy("a").tolist() == (fp32 * 2).tolist()
            assert [x.decode() for x in result.as_numpy("c").tolist()] == ["hello", "wörld"]
        assert await off_loop(client.is_model_ready, "echo")
        metadata = await off_loop(client.get_model_metadata, "echo", "4")
        assert (metadata.name, list(metadata.versions), metadata.platform) == ("echo", ["4"], "modelyard-sim")
    assert [_ways(w) for w in workers] == [(0, 1), (0, 1)]  # round robin, over gRPC only
    for backend in ("w0", "w1"):
        count = await metric_value(http, gateway.url, "modelyard_requests_total", backend=backend, code="200")
        assert count >= 1, backend
    # REST clients still reach the same endpoints over REST.
    body = {"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1.5]}]}
    async with http.post(gateway.url + "/v2/models/echo/infer", json=body) as response:
        assert response.status == 200
        assert (await response.json())["outputs"][0]["data"] == [3.0]
    assert sum(_ways(w)[0] for w in workers) == 1


async def test_a_model_with_grpc_and_rest_endpoints_uses_each_its_way(sim_workers, gateways):
    (grpc_worker,) = await sim_workers(1, models=["echo"], grpc_port=0)
    (rest_worker,) = await sim_workers(1, models=["echo"])
    endpoints = [
        {"name": "g", "url": grpc_worker.url, "grpc_url": grpc_worker.grpc_url},
        {"name": "r", "url": rest_worker.url},
    ]
    model = {"name": "echo", "endpoints": endpoints, "health_check": {"interval": "60s"}}
    gateway = await gateways([model], listen=GRPC_LISTEN)
    async with triton_client(gateway) as client:
        for value in (1.0, 2.0, 3.0, 4.0):
            x = _input("x", np.array([value], np.float32), "FP32")  # raw_input_contents
            result = await off_loop(client.infer, "echo", [x])
            assert result.as_numpy("x").tolist() == [value]
    assert (_ways(grpc_worker), _ways(rest_worker)) == ((0, 2), (2, 0))


async def test_a_grpc_port_that_refuses_is_retried_on_another_endpoint(sim_workers, gateways, http):
    workers = await sim_workers(2, models=["echo"], grpc_port=0)
    (dead,) = free_ports(1)
    model = _relayed("echo", workers)
    model["endpoints"][0]["grpc_url"] = f"grpc://127.0.0.1:{dead}"  # its REST side is up; nothing here
    gateway = await gateways([model], listen=GRPC_LISTEN)
    async with triton_client(gateway) as client:
        for _ in range(4):
            x = _input("x", np.ones(2, np.float32), "FP32")
            assert (await off_loop(client.infer, "echo", [x])).as_numpy("x").tolist() == [1.0, 1.0]
    assert _ways(workers[1]) == (0, 4)
    retries = await metric_value(http, gateway.url, "modelyard_retries_total", reason="connect-failure")
    assert retries >= 1


async def test_a_grpc_backends_errors_keep_their_code_and_message(sim_workers, gateways):
    (failing,) = await sim_workers(1, models=["echo"], grpc_port=0, fail_rate=1.0)
    gateway = await gateways([_relayed("echo", [failing])], listen=GRPC_LISTEN)
    async with triton_client(gateway) as client:
        with pytest.raises(InferenceServerException) as failed:
            await off_loop(client.infer, "echo", [_input("x", np.ones(1, np.float32), "FP32")])
        assert failed.value.status() == "StatusCode.INTERNAL"
        assert failed.value.message() == "simulated failure (fail_rate)"
        # The tensor is the backend's to judge: 3 bytes for one FP32, refused by the backend.
        bad = grpcclient.InferInput("x", [1], "FP32")
        bad._raw_content = b"\0\0\0"  # what a client with a bug would send
        with pytest.raises(InferenceServerException) as refused:
            await off_loop(client.infer, "echo", [bad])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "x" in refused.value.message()


async def test_the_route_timeout_ends_a_relayed_call(sim_workers, gateways):
    (slow,) = await sim_workers(1, models=["slow"], grpc_port=0, decode_ms_per_token=5000.0)
    routes = [{"name": "default", "destinations": [{"subset": "default"}], "timeout": "100ms"}]
    gateway = await gateways([_relayed("slow", [slow], routes=routes)], listen=GRPC_LISTEN)
    async with triton_client(gateway) as client:
        with pytest.raises(InferenceServerException) as timed_out:
            await off_loop(client.infer, "slow", [_input("x", np.ones(1, np.float32), "FP32")])
    assert timed_out.value.status() == "StatusCode.DEADLINE_EXCEEDED"


async def test_a_stream_is_relayed_whole_to_one_grpc_endpoint(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"], grpc_port=0)
    gateway = await gateways([_relayed("echo", workers)], listen=GRPC_LISTEN)
    requests = [("echo", i, np.array([v], np.float32)) for i, v in (("s1", 1.5), ("s2", 2.0), ("s3", -2.0))]
    async with triton_client(gateway) as client:
        answers = await stream_answers(client, requests, 3)
    assert [(r.get_response().id, r.as_numpy("x").tolist(), e) for r, e in answers] == [
        ("s1", [3.0], None),
        ("s2", [4.0], None),
        ("s3", [-4.0], None),
    ]
    assert sorted(_ways(w) for w in workers) == [(0, 0), (0, 3)]  # one stream, one backend


class Recorder:
    """A gRPC OIP backend that records each call's metadata and the message it got."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], OipCall]] = []

    def ready(self) -> bool:
        return True

    def server_metadata(self) -> tuple[str, str, list[str]]:
        return "recorder", "0", []

    def request_id(self, headers: Any) -> str:
        return ""  # a backend makes none

    async def model_ready(self, model: str, version: str, headers: Any, call: OipCall) -> bool:
        return True

    def admit(self, model: str, version: str, headers: Any) -> None:
        pass

    async def model_metadata(self, model: str, version: str, headers: Any, call: OipCall) -> object:
        return {"name": model}

    def stream_relay(self, model: str, headers: Any) -> None:
        return None

    async def infer(self, model: str, version: str, call: OipCall, headers: Any) -> object:
        self.seen.append((dict(headers), call))
        body = call.json()
        if body["inputs"][0]["name"] == "fail":
            raise ModelServerAnswered(503, "busy " + "e" * 5000)
        return {"model_name": model, "outputs": body["inputs"]}


@pytest.fixture
async def recorder(sim_workers, gateways) -> AsyncIterator[tuple[Any, Recorder]]:
    backend = Recorder()
    server = OipServer(backend, max_message_bytes=1 << 20)
    await server.start()
    (health,) = await sim_workers(1)  # the REST url the health checks probe; no call goes there
    try:
        endpoint = {"name": "r0", "url": health.url, "grpc_url": f"grpc://{server.address}"}
        model = {"name": "rec", "endpoints": [endpoint], "health_check": {"interval": "60s"}}
        yield await gateways([model], listen=GRPC_LISTEN), backend
    finally:
        await server.stop(0)


async def test_the_backend_gets_the_message_and_the_metadata_without_framing(recorder):
    gateway, backend = recorder
    x = _input("x", np.array([1.0, 2.0], np.float32), "FP32")
    async with triton_client(gateway) as client:
        result = await off_loop(client.infer, "rec", [x], headers={"x-keep": "yes", "content-length": "3"})
        assert result.as_numpy("x").tolist() == [1.0, 2.0]
        await off_loop(client.infer, "rec", [x], headers={"x-request-id": "mine"})
    (first, call), (second, _) = backend.seen
    assert first["x-keep"] == "yes"
    assert first["x-request-id"]  # made by the gateway
    assert second["x-request-id"] == "mine"  # the caller's
    assert "content-length" not in first and "content-type" not in first
    assert call.json()["inputs"][0]["data"] == [1.0, 2.0]  # the raw contents, as the client sent them


async def test_a_relayed_error_is_cut_and_a_503_is_retried_then_unavailable(recorder):
    gateway, backend = recorder
    async with triton_client(gateway) as client:
        with pytest.raises(InferenceServerException) as refused:
            await off_loop(client.infer, "rec", [_input("fail", np.ones(1, np.float32), "FP32")])
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    message = refused.value.message()
    assert message.startswith("busy eee") and message.endswith("...") and len(message) <= 1000
    assert len(backend.seen) > 1  # 503 is a gateway-error: retried, as over REST


class Scripted(grpc.GenericRpcHandler):
    """A gRPC backend whose ModelInfer hangs (`mode` "hang") or ends with a status of its own
    ("abort:CODE:message"); `calls` counts the calls that reached it. Its ModelStreamInfer is a
    decoupled model's: two answers per request ("<id>.1", "<id>.2"), or with "abort:..." the status
    after the first answer."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0
        self.arrived = asyncio.Event()

    def service(self, details: Any) -> Any:
        if details.method.endswith("/ModelStreamInfer"):

            async def stream(requests: Any, context: Any) -> Any:
                async for data in requests:
                    request = pb.ModelInferRequest.FromString(data)
                    for part in (1, 2):
                        answer = pb.ModelInferResponse(
                            model_name=request.model_name, id=f"{request.id}.{part}"
                        )
                        yield pb.ModelStreamInferResponse(infer_response=answer).SerializeToString()
                        if self.mode.startswith("abort:"):
                            _, code, message = self.mode.split(":", 2)
                            await context.abort(getattr(grpc.StatusCode, code), message)

            return grpc.stream_stream_rpc_method_handler(stream)

        async def infer(request: bytes, context: Any) -> bytes:
            self.calls += 1
            self.arrived.set()
            if self.mode == "hang":
                await asyncio.sleep(60)
            if self.mode.startswith("abort:"):
                _, code, message = self.mode.split(":", 2)
                await context.abort(getattr(grpc.StatusCode, code), message)
            return pb.ModelInferResponse(model_name="m").SerializeToString()

        return grpc.unary_unary_rpc_method_handler(infer)


@pytest.fixture
async def scripted() -> AsyncIterator[Any]:
    """`await scripted(mode)`: (its server, the Scripted handler, its grpc_url)."""
    servers: list[aio.Server] = []

    async def start(mode: str) -> tuple[aio.Server, Scripted, str]:
        handler = Scripted(mode)
        server = aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return server, handler, f"grpc://127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


class HealthSwitch:
    """A REST url whose /health answers 200 while `up`, else 503."""

    def __init__(self) -> None:
        self.up = True
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> HealthSwitch:
        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200 if self.up else 503)

        app = web.Application()
        app.router.add_get("/health", health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def health_switch() -> AsyncIterator[HealthSwitch]:
    switch = await HealthSwitch().start()
    yield switch
    await switch.stop()


async def _over(gateways: Any, grpc_url: str, health: HealthSwitch, **fields: Any) -> Any:
    """A gateway whose model m has one endpoint, a: `grpc_url`, and `health`'s REST url."""
    endpoint = {"name": "a", "url": health.url, "grpc_url": grpc_url}
    model = {"name": "m", "endpoints": [endpoint], "health_check": {"interval": "60s"}, **fields}
    return await gateways([model], listen=GRPC_LISTEN)


NO_RETRIES = [{"name": "default", "destinations": [{"subset": "default"}], "retries": {"attempts": 0}}]


async def test_a_relayed_try_is_given_up_when_its_endpoint_is_taken_out(
    sim_workers, gateways, scripted, health_switch
):
    _server, hanging, url = await scripted("hang")
    (good,) = await sim_workers(1, models=["m"], grpc_port=0)
    endpoints = [
        {"name": "a", "url": health_switch.url, "grpc_url": url},  # round robin tries it first
        {"name": "b", "url": good.url, "grpc_url": good.grpc_url},
    ]
    check = {"interval": "0.1s", "unhealthy_interval": "0.1s", "unhealthy_threshold": 1}
    gateway = await gateways(
        [{"name": "m", "endpoints": endpoints, "health_check": check}], listen=GRPC_LISTEN
    )
    async with triton_client(gateway) as client:
        call = asyncio.create_task(off_loop(client.infer, "m", [_input("x", np.ones(1, np.float32), "FP32")]))
        await asyncio.wait_for(hanging.arrived.wait(), 10)
        health_switch.up = False  # a fails its health check while the try waits on it
        started = time.monotonic()
        result = await call
    assert result.as_numpy("x").tolist() == [1.0]  # retried on b
    assert time.monotonic() - started < 5  # not the route's timeout
    assert _ways(good) == (0, 1)


async def test_a_backends_own_unavailable_does_not_take_its_endpoint_out(gateways, scripted, health_switch):
    _server, _handler, url = await scripted("abort:UNAVAILABLE:feature store: connection refused")
    gateway = await _over(gateways, url, health_switch, routes=NO_RETRIES)
    async with triton_client(gateway) as client:
        with pytest.raises(InferenceServerException) as failed:
            await off_loop(client.infer, "m", [_input("x", np.ones(1, np.float32), "FP32")])
    assert (failed.value.status(), failed.value.message()) == (
        "StatusCode.UNAVAILABLE",
        "feature store: connection refused",
    )
    assert gateway.app[GATEWAY].clusters["m"].endpoints[0].health.healthy  # it answered: it is up


async def test_a_call_dropped_by_a_backends_shutdown_is_a_reset(
    sim_workers, gateways, scripted, health_switch
):
    server, hanging, url = await scripted("hang")
    (good,) = await sim_workers(1, models=["m"], grpc_port=0)
    resets_only = [
        {
            "name": "default",
            "destinations": [{"subset": "default"}],
            "retries": {"attempts": 2, "retry_on": ["connect-failure", "reset"]},
        }
    ]
    endpoints = [
        {"name": "a", "url": health_switch.url, "grpc_url": url},
        {"name": "b", "url": good.url, "grpc_url": good.grpc_url},
    ]
    model = {"name": "m", "endpoints": endpoints, "routes": resets_only, "health_check": {"interval": "60s"}}
    gateway = await gateways([model], listen=GRPC_LISTEN)
    async with triton_client(gateway) as client:
        call = asyncio.create_task(off_loop(client.infer, "m", [_input("x", np.ones(1, np.float32), "FP32")]))
        await asyncio.wait_for(hanging.arrived.wait(), 10)
        await server.stop(0.1)  # a rolling restart: the calls in flight are cancelled
        result = await call
    assert result.as_numpy("x").tolist() == [1.0]
    assert _ways(good) == (0, 1)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("FAILED_PRECONDITION", "model unloading"),
        ("ALREADY_EXISTS", "duplicate id"),
        ("DEADLINE_EXCEEDED", "queue timeout"),
        ("UNKNOWN", "python backend raised"),
        ("RESOURCE_EXHAUSTED", "queue full"),
    ],
)
async def test_a_backends_status_comes_back_as_it_was(gateways, scripted, health_switch, code, message):
    _server, _handler, url = await scripted(f"abort:{code}:{message}")
    gateway = await _over(gateways, url, health_switch, routes=NO_RETRIES)
    async with triton_client(gateway) as client:
        with pytest.raises(InferenceServerException) as failed:
            await off_loop(client.infer, "m", [_input("x", np.ones(1, np.float32), "FP32")])
    assert (failed.value.status(), failed.value.message()) == (f"StatusCode.{code}", message)


async def _stream(client: Any, requests: list[tuple[str, str]], answers: int) -> list[tuple[Any, Any]]:
    return await stream_answers(client, [(m, i, np.ones(1, np.float32)) for m, i in requests], answers)


async def test_a_decoupled_models_answers_all_come_back_through_the_stream(
    gateways, scripted, health_switch, http
):
    _server, _handler, url = await scripted("decoupled")
    gateway = await _over(gateways, url, health_switch)
    async with triton_client(gateway) as client:
        got = await _stream(client, [("m", "r1"), ("m", "r2")], answers=4)
    assert [(r.get_response().id, e) for r, e in got] == [
        ("r1.1", None),
        ("r1.2", None),
        ("r2.1", None),
        ("r2.2", None),
    ]
    # One stream, counted once when it ended.
    assert await metric_value(http, gateway.url, "modelyard_requests_total", backend="a", code="200") == 1


async def test_a_backends_error_ends_a_relayed_stream_with_its_status(gateways, scripted, health_switch):
    _server, _handler, url = await scripted("abort:FAILED_PRECONDITION:sequence not started")
    gateway = await _over(gateways, url, health_switch)
    async with triton_client(gateway) as client:
        got = await _stream(client, [("m", "s1")], answers=2)
    (first, no_error), (no_result, error) = got
    assert first.get_response().id == "s1.1" and no_error is None and no_result is None
    assert "FAILED_PRECONDITION" in str(error.status()) and "sequence not started" in str(error)


def _raw_stream(gateway: Any) -> tuple[aio.Channel, Any]:
    """A channel to the gateway and a ModelStreamInfer call on it that sends requests or raw bytes."""
    channel = aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
    call = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )()
    return channel, call


def _in_flight(gateway: Any) -> list[int]:
    return [e.in_flight for e in gateway.app[GATEWAY].clusters["m"].endpoints]


async def test_a_stream_request_that_cannot_be_read_ends_the_stream_invalid_argument(
    gateways, scripted, health_switch
):
    _server, _handler, url = await scripted("decoupled")
    gateway = await _over(gateways, url, health_switch)
    channel, call = _raw_stream(gateway)
    try:
        await call.write(pb.ModelInferRequest(model_name="m", id="r1"))
        assert [(await call.read()).infer_response.id for _ in range(2)] == ["r1.1", "r1.2"]
        await call.write(b"\xff\xff\xff")  # not a ModelInferRequest
        assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be read" in (await call.details() or "")
    finally:
        await channel.close()

    async def freed() -> bool:
        return _in_flight(gateway) == [0]

    await wait_until(freed)


async def test_a_stream_with_no_room_is_refused_at_once_and_rest_requests_go_on(
    sim_workers, gateways, scripted, health_switch, http
):
    _server, _handler, url = await scripted("decoupled")
    (rest,) = await sim_workers(1, models=["m"])
    endpoints = [{"name": "g", "url": health_switch.url, "grpc_url": url}, {"name": "r", "url": rest.url}]
    breakers = {"max_requests": 1, "max_pending_requests": 10, "queue_timeout": "5s"}
    model = {
        "name": "m",
        "endpoints": endpoints,
        "circuit_breakers": breakers,
        "health_check": {"interval": "60s"},
    }
    gateway = await gateways([model], listen=GRPC_LISTEN)
    channel, holding = _raw_stream(gateway)
    _, refused = _raw_stream(gateway)
    try:
        await holding.write(pb.ModelInferRequest(model_name="m", id="a"))
        await holding.read()  # g's one slot is the stream's
        await refused.write(pb.ModelInferRequest(model_name="m", id="b"))
        assert await asyncio.wait_for(refused.code(), 10) == grpc.StatusCode.RESOURCE_EXHAUSTED  # no wait
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with http.post(gateway.url + "/v2/models/m/infer", json=body) as response:
            assert response.status == 200 and response.headers["X-Modelyard-Backend"] == "r"
    finally:
        holding.cancel()
        await channel.close()


async def test_a_stream_for_a_model_whose_grpc_endpoints_are_down_is_answered_over_rest(
    sim_workers, gateways, scripted, health_switch
):
    _server, _handler, url = await scripted("decoupled")
    (rest,) = await sim_workers(1, models=["m"], oip_scale=2.0)
    endpoints = [{"name": "g", "url": health_switch.url, "grpc_url": url}, {"name": "r", "url": rest.url}]
    check = {"interval": "0.05s", "unhealthy_interval": "0.05s", "unhealthy_threshold": 1}
    gateway = await gateways(
        [{"name": "m", "endpoints": endpoints, "health_check": check}], listen=GRPC_LISTEN
    )
    health_switch.up = False

    async def g_down() -> bool:
        return not gateway.app[GATEWAY].clusters["m"].endpoints[0].healthy

    await wait_until(g_down)
    async with triton_client(gateway) as client:
        got = await _stream(client, [("m", "s1")], answers=1)
    ((result, error),) = got
    assert error is None and result.as_numpy("x").tolist() == [2.0]  # r's answer, request by request
    assert _ways(rest) == (1, 0)
