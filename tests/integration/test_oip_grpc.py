"""OIP v2 over gRPC: tritonclient.grpc, unchanged, against the gateway's listen.grpc_port, routed to
REST sim-workers. The client is synchronous, so each call runs in a thread while the gateway serves
on the test's event loop; every call has a client_timeout, so a hung gateway fails the test instead
of hanging it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from aiohttp import web
from tritonclient.utils import InferenceServerException

from support import free_ports, metric_value, model_config

T = TypeVar("T")
CLIENT_TIMEOUT = 30.0  # seconds: no call here takes more than a fraction of one
# The InferenceServerClient calls that take client_timeout (close and the stream calls do not).
_TIMED = frozenset({"is_server_live", "is_server_ready", "get_server_metadata", "is_model_ready"})
_TIMED |= {"get_model_metadata", "infer"}


async def off_loop(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    if getattr(call, "__name__", "") in _TIMED:
        kwargs.setdefault("client_timeout", CLIENT_TIMEOUT)
    return await asyncio.to_thread(call, *args, **kwargs)


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"])
    (dead,) = free_ports(1)  # nothing listens there
    down = {"name": "down", "endpoints": [{"name": "d0", "url": f"http://127.0.0.1:{dead}"}]}
    models = [model_config("echo", workers, health_check={"path": "/v2/health/ready"}), down]
    return await gateways(models, listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})


@pytest.fixture
async def healthy_gateway(sim_workers, gateways):
    """Only models that are up: the server is ready until it drains."""
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"])
    models = [model_config("echo", workers, health_check={"path": "/v2/health/ready"})]
    return await gateways(models, listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})


@contextlib.asynccontextmanager
async def triton_client(gateway: Any) -> AsyncIterator[grpcclient.InferenceServerClient]:
    assert gateway.grpc_port
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    try:
        yield triton
    finally:
        await off_loop(triton.close)


@pytest.fixture
async def client(gateway) -> AsyncIterator[grpcclient.InferenceServerClient]:
    async with triton_client(gateway) as triton:
        yield triton


@pytest.fixture
async def healthy_client(healthy_gateway) -> AsyncIterator[grpcclient.InferenceServerClient]:
    async with triton_client(healthy_gateway) as triton:
        yield triton


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)  # raw_input_contents, tritonclient's default
    return tensor


async def test_health_and_metadata(healthy_gateway, healthy_client, http):
    client = healthy_client
    assert await off_loop(client.is_server_live)
    async with http.get(healthy_gateway.url + "/v2/health/ready") as response:
        assert (await response.json())["ready"] is True
    assert await off_loop(client.is_server_ready) is True
    assert (await off_loop(client.get_server_metadata)).name == "modelyard"
    assert await off_loop(client.is_model_ready, "echo")
    assert await off_loop(client.is_model_ready, "echo", "1")
    metadata = await off_loop(client.get_model_metadata, "echo")
    assert metadata.name == "echo"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("INPUT0", "FP32", [-1])]


async def test_infer_answers_as_rest_does(gateway, client, http):
    fp32 = np.array([[1.0, 2.5], [3.0, -4.0]], dtype=np.float32)
    int64 = np.array([1, -2, 3_000_000_000], dtype=np.int64)
    text = np.array([b"hello", "wörld".encode()], dtype=np.object_)
    inputs = [_input("a", fp32, "FP32"), _input("b", int64, "INT64"), _input("c", text, "BYTES")]
    result = await off_loop(client.infer, "echo", inputs, request_id="r1")

    rest_body = {
        "id": "r1",
        "inputs": [
            {"name": "a", "shape": [2, 2], "datatype": "FP32", "data": fp32.flatten().tolist()},
            {"name": "b", "shape": [3], "datatype": "INT64", "data": int64.tolist()},
            {"name": "c", "shape": [2], "datatype": "BYTES", "data": ["hello", "wörld"]},
        ],
    }
    async with http.post(gateway.url + "/v2/models/echo/infer", json=rest_body) as response:
        assert response.status == 200
        rest = {o["name"]: o for o in (await response.json())["outputs"]}

    answer = result.get_response()
    assert (answer.model_name, answer.id) == ("echo", "r1")
    a, b, c = result.as_numpy("a"), result.as_numpy("b"), result.as_numpy("c")
    assert a.dtype == np.float32 and a.shape == (2, 2)
    assert a.flatten().tolist() == rest["a"]["data"] == [2.0, 5.0, 6.0, -8.0]
    assert b.dtype == np.int64 and b.tolist() == rest["b"]["data"] == [2, -4, 6_000_000_000]
    assert [x.decode() for x in c.tolist()] == rest["c"]["data"] == ["hello", "wörld"]


async def test_infer_with_a_version_and_requested_outputs(gateway, client):
    inputs = [
        _input("x", np.array([1, 2], dtype=np.int32), "INT32"),
        _input("y", np.ones(1, np.float64), "FP64"),
    ]
    outputs = [grpcclient.InferRequestedOutput("y")]
    result = await off_loop(client.infer, "echo", inputs, model_version="3", outputs=outputs)
    assert result.get_response().model_version == "3"
    assert [o.name for o in result.get_response().outputs] == ["y"]
    assert result.as_numpy("y").tolist() == [2.0]


async def test_a_model_that_is_down_is_not_ready_and_neither_is_the_server(gateway, client, http):
    assert not await off_loop(client.is_model_ready, "down")
    assert await off_loop(client.is_model_ready, "echo")
    async with http.get(gateway.url + "/v2/health/ready") as response:
        assert (await response.json())["ready"] is False
    assert await off_loop(client.is_server_ready) is False


async def test_errors_carry_the_grpc_status_and_message(gateway, client):
    x = [_input("x", np.ones(2, np.float32), "FP32")]
    with pytest.raises(InferenceServerException) as unknown:
        await off_loop(client.infer, "nope", x)
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert unknown.value.message() == "model 'nope' not found; known models: down, echo"
    with pytest.raises(InferenceServerException) as not_ready:
        await off_loop(client.is_model_ready, "nope")
    assert not_ready.value.status() == "StatusCode.NOT_FOUND"

    # The model server refuses the request (400): INVALID_ARGUMENT with its message.
    with pytest.raises(InferenceServerException) as refused:
        await off_loop(client.infer, "echo", x, outputs=[grpcclient.InferRequestedOutput("nope")])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unknown output(s) requested: nope" in refused.value.message()

    with pytest.raises(InferenceServerException) as down:
        await off_loop(client.infer, "down", x)
    assert down.value.status() == "StatusCode.UNAVAILABLE"
    assert down.value.message()


async def test_round_robin_alternates_backends(gateway, client, http):
    x = [_input("x", np.ones(2, np.float32), "FP32")]
    for _ in range(4):
        await off_loop(client.infer, "echo", x)
    for backend in ("w0", "w1"):
        count = await metric_value(
            http, gateway.url, "modelyard_requests_total", model="echo", backend=backend, code="200"
        )
        assert count == 2, backend


async def test_not_ready_while_draining(healthy_gateway, healthy_client):
    client = healthy_client
    await off_loop(client.infer, "echo", [_input("x", np.ones(1, np.float32), "FP32")])
    assert await off_loop(client.is_server_ready) is True
    healthy_gateway.server.begin_drain()
    assert not await off_loop(client.is_server_ready)
    assert await off_loop(client.is_server_live)


async def stream_answers(
    client: grpcclient.InferenceServerClient, requests: list[tuple[str, str, np.ndarray]], answers: int
) -> list[tuple[Any, Any]]:
    """The (result, error) pairs a ModelStreamInfer of these (model, request id, FP32 input x)
    requests gets, once `answers` of them have come (tritonclient calls back from its own thread)."""
    got: list[tuple[Any, Any]] = []
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def callback(result: Any, error: Any) -> None:
        got.append((result, error))
        if len(got) == answers:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    await off_loop(client.start_stream, callback, stream_timeout=CLIENT_TIMEOUT)
    try:
        for model, request_id, x in requests:
            await off_loop(client.async_stream_infer, model, [_input("x", x, "FP32")], request_id=request_id)
        await asyncio.wait_for(done, 10)
    finally:
        await off_loop(client.stop_stream)
    return got


async def test_a_stream_answers_each_request_in_order_and_an_error_in_stream(gateway, client):
    requests = [
        (m, i, np.array([v, v], np.float32))
        for m, i, v in (("echo", "s1", 1.5), ("nope", "s2", 0.0), ("echo", "s3", -2.0))
    ]
    answers = await stream_answers(client, requests, 3)
    (first, no_error), (no_result, error), (third, no_error_either) = answers
    assert no_error is None and no_error_either is None and no_result is None
    assert first.get_response().id == "s1" and first.as_numpy("x").tolist() == [3.0, 3.0]
    assert "nope" in str(error)  # the unknown model's error, in the stream, which went on
    assert third.get_response().id == "s3" and third.as_numpy("x").tolist() == [-4.0, -4.0]


async def test_routes_match_the_call_metadata(sim_workers, gateways, http):
    workers = await sim_workers(2, models=["echo"])
    endpoints = [
        {"name": "stable", "url": workers[0].url, "subset": "stable"},
        {"name": "canary", "url": workers[1].url, "subset": "canary"},
    ]
    routes = [
        {
            "name": "testers",
            "match": {"headers": [{"name": "x-tier", "exact": "canary"}]},
            "destinations": [{"subset": "canary"}],
        },
        {"name": "default", "destinations": [{"subset": "stable"}]},
    ]
    model = {"name": "echo", "endpoints": endpoints, "routes": routes, "health_check": {"interval": "60s"}}
    gateway = await gateways([model], listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    x = [_input("x", np.ones(1, np.float32), "FP32")]
    try:
        await off_loop(triton.infer, "echo", x, headers={"x-tier": "canary"})
        await off_loop(triton.infer, "echo", x)
    finally:
        await off_loop(triton.close)
    for backend in ("stable", "canary"):
        count = await metric_value(http, gateway.url, "modelyard_requests_total", backend=backend, code="200")
        assert count == 1, backend


async def test_route_timeout_is_deadline_exceeded(sim_workers, gateways):
    (worker,) = await sim_workers(1, models=["slow"], decode_ms_per_token=5000.0)
    routes = [{"name": "default", "destinations": [{"subset": "default"}], "timeout": "100ms"}]
    gateway = await gateways(
        [model_config("slow", [worker], routes=routes)],
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
    )
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    try:
        with pytest.raises(InferenceServerException) as timed_out:
            await off_loop(triton.infer, "slow", [_input("x", np.ones(1, np.float32), "FP32")])
    finally:
        await off_loop(triton.close)
    assert timed_out.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "100ms" in timed_out.value.message() or "0.1" in timed_out.value.message()


async def test_messages_are_bounded_by_max_body_bytes(sim_workers, gateways):
    workers = await sim_workers(1, models=["echo"])
    gateway = await gateways(
        [model_config("echo", workers)],
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
        limits={"max_body_bytes": 4096},
    )
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    try:
        small = await off_loop(triton.infer, "echo", [_input("x", np.ones(16, np.float32), "FP32")])
        assert small.as_numpy("x").tolist() == [1.0] * 16
        with pytest.raises(InferenceServerException) as refused:
            await off_loop(triton.infer, "echo", [_input("x", np.ones(2048, np.float32), "FP32")])
        # 1,600 bytes of message, but up to 5,000 of JSON (25 a float): over the 4,096 bound too.
        with pytest.raises(InferenceServerException) as too_wide:
            await off_loop(triton.infer, "echo", [_input("x", np.ones(200, np.float64), "FP64")])
    finally:
        await off_loop(triton.close)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert too_wide.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "limits.max_body_bytes (4096)" in too_wide.value.message()


async def test_a_grpc_port_in_use_fails_the_start(sim_workers, gateways):
    workers = await sim_workers(1, models=["echo"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="OIP gRPC"):
            await gateways(
                [model_config("echo", workers)], listen={"host": "127.0.0.1", "port": 0, "grpc_port": port}
            )


async def test_fp16_bool_uint8_and_empty_tensors(healthy_client):
    fp16 = np.array([0.5, -1.25, 1000.0], dtype=np.float16)
    flags = np.array([[True, False], [False, True]], dtype=np.bool_)
    small = np.array([0, 7, 127], dtype=np.uint8)
    empty = np.zeros((0,), dtype=np.float32)
    inputs = [
        _input("h", fp16, "FP16"),
        _input("b", flags, "BOOL"),
        _input("u", small, "UINT8"),
        _input("e", empty, "FP32"),
    ]
    result = await off_loop(healthy_client.infer, "echo", inputs)
    h, b, u, e = (result.as_numpy(name) for name in ("h", "b", "u", "e"))
    assert h.dtype == np.float16 and h.tolist() == [1.0, -2.5, 2000.0]  # the echo model doubles
    assert b.dtype == np.bool_ and b.tolist() == [[True, False], [False, True]]  # and echoes BOOL
    assert u.dtype == np.uint8 and u.tolist() == [0, 14, 254]
    assert e.dtype == np.float32 and e.shape == (0,)


async def test_nan_and_infinity_are_refused(healthy_client):
    for value in (np.nan, np.inf, -np.inf):
        with pytest.raises(InferenceServerException) as refused:
            await off_loop(
                healthy_client.infer, "echo", [_input("x", np.array([1, value], np.float32), "FP32")]
            )
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "NaN or infinity" in refused.value.message()


async def test_an_unknown_model_is_refused_before_its_tensors_are_read(healthy_client):
    # A tensor the gateway would refuse (INVALID_ARGUMENT) for a model it does not have: NOT_FOUND.
    nan = [_input("x", np.array([np.nan], np.float32), "FP32")]
    with pytest.raises(InferenceServerException) as refused:
        await off_loop(healthy_client.infer, "nope", nan)
    assert refused.value.status() == "StatusCode.NOT_FOUND"


@pytest.fixture
async def recorder(gateways) -> AsyncIterator[tuple[Any, list[dict[str, str]]]]:
    """A gateway in front of an OIP v2 server that records each infer request's headers; an input
    named "fail" makes it answer 400 with a 5,000-character error."""
    seen: list[dict[str, str]] = []

    async def infer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body = orjson.loads(await request.read())
        if body["inputs"][0]["name"] == "fail":
            return web.json_response({"error": "e" * 5000}, status=400)
        outputs = [{**tensor, "data": tensor["data"]} for tensor in body["inputs"]]
        return web.json_response({"model_name": "rec", "outputs": outputs})

    async def healthy(request: web.Request) -> web.Response:
        return web.json_response({})  # every health check passes

    app = web.Application()
    app.router.add_post("/v2/models/rec/infer", infer)
    app.router.add_get("/{path:.*}", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        model = {
            "name": "rec",
            "endpoints": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}],
            "health_check": {"interval": "60s"},
        }
        gateway = await gateways([model], listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})
        yield gateway, seen
    finally:
        await runner.cleanup()


async def test_the_backend_gets_no_hop_by_hop_or_framing_headers(recorder):
    gateway, seen = recorder
    x = [_input("x", np.ones(1, np.float32), "FP32")]
    metadata = {
        "transfer-encoding": "chunked",
        "connection": "close",
        "keep-alive": "timeout=5",
        "upgrade": "h2c",
        "expect": "100-continue",
        "content-encoding": "gzip",
        "content-length": "3",
        "x-keep": "yes",
    }
    async with triton_client(gateway) as triton:
        result = await off_loop(triton.infer, "rec", x, headers=metadata)
        assert result.as_numpy("x").tolist() == [1.0]
        await off_loop(triton.infer, "rec", x, headers={"x-request-id": "mine"})
    first, second = ({k.lower(): v for k, v in headers.items()} for headers in seen)
    for name in ("transfer-encoding", "connection", "keep-alive", "upgrade", "expect"):
        assert name not in first, name
    assert "content-encoding" not in first and first["content-length"] != "3"
    assert not any(name.startswith("grpc-") or name == "te" for name in first)
    assert first["content-type"] == "application/json" and first["x-keep"] == "yes"
    assert first["x-request-id"]  # made by the gateway
    assert second["x-request-id"] == "mine"  # the caller's


async def test_a_long_error_from_the_backend_is_cut(recorder):
    gateway, _seen = recorder
    async with triton_client(gateway) as triton:
        with pytest.raises(InferenceServerException) as refused:
            await off_loop(triton.infer, "rec", [_input("fail", np.ones(1, np.float32), "FP32")])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = refused.value.message()
    assert message.startswith("eee") and message.endswith("...") and len(message) <= 1000


async def test_the_routing_log_names_a_grpc_calls_request_id(gateway, client, http):
    x = _input("x", np.ones(2, np.float32), "FP32")
    await off_loop(client.infer, "echo", [x], headers={"x-request-id": "grpc-req-7"})
    await off_loop(client.infer, "echo", [x])  # no id sent: the gateway makes one
    async with http.get(gateway.url + "/admin/log") as response:
        records = [r for r in (await response.json())["records"] if r["model"] == "echo"]
    assert records[-2]["request_id"] == "grpc-req-7"
    assert records[-1]["request_id"] not in ("", "grpc-req-7")
