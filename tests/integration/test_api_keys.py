"""API keys and tenants (auth.enabled): every inference route asks for a key from the keys file
(OpenAI's `Authorization: Bearer`, Azure's `api-key`), answers 401 without one and 403 for a model
the key's tenant may not use, each in the protocol's own envelope, before saying whether the model
exists; GET /v1/models lists what the key may use; gRPC and graphs obey it too; the key never
reaches a server; a key taken out of the file stops working without a restart."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from aiohttp import web
from tritonclient.utils import InferenceServerException

from modelyard.config import validate_config
from modelyard.errors import ConfigError
from modelyard.gateway import start_gateway
from support import model_config, wait_until

CHAT = "/v1/chat/completions"
KEY_A = "sk-team-a-0123456789"  # tenant a: model chat only
KEY_B = "sk-team-b-9876543210"  # tenant b: every model
KEYS = {
    "tenants": [{"name": "a", "models": ["chat", "steps"]}, {"name": "b", "models": ["*"]}],
    "keys": [
        {"name": "a-app", "tenant": "a", "key": KEY_A},
        {"name": "b-app", "tenant": "b", "key": KEY_B},
    ],
}
# A graph tenant a may use: its steps run with the gateway's authority (echo is not among a's models)
GRAPH = {"steps": {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "echo"}]}}}}


def chat(model: str = "chat") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def secured(sim_workers, gateways, tmp_path: Path):
    """A gateway with auth on over two models, chat and echo (an OIP model), and a graph."""
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    chat_workers = await sim_workers(1)
    echo_workers = await sim_workers(1, models=["echo"], oip_scale=2.0)
    gateway = await gateways(
        [model_config("chat", chat_workers), model_config("echo", echo_workers)],
        auth={"enabled": True, "keys_file": str(path)},
        graphs=GRAPH,
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
    )
    return gateway, path


async def test_a_call_without_a_key_the_file_holds_is_401_in_each_protocols_envelope(secured, http):
    gateway, _ = secured
    cases = [
        ("POST", CHAT, {}, chat(), "missing_api_key"),
        ("POST", CHAT, bearer("sk-unknown-000000"), chat(), "invalid_api_key"),
        ("POST", CHAT, {"Authorization": "Basic dXNlcjpwdw=="}, chat(), "invalid_api_key"),
        ("POST", CHAT, {"api-key": "sk-unknown-000000"}, chat(), "invalid_api_key"),
        ("POST", "/v1/completions", {}, {"model": "chat", "prompt": "hi"}, "missing_api_key"),
        ("GET", "/v1/models", {}, None, "missing_api_key"),
    ]
    for method, path, headers, body, code in cases:
        async with http.request(method, gateway.url + path, headers=headers, json=body) as response:
            assert response.status == 401, path
            assert response.headers["WWW-Authenticate"] == 'Bearer realm="modelyard"'
            error = (await response.json())["error"]
            assert error["code"] == code and error["type"] == "authentication_error", error
    # OIP and KServe v1: their envelope, {"error": "..."}; and no word on whether the model exists
    for path in ("/v2/models/echo/infer", "/v2/models/nowhere/infer", "/v1/models/echo:predict"):
        async with http.post(gateway.url + path, json={"inputs": []}) as response:
            assert response.status == 401, path
            assert "API key" in (await response.json())["error"]
    async with http.get(gateway.url + "/v2/models/echo/ready") as response:
        assert response.status == 401
    async with http.post(gateway.url + "/v1/graphs/steps", json={}) as response:
        assert response.status == 401


async def test_a_key_may_use_its_tenants_models_only(secured, http):
    gateway, _ = secured
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
        assert response.status == 200
    async with http.post(gateway.url + CHAT, json=chat(), headers={"api-key": KEY_A}) as response:
        assert response.status == 200  # as Azure OpenAI's clients send it
    async with http.post(gateway.url + CHAT, json=chat("echo"), headers=bearer(KEY_A)) as response:
        assert response.status == 403
        error = (await response.json())["error"]
        assert error["code"] == "model_not_allowed" and "'a-app' of tenant 'a'" in error["message"]
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    async with http.post(gateway.url + "/v2/models/echo/infer", json=body, headers=bearer(KEY_A)) as response:
        assert response.status == 403 and "may not use 'echo'" in (await response.json())["error"]
    async with http.post(gateway.url + "/v2/models/echo/infer", json=body, headers=bearer(KEY_B)) as response:
        assert response.status == 200
    async with http.post(gateway.url + "/v1/graphs/steps", json=body, headers=bearer(KEY_A)) as response:
        assert response.status == 200  # the graph is among tenant a's names
    # GET /v1/models: what the key may use
    for key, expected in ((KEY_A, ["chat"]), (KEY_B, ["chat", "echo"])):
        async with http.get(gateway.url + "/v1/models", headers=bearer(key)) as response:
            assert sorted(m["id"] for m in (await response.json())["data"]) == expected


async def test_grpc_calls_obey_the_keys_too(secured):
    gateway, _ = secured
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    tensor = grpcclient.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))

    def infer(headers: dict[str, str] | None) -> Any:
        return client.infer("echo", [tensor], headers=headers, client_timeout=30)

    try:
        with pytest.raises(InferenceServerException) as caught:
            await asyncio.to_thread(infer, None)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as caught:
            await asyncio.to_thread(infer, {"authorization": f"Bearer {KEY_A}"})
        assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
        answer = await asyncio.to_thread(infer, {"authorization": f"Bearer {KEY_B}"})
        assert answer.as_numpy("x") is not None or answer.get_response() is not None
        with pytest.raises(InferenceServerException) as caught:
            await asyncio.to_thread(client.is_model_ready, "echo", client_timeout=30)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        await asyncio.to_thread(client.close)


async def test_the_key_never_reaches_the_server(gateways, http, tmp_path):
    seen: list[tuple[str | None, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), request.headers.get("api-key")))
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_post(CHAT, record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        path = tmp_path / "keys.yaml"
        path.write_text(
            yaml.safe_dump({**KEYS, "tenants": [{"name": "a", "models": ["chat"]}, KEYS["tenants"][1]]})
        )
        gateway = await gateways(
            [
                {
                    "name": "chat",
                    "endpoints": [{"url": f"http://127.0.0.1:{port}"}],
                    "health_check": {"interval": 0},
                }
            ],
            auth={"enabled": True, "keys_file": str(path)},
        )
        for headers in (bearer(KEY_A), {"api-key": KEY_A}):
            async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
                assert response.status == 200
        assert seen == [(None, None), (None, None)]
    finally:
        await runner.cleanup()


async def test_a_key_taken_out_of_the_file_stops_working_without_a_restart(secured, http):
    gateway, path = secured
    revoked = {**KEYS, "keys": KEYS["keys"][1:]}
    path.write_text(yaml.safe_dump(revoked))
    os.utime(path, ns=(1, 1))  # (a new mtime within the filesystem's granularity too)

    async def refused() -> bool:
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            return response.status == 401

    await wait_until(refused, attempts=100, interval=0.05)  # read again within 2 s
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_B)) as response:
        assert response.status == 200


async def test_off_by_default_and_a_bad_keys_file_stops_the_start_naming_the_field(sim_workers, tmp_path):
    workers = await sim_workers(1)
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({**KEYS, "keys": [{"name": "x", "tenant": "c", "key": KEY_A}]}))
    config = {"listen": {"port": 0}, "models": [model_config("chat", workers)]}
    assert validate_config(config, "<test>").auth.enabled is False
    with pytest.raises(ConfigError) as caught:
        await start_gateway(
            validate_config({**config, "auth": {"enabled": True, "keys_file": str(path)}}, "<t>")
        )
    assert str(path) in str(caught.value) and "keys[0].tenant" in str(caught.value)
    with pytest.raises(ConfigError, match="enabled needs keys_file"):
        validate_config({**config, "auth": {"enabled": True}}, "<test>")


async def test_the_openapi_document_says_which_calls_need_a_key(secured, http):
    gateway, _ = secured
    async with http.get(gateway.url + "/openapi.json") as response:  # (open: it names no key)
        document = await response.json()
    schemes = document["components"]["securitySchemes"]
    assert schemes["apiKey"]["scheme"] == "bearer" and schemes["azureApiKey"]["name"] == "api-key"
    chat_post = document["paths"][CHAT]["post"]
    assert chat_post["security"] == [{"apiKey": []}, {"azureApiKey": []}]
    assert {"401", "403"} <= set(chat_post["responses"])
    infer = document["paths"]["/v2/models/{name}/infer"]["post"]
    schema = infer["responses"]["401"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("InferenceError")  # OIP's envelope
    assert "security" not in document["paths"]["/healthz"]["get"]  # probes need no key


async def test_a_key_of_bytes_that_are_not_utf8_is_refused_not_a_crash(secured):
    """Raw header bytes 0x80-0xFF (what an attacker may send) on both listeners' paths."""
    gateway, _ = secured
    host, port = gateway.url.removeprefix("http://").split(":")
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    for header in (b"Authorization: Bearer sk-\xff\xfe-bytes-000", b"api-key: \xc3\x28\xff0000000"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + header
            + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
            + body
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b"invalid_api_key" in answer
