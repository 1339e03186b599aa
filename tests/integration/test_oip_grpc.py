"""OIP v2 over gRPC: tritonclient.grpc, unchanged, against the gateway's listen.grpc_port, routed to
REST sim-workers. The client is synchronous, so each call runs in a thread while the gateway serves
on the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from support import free_ports, metric_value, model_config

T = TypeVar("T")


async def off_loop(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(call, *args, **kwargs)


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"])
    (dead,) = free_ports(1)  # nothing listens there
    down = {"name": "down", "endpoints": [{"name": "d0", "url": f"http://127.0.0.1:{dead}"}]}
    models = [model_config("echo", workers, health_check={"path": "/v2/health/ready"}), down]
    return await gateways(models, listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})


@pytest.fixture
async def client(gateway) -> AsyncIterator[grpcclient.InferenceServerClient]:
    assert gateway.grpc_port
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    yield triton
    await off_loop(triton.close)


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)  # raw_input_contents, tritonclient's default
    return tensor


async def test_health_and_metadata(gateway, client, http):
    assert await off_loop(client.is_server_live)
    async with http.get(gateway.url + "/v2/health/ready") as response:
        rest_ready = (await response.json())["ready"]
    assert await off_loop(client.is_server_ready) == rest_ready
    assert (await off_loop(client.get_server_metadata)).name == "modelyard"
    assert await off_loop(client.is_model_ready, "echo")
    assert await off_loop(client.is_model_ready, "echo", "1")
    assert not await off_loop(client.is_model_ready, "down")
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


async def test_not_ready_while_draining(gateway, client):
    await off_loop(client.infer, "echo", [_input("x", np.ones(1, np.float32), "FP32")])
    gateway.server.begin_drain()
    assert not await off_loop(client.is_server_ready)
    assert await off_loop(client.is_server_live)


async def test_stream_infer_is_unimplemented(gateway, client):
    errors: list[Any] = []
    done = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()

    def callback(result: Any, error: Any) -> None:
        errors.append(error)
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    await off_loop(client.start_stream, callback)
    # The gateway refuses the stream as it opens; tritonclient may see that before this request.
    with contextlib.suppress(InferenceServerException):
        await off_loop(client.async_stream_infer, "echo", [_input("x", np.ones(1, np.float32), "FP32")])
    await asyncio.wait_for(done, 10)
    await off_loop(client.stop_stream)
    assert errors[0] is not None and "StatusCode.UNIMPLEMENTED" in str(errors[0].status())


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
    finally:
        await off_loop(triton.close)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


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
