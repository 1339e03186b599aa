"""Open Inference Protocol v2 and KServe v1 through the gateway."""

from __future__ import annotations

import pytest

from support import model_config

INPUT = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"])
    return await gateways([model_config("echo", workers, health_check={"path": "/v2/health/ready"})])


async def test_infer(gateway, http):
    async with http.post(gateway.url + "/v2/models/echo/infer", json={"id": "r1", **INPUT}) as response:
        assert response.status == 200
        assert response.headers["X-Modelyard-Backend"] in {"w0", "w1"}
        body = await response.json()
    assert body["model_name"] == "echo"
    assert body["id"] == "r1"
    assert body["outputs"] == [
        {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [2.0, 4.0, 6.0, 8.0]}
    ]


async def test_infer_with_version(gateway, http):
    async with http.post(gateway.url + "/v2/models/echo/versions/3/infer", json=INPUT) as response:
        assert response.status == 200
        assert (await response.json())["model_version"] == "3"


async def test_model_metadata_and_readiness(gateway, http):
    async with http.get(gateway.url + "/v2/models/echo") as response:
        assert response.status == 200
        assert (await response.json())["name"] == "echo"
    async with http.get(gateway.url + "/v2/models/echo/ready") as response:
        assert response.status == 200
    async with http.get(gateway.url + "/v2/models/echo/versions/1/ready") as response:
        assert response.status == 200


async def test_server_health_and_metadata(gateway, http):
    async with http.get(gateway.url + "/v2/health/live") as response:
        assert (response.status, await response.json()) == (200, {"live": True})
    async with http.get(gateway.url + "/v2/health/ready") as response:
        assert (response.status, await response.json()) == (200, {"ready": True})
    async with http.get(gateway.url + "/v2") as response:
        assert (await response.json())["name"] == "modelyard"


async def test_kserve_v1_predict(gateway, http):
    body = {"instances": [[1, 2], [3, 4]]}
    async with http.post(gateway.url + "/v1/models/echo:predict", json=body) as response:
        assert response.status == 200
        assert await response.json() == {"predictions": [[2, 4], [6, 8]]}
    async with http.get(gateway.url + "/v1/models/echo") as response:
        assert (await response.json())["ready"] is True


async def test_oip_errors_use_the_oip_envelope(gateway, http):
    async with http.post(gateway.url + "/v2/models/nope/infer", json=INPUT) as response:
        assert response.status == 404
        assert await response.json() == {"error": "model 'nope' not found; known models: echo"}
    async with http.post(gateway.url + "/v2/models/echo/infer", data=b"{not json") as response:
        assert response.status == 400
        assert isinstance((await response.json())["error"], str)
    async with http.post(gateway.url + "/v1/models/nope:predict", json={"instances": [1]}) as response:
        assert response.status == 404
        assert "echo" in (await response.json())["error"]


async def test_binary_tensor_extension_is_forwarded_untouched(gateway, http):
    header = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.5]}]}'
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    # The gateway parses only the JSON head; a body with binary bytes after it is still routed.
    async with http.post(gateway.url + "/v2/models/echo/infer", data=header, headers=headers) as response:
        assert response.headers["X-Modelyard-Backend"] in {"w0", "w1"}
    bad = {"Inference-Header-Content-Length": "abc"}
    async with http.post(gateway.url + "/v2/models/echo/infer", data=header, headers=bad) as response:
        assert response.status == 400
