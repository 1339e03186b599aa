"""Every bad input gets a clear error in its protocol's shape and the right status."""

from __future__ import annotations

import socket

import pytest

from support import model_config

CHAT = "/v1/chat/completions"


def openai_error(body: dict) -> dict:
    assert set(body) == {"error"}
    assert {"message", "type", "code"} <= set(body["error"])
    return body["error"]


@pytest.fixture
async def gateway(sim_workers, gateways):
    workers = await sim_workers(1)
    return await gateways(
        [model_config("alpha", workers), model_config("beta", workers)], limits={"max_body_bytes": 1024}
    )


async def test_malformed_json_is_400(gateway, http):
    async with http.post(gateway.url + CHAT, data=b'{"model": "alpha", "messages": [}') as response:
        assert response.status == 400
        error = openai_error(await response.json())
    assert error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"'])
async def test_empty_or_non_object_body_is_400(gateway, http, body):
    async with http.post(gateway.url + CHAT, data=body) as response:
        assert response.status == 400
        openai_error(await response.json())


async def test_unknown_model_is_404_naming_the_known_models(gateway, http):
    async with http.post(gateway.url + CHAT, json={"model": "gamma", "messages": []}) as response:
        assert response.status == 404
        error = openai_error(await response.json())
    assert error["code"] == "model_not_found"
    assert "'gamma'" in error["message"] and "alpha, beta" in error["message"]


async def test_missing_model_is_404_naming_the_known_models(gateway, http):
    async with http.post(gateway.url + "/v1/embeddings", json={"input": "x"}) as response:
        assert response.status == 404
        assert "known models: alpha, beta" in openai_error(await response.json())["message"]


async def test_chat_without_messages_is_400(gateway, http):
    async with http.post(gateway.url + CHAT, json={"model": "alpha"}) as response:
        assert response.status == 400
        assert "messages" in openai_error(await response.json())["message"]


async def test_body_over_the_limit_is_413(gateway, http):
    big = {"model": "alpha", "messages": [{"role": "user", "content": "x" * 2000}]}
    async with http.post(gateway.url + CHAT, json=big) as response:
        assert response.status == 413
        error = openai_error(await response.json())
    assert "max_body_bytes" in error["message"] and "1024" in error["message"]
    async with http.post(gateway.url + "/v2/models/alpha/infer", data=b"{" + b" " * 2000 + b"}") as response:
        assert response.status == 413
        assert "max_body_bytes" in (await response.json())["error"]


async def test_chunked_body_over_the_limit_is_413(gateway, http):
    async def chunks():
        for _ in range(10):
            yield b" " * 500

    async with http.post(gateway.url + CHAT, data=chunks()) as response:
        assert response.status == 413


async def test_unknown_path_is_404(gateway, http):
    async with http.get(gateway.url + "/v1/nothing-here") as response:
        assert response.status == 404
        assert "no route" in openai_error(await response.json())["message"]
    async with http.get(gateway.url + "/v2/nothing") as response:
        assert response.status == 404
        assert isinstance((await response.json())["error"], str)


async def test_wrong_method_is_405_with_allow(gateway, http):
    async with http.get(gateway.url + CHAT) as response:
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert openai_error(await response.json())["code"] == "method_not_allowed"
    async with http.delete(gateway.url + "/v2/models/alpha/infer") as response:
        assert response.status == 405
        assert isinstance((await response.json())["error"], str)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_no_healthy_endpoint_is_503(gateways, http):
    model = {"name": "down", "endpoints": [{"url": closed_port_url()}, {"url": closed_port_url()}]}
    gateway = await gateways([model])
    async with http.post(gateway.url + CHAT, json={"model": "down", "messages": []}) as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert openai_error(await response.json())["code"] == "no_healthy_endpoint"
    async with http.get(gateway.url + "/readyz") as response:
        assert response.status == 503
        assert (await response.json())["models_without_healthy_endpoints"] == ["down"]


async def test_all_endpoints_refusing_is_502(gateways, http):
    # Without active health checks the gateway only learns at request time that all are down.
    endpoints = [{"url": closed_port_url()}, {"url": closed_port_url()}]
    gateway = await gateways([{"name": "down", "endpoints": endpoints, "health_check": {"interval": 0}}])
    async with http.post(gateway.url + "/v2/models/down/infer", json={"inputs": []}) as response:
        assert response.status == 502
        assert "refused the connection" in (await response.json())["error"]


async def test_upstream_errors_are_relayed_as_they_are(sim_workers, gateways, http):
    workers = await sim_workers(1, fail_rate=1.0)
    gateway = await gateways([model_config("flaky", workers)])
    async with http.post(gateway.url + CHAT, json={"model": "flaky", "messages": []}) as response:
        assert response.status == 500
        assert response.headers["X-Modelyard-Backend"] == "w0"
        openai_error(await response.json())


async def test_gateway_survives_bad_input(gateway, http):
    for body in (b"\xff\xfe", b"{" * 500, b'{"model": 5, "messages": []}'):
        async with http.post(gateway.url + CHAT, data=body) as response:
            assert response.status == 400
    async with http.post(gateway.url + CHAT, json={"model": "alpha", "messages": []}) as response:
        assert response.status == 200


async def test_get_on_a_predict_path_is_405(gateway, http):
    async with http.get(gateway.url + "/v1/models/alpha:predict") as response:
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert isinstance((await response.json())["error"], str)


async def test_other_methods_on_a_predict_path_allow_only_post(gateway, http):
    # The 405 lists what the path allows: GET matched /v1/models/{name} once (found by schemathesis).
    async with http.request("OPTIONS", gateway.url + "/v1/models/alpha:predict") as response:
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
