"""KServe's own Python client (`kserve.InferenceRESTClient` and `InferenceGRPCClient`), unchanged,
against the gateway: v1 `:predict`, OIP v2 over REST, and OIP v2 over gRPC.

The client runs in a process of its own: KServe's generated code and tritonclient's (which other
tests import into this process) both put `inference.*` messages into protobuf's default pool, and
one process cannot hold both. modelyard's own OIP messages live in a private pool, so the client's
process imports modelyard too, to show that a user's environment can hold both.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest

from support import model_config

CLIENT = """
import asyncio, json, sys
import modelyard.rpc  # beside KServe's generated code in one process
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

url, grpc_url = sys.argv[1], sys.argv[2]


def request() -> InferRequest:
    x = InferInput(name="x", shape=[3], datatype="FP32", data=[1.0, 2.0, 3.0])
    return InferRequest(model_name="echo", infer_inputs=[x])


async def main() -> None:
    out = {}
    v1 = InferenceRESTClient(RESTConfig(protocol="v1", timeout=30))
    out["v1"] = await v1.infer(url, {"instances": [[1.0, 2.0]]}, model_name="echo")
    out["v1_ready"] = await v1.is_model_ready(url, "echo")
    v2 = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    answer = await v2.infer(url, request(), model_name="echo")
    out["v2"] = {"model": answer.model_name, "data": answer.outputs[0].data}
    out["v2_ready"] = await v2.is_server_ready(url)
    grpc = InferenceGRPCClient(grpc_url, timeout=30)
    answer = await grpc.infer(request())
    out["grpc"] = {"model": answer.model_name, "data": answer.outputs[0].as_numpy().tolist()}
    out["grpc_ready"] = await grpc.is_model_ready("echo")
    await grpc.close()
    print(json.dumps(out))


asyncio.run(main())
"""


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(2, oip_scale=2.0, models=["echo"])
    models = [model_config("echo", workers, health_check={"path": "/v2/health/ready"})]
    return await gateways(models, listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})


async def test_kserves_client_unchanged_over_every_protocol(gateway):
    grpc_url = f"127.0.0.1:{gateway.grpc_port}"
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, gateway.url, grpc_url,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(client.communicate(), timeout=120)
    assert client.returncode == 0, err.decode()[-3000:]
    answers = orjson.loads(out.splitlines()[-1])
    assert answers["v1"]["predictions"] == [[2.0, 4.0]]  # the sim-worker scales by oip_scale
    assert answers["v1_ready"] is True
    assert answers["v2"] == {"model": "echo", "data": [2.0, 4.0, 6.0]}
    assert answers["v2_ready"] is True
    assert answers["grpc"] == {"model": "echo", "data": [2.0, 4.0, 6.0]}
    assert answers["grpc_ready"] is True
