"""tritonclient.http, unchanged, against the gateway in front of sim-workers: JSON and the binary
tensor extension (tritonclient's default), each datatype, and the same answers both ways."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from modelyard.protocols.oip import BINARY_HEADER
from support import model_config

SCALE = 2.0
TENSORS = {
    "FP32": np.array([[0.5, -1.25, 3.0], [4.0, 5.5, -6.0]], dtype=np.float32),
    "FP64": np.array([0.1, -2.5], dtype=np.float64),
    "FP16": np.array([1.5, -2.0], dtype=np.float16),
    "INT8": np.array([-3, 4], dtype=np.int8),
    "INT32": np.array([[-7], [8]], dtype=np.int32),
    "INT64": np.array([[1, -2], [3, 2**40]], dtype=np.int64),
    "UINT8": np.array([0, 100], dtype=np.uint8),
    "UINT64": np.array([1, 2**40], dtype=np.uint64),
    "BOOL": np.array([[True, False], [False, True]], dtype=np.bool_),
    "BYTES": np.array([b"hello", b"", "h\xe9".encode()], dtype=np.object_),
}


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=SCALE, models=["echo"])
    return await gateways([model_config("echo", workers, health_check={"path": "/v2/health/ready"})])


class _Client(triton.InferenceServerClient):
    """tritonclient.http's client with a destructor that does nothing: its `close()`, run again
    by `__del__`, fails when the garbage collector frees the client in another thread than the
    one gevent tied it to. Each call makes, uses and closes its client in one worker thread (the
    servers run in this event loop, which the blocking client must not hold)."""

    def __del__(self) -> None:
        pass


async def in_client(url: str, use: Callable[[triton.InferenceServerClient], Any]) -> Any:
    def call() -> Any:
        client = _Client(url.removeprefix("http://"))
        try:
            return use(client)
        finally:
            client.close()

    return await asyncio.to_thread(call)


def triton_inputs(tensors: dict[str, np.ndarray], binary: bool) -> list[triton.InferInput]:
    inputs = []
    for name, x in tensors.items():
        tensor = triton.InferInput(name, list(x.shape), triton.np_to_triton_dtype(x.dtype))
        if binary:
            tensor.set_data_from_numpy(x)  # binary_data=True is tritonclient's default
        else:
            tensor.set_data_from_numpy(x, binary_data=False)
        inputs.append(tensor)
    return inputs


async def infer(
    url: str,
    model: str,
    tensors: dict[str, np.ndarray],
    binary_in: bool,
    binary_out: bool | None,
    output_names: list[str] | None = None,
) -> Any:
    """`binary_out=None` names no outputs, which tritonclient sends as `binary_data_output`;
    otherwise the outputs are `output_names`, by default those of the inputs (the sim echoes)."""
    inputs = triton_inputs(tensors, binary_in)
    outputs = None
    if binary_out is not None:
        names = list(tensors) if output_names is None else output_names
        outputs = [triton.InferRequestedOutput(n, binary_data=binary_out) for n in names]
    return await in_client(url, lambda client: client.infer(model, inputs, outputs=outputs))


def expected(x: np.ndarray) -> np.ndarray:
    return x if x.dtype in (np.bool_, np.object_) else x * x.dtype.type(SCALE)


def as_bytes(result: np.ndarray) -> list[bytes]:
    """BYTES come back as `bytes` from binary outputs and as `str` from JSON ones."""
    return [x if isinstance(x, bytes) else x.encode() for x in result.ravel()]


@pytest.mark.parametrize(
    ("binary_in", "binary_out"), [(True, True), (True, False), (False, True), (True, None)]
)
async def test_every_datatype_binary_and_json_agree(gateway, binary_in, binary_out):
    json_result = await infer(gateway.url, "echo", TENSORS, False, False)
    result = await infer(gateway.url, "echo", TENSORS, binary_in, binary_out)
    raw = result.get_response()
    for output in raw["outputs"]:
        assert ("binary_data_size" in output.get("parameters", {})) == (binary_out is not False)
    for name, x in TENSORS.items():
        got, via_json = result.as_numpy(name), json_result.as_numpy(name)
        assert got.shape == x.shape
        if name == "BYTES":
            assert as_bytes(got) == as_bytes(via_json) == list(x.ravel())
        else:
            assert got.dtype == x.dtype
            np.testing.assert_array_equal(got, expected(x))
            np.testing.assert_array_equal(got, via_json)


async def test_binary_straight_to_the_sim_worker(sim_workers):
    (worker,) = await sim_workers(1, oip_scale=SCALE, models=["echo"])
    metadata = await in_client(worker.url, lambda client: client.get_server_metadata())
    assert metadata["extensions"] == ["binary_tensor_data"]
    x = {"FP32": TENSORS["FP32"], "BYTES": TENSORS["BYTES"]}
    result = await infer(worker.url, "echo", x, True, True)
    np.testing.assert_array_equal(result.as_numpy("FP32"), expected(TENSORS["FP32"]))
    assert list(result.as_numpy("BYTES").ravel()) == list(TENSORS["BYTES"].ravel())


async def test_gateway_relays_binary_bodies_and_headers_unchanged(gateway, http):
    head = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}}
            ],
            "outputs": [{"name": "x", "parameters": {"binary_data": True}}],
        }
    )
    body = head + struct.pack("<2i", 3, -4)
    headers = {BINARY_HEADER: str(len(head)), "Content-Type": "application/octet-stream"}
    async with http.post(gateway.url + "/v2/models/echo/infer", data=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"] == "application/octet-stream"
        length = int(response.headers[BINARY_HEADER])
        answer = await response.read()
    assert orjson.loads(answer[:length])["outputs"] == [
        {"name": "x", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}}
    ]
    assert answer[length:] == struct.pack("<2i", 6, -8)


async def test_bad_binary_bodies_are_400s_naming_what_is_wrong(gateway, http):
    async def post(body: bytes, length: int) -> tuple[int, str, bool]:
        headers = {BINARY_HEADER: str(length)}
        async with http.post(gateway.url + "/v2/models/echo/infer", data=body, headers=headers) as response:
            error = (await response.json())["error"]
            assert isinstance(error, str)
            return response.status, error, "X-Modelyard-Backend" in response.headers

    def request(size: int, shape: list[int]) -> bytes:
        return orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": shape,
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": size},
                    }
                ]
            }
        )

    head = request(8, [2])
    # Refused by the gateway, which reads the JSON header and the sizes it names:
    status, error, upstream = await post(head + b"\x00" * 8, len(head) + 9)
    assert (status, upstream) == (400, False)
    assert f"{BINARY_HEADER} is {len(head) + 9} but the body has {len(head) + 8} bytes" in error
    status, error, upstream = await post(head + b"\x00" * 10, len(head))
    assert (status, upstream) == (400, False)
    assert "2 bytes after the JSON header are not claimed" in error
    status, error, upstream = await post(head + b"\x00" * 4, len(head))
    assert (status, upstream) == (400, False)
    assert "input 'x': binary_data_size 8 runs past the end of the body" in error
    bare = orjson.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32"}]})
    status, error, upstream = await post(bare + b"\x00" * 8, len(bare))
    assert (status, upstream) == (400, False)
    assert "8 bytes after the JSON header are not claimed" in error
    # Refused by the sim-worker, which decodes the tensors:
    head = request(8, [3])
    status, error, upstream = await post(head + b"\x00" * 8, len(head))
    assert (status, upstream) == (400, True)
    assert "input 'x' (shape [3], FP32): 8 bytes of binary data, 12 expected" in error
    bare = orjson.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32"}]})
    status, error, upstream = await post(bare, len(bare))
    assert (status, upstream) == (400, True)
    assert "input 'x': missing 'data' (or, binary, parameters.binary_data_size)" in error


async def test_tritonclient_sees_the_sim_workers_400(gateway):
    (tensor,) = triton_inputs({"x": np.zeros((2, 2), dtype=np.float32)}, True)
    tensor.set_shape([3])  # the shape no longer matches the 16 bytes sent
    message = r"\[400\] input 'x' \(shape \[3\], FP32\): 16 bytes of binary data, 12 expected"
    with pytest.raises(InferenceServerException, match=message):
        await in_client(gateway.url, lambda client: client.infer("echo", [tensor]))


async def test_binary_body_over_the_limit_is_a_413(sim_workers, gateways, http):
    workers = await sim_workers(1, models=["echo"])
    gateway = await gateways([model_config("echo", workers)], limits={"max_body_bytes": 1024})
    head = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [512], "datatype": "FP32", "parameters": {"binary_data_size": 2048}}
            ]
        }
    )
    headers = {BINARY_HEADER: str(len(head))}
    async with http.post(
        gateway.url + "/v2/models/echo/infer", data=head + bytes(2048), headers=headers
    ) as response:
        assert response.status == 413
        assert "limits.max_body_bytes" in (await response.json())["error"]


async def test_kserve_v1_is_unaffected(gateway, http):
    async with http.post(gateway.url + "/v1/models/echo:predict", json={"instances": [[1, 2.5]]}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/json")
        assert BINARY_HEADER not in response.headers
        assert await response.json() == {"predictions": [[2, 5.0]]}
