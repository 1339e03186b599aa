"""tritonclient.http and tritonclient.grpc through the gateway to a real MLServer: the
scikit-learn iris model of test_graph_mlserver.py, whose fixture builds MLServer's virtual
environment under .cache/.

MLServer 1.7.1 does not read the binary tensor extension on REST (SeldonIO/MLServer#324): it
refuses tritonclient's default binary inputs (422, or 500 when the bytes are not UTF-8), and
answers outputs asked for in binary in JSON, which tritonclient reads as well. The gateway
relays both as they come; with `set_data_from_numpy(x, binary_data=False)` MLServer works.
Over gRPC, MLServer reads raw_input_contents, tritonclient's default: relayed to its gRPC port
(`grpc_url`), the call works as sent."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from test_graph_mlserver import SETOSA, VIRGINICA, mlserver, mlserver_urls
from test_oip_grpc import off_loop
from test_tritonclient_http import infer, triton_inputs

from modelyard.protocols.oip import BINARY_HEADER
from support import metric_value

__all__ = ["mlserver", "mlserver_urls"]

ROWS = {"x": np.array([SETOSA, VIRGINICA], dtype=np.float64)}


def iris(url: str) -> dict[str, object]:
    return {
        "name": "iris",
        "protocol": "v2",
        "endpoints": [{"url": url}],
        "health_check": {"path": "/v2/health/ready"},
    }


async def test_json_inputs_and_binary_outputs_through_the_gateway(mlserver, gateways):
    gateway = await gateways([iris(mlserver)])
    for binary_out in (False, True, None):
        via_gateway = await infer(gateway.url, "iris", ROWS, False, binary_out, ["predict"])
        direct = await infer(mlserver, "iris", ROWS, False, binary_out, ["predict"])
        assert via_gateway.as_numpy("predict").ravel().tolist() == [0, 2]
        assert via_gateway.as_numpy("predict").tolist() == direct.as_numpy("predict").tolist()


async def test_binary_inputs_get_mlservers_own_answer_through_the_gateway(mlserver, gateways, http):
    gateway = await gateways([iris(mlserver)])
    body, json_size = triton.InferenceServerClient.generate_request_body(
        triton_inputs(ROWS, True), [triton.InferRequestedOutput("predict", binary_data=True)]
    )
    headers = {BINARY_HEADER: str(json_size), "Content-Type": "application/octet-stream"}
    answers = []
    for url in (mlserver, gateway.url):
        async with http.post(url + "/v2/models/iris/infer", data=body, headers=headers) as response:
            answers.append((response.status, response.headers["Content-Type"], await response.read()))
    assert answers[0] == answers[1]
    # MLServer parses the whole body as JSON: 422, or 500 when its error cannot quote the bytes.
    assert answers[0][0] in (422, 500)


async def test_grpc_calls_are_relayed_to_mlservers_grpc_port(mlserver_urls, gateways, http):
    rest_url, grpc_url = mlserver_urls
    model = iris(rest_url)
    model["endpoints"][0]["grpc_url"] = grpc_url
    gateway = await gateways([model], listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0})
    answers = []
    for target in (grpc_url.removeprefix("grpc://"), f"127.0.0.1:{gateway.grpc_port}"):
        client = triton_grpc.InferenceServerClient(url=target)
        try:
            x = triton_grpc.InferInput("x", [2, 4], "FP64")
            x.set_data_from_numpy(ROWS["x"])  # raw_input_contents, tritonclient's default
            result = await off_loop(client.infer, "iris", [x], request_id="q1")
            ready = await off_loop(client.is_model_ready, "iris")
            metadata = await off_loop(client.get_model_metadata, "iris")
        finally:
            await off_loop(client.close)
        answers.append((result.get_response(), ready, metadata))
    (direct, direct_ready, direct_metadata), (via_gateway, ready, metadata) = answers
    assert via_gateway == direct  # the message as MLServer sent it
    assert via_gateway.id == "q1" and ready and direct_ready and metadata == direct_metadata
    assert triton_grpc.InferResult(via_gateway).as_numpy("predict").ravel().tolist() == [0, 2]
    served = await metric_value(http, gateway.url, "modelyard_requests_total", model="iris", code="200")
    assert served == 3  # infer, ready and metadata, each routed
