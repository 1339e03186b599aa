"""Tenants' quotas and runtime keys through a real gateway: requests and tokens per minute,
concurrent requests, budgets; 429 with Retry-After and OpenAI's x-ratelimit-* headers; a stream's
usage asked for on the gateway's behalf and not relayed; keys made, listed and revoked at runtime;
what happens while Redis is away; usage by tenant and key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from support import model_config, wait_until

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"


def keys_file(tmp_path: Path, a_limits: dict[str, Any], key_limits: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "keys.yaml"
    key_a: dict[str, Any] = {"name": "a-app", "tenant": "a", "key": KEY_A}
    if key_limits:
        key_a["limits"] = key_limits
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {"name": "a", "models": ["chat"], "limits": a_limits},
                    {"name": "b", "models": ["*"]},
                ],
                "keys": [key_a, {"name": "b-app", "tenant": "b", "key": KEY_B}],
            }
        )
    )
    return path


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 4,
    }
    if stream:
        body["stream"] = True
    return {**body, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def start(sim_workers, gateways, path: Path, **config: Any) -> Any:
    workers = await sim_workers(1)
    return await gateways(
        [
            model_config(
                "chat", workers, endpoints=[{"name": "w0", "url": workers[0].url, "cost_per_1k_tokens": 2.0}]
            )
        ],
        auth={"enabled": True, "keys_file": str(path), **config.pop("auth", {})},
        admin={"token": ADMIN},
        **config,
    )


async def test_requests_per_minute_answer_429_with_openais_headers(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, keys_file(tmp_path, {"requests_per_minute": 3}))
    remaining = []
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            assert response.status == 200
            assert response.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(response.headers["x-ratelimit-remaining-requests"])
            assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == ["2", "1", "0"]
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
        assert response.status == 429
        assert 1 <= int(response.headers["Retry-After"]) <= 60
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        error = (await response.json())["error"]
        assert error["code"] == "rate_limit_exceeded" and "tenant a" in error["message"]
    # another tenant is not limited by a's quota, and gets no x-ratelimit-* fields (it has no limits)
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_B)) as response:
        assert response.status == 200 and "x-ratelimit-limit-requests" not in response.headers
    # OIP's envelope for the same refusal
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    async with http.post(gateway.url + "/v2/models/chat/infer", json=body, headers=bearer(KEY_A)) as response:
        assert response.status == 429 and "rate limit" in (await response.json())["error"]


async def test_a_keys_own_limit_applies_within_its_tenants(sim_workers, gateways, http, tmp_path):
    path = keys_file(tmp_path, {"requests_per_minute": 100}, key_limits={"requests_per_minute": 2})
    gateway = await start(sim_workers, gateways, path)
    codes = []
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            codes.append(response.status)
            if response.status == 429:
                assert "key a-app" in (await response.json())["error"]["message"]
    assert codes == [200, 200, 429]


async def test_tokens_come_from_the_answers_usage_streams_included(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, keys_file(tmp_path, {"tokens_per_minute": 1000}))
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
        usage = (await response.json())["usage"]
        assert response.headers["x-ratelimit-remaining-tokens"] == "1000"  # counted when it ends
    # a stream the client asked no usage of: the gateway asks for it, and keeps it to itself
    async with http.post(gateway.url + CHAT, json=chat(stream=True), headers=bearer(KEY_A)) as response:
        events = [line for line in (await response.read()).decode().split("\n\n") if line.startswith("data:")]
    payloads = [json.loads(e[5:]) for e in events if e.strip() != "data: [DONE]"]
    assert payloads and not any(p.get("usage") for p in payloads)
    assert events[-1].strip() == "data: [DONE]"
    # a client that asked for it gets it, as it asked
    asked = chat(stream=True, stream_options={"include_usage": True})
    async with http.post(gateway.url + CHAT, json=asked, headers=bearer(KEY_A)) as response:
        text = (await response.read()).decode()
    streamed_usage = [json.loads(e[5:])["usage"] for e in text.split("\n\n") if '"usage":{' in e]
    assert len(streamed_usage) == 1
    per_request = usage["total_tokens"]
    expected = per_request * 3  # the same prompt and max_tokens three times

    async def counted() -> bool:
        async with http.get(gateway.url + "/admin/usage", headers=bearer(ADMIN)) as response:
            tenants = {t["tenant"]: t for t in (await response.json())["tenants"]}
        return "a" in tenants and tenants["a"]["tokens"] == expected and tenants["a"]["requests"] == 3

    await wait_until(counted, attempts=100, interval=0.02)
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == str(1000 - expected)
    async with http.get(gateway.url + "/metrics") as response:
        metrics = await response.text()
    assert f'modelyard_tenant_tokens_total{{tenant="a"}} {float(expected + per_request)}' in metrics or (
        f'modelyard_tenant_tokens_total{{tenant="a"}} {float(expected)}' in metrics
    )


async def test_a_token_limit_refuses_once_the_window_is_used_up(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, keys_file(tmp_path, {"tokens_per_minute": 10}))
    async with http.post(gateway.url + CHAT, json=chat(max_tokens=8), headers=bearer(KEY_A)) as response:
        assert response.status == 200  # let in: the window had tokens left; its own count at its end
        assert (await response.json())["usage"]["total_tokens"] > 10

    async def refused() -> bool:
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            if response.status != 429:
                return False
            assert response.headers["x-ratelimit-remaining-tokens"] == "0"
            return "tokens per minute" in (await response.json())["error"]["message"]

    await wait_until(refused, attempts=50, interval=0.02)


async def test_concurrent_requests_hold_a_slot_until_they_end(sim_workers, gateways, http, tmp_path):
    path = keys_file(tmp_path, {"max_concurrent_requests": 1})
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("chat", workers)], auth={"enabled": True, "keys_file": str(path)})
    async with http.post(
        gateway.url + CHAT, json=chat(stream=True, max_tokens=10), headers=bearer(KEY_A)
    ) as stream:
        await stream.content.readuntil(b"\n\n")  # under way: it holds the tenant's one slot
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            assert response.status == 429
            assert "concurrent requests" in (await response.json())["error"]["message"]
        await stream.read()

    async def freed() -> bool:
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            return response.status == 200

    await wait_until(freed, attempts=50, interval=0.02)


async def test_a_spent_budget_is_429_insufficient_quota(sim_workers, gateways, http, tmp_path):
    # one answer's tokens cost more than the budget (2 USD per 1k tokens; budget 0.00001 USD)
    gateway = await start(sim_workers, gateways, keys_file(tmp_path, {"budget": 0.00001}))
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
        assert response.status == 200

    async def spent() -> bool:
        async with http.post(gateway.url + CHAT, json=chat(max_tokens=1), headers=bearer(KEY_A)) as response:
            if response.status != 429:
                return False
            error = (await response.json())["error"]
            return error["code"] == "insufficient_quota" and int(response.headers["Retry-After"]) > 0

    await wait_until(spent, attempts=50, interval=0.02)
    async with http.get(gateway.url + "/admin/usage", headers=bearer(ADMIN)) as response:
        tenant = {t["tenant"]: t for t in (await response.json())["tenants"]}["a"]
    assert tenant["cost"] > 0.00001 and tenant["refused"] >= 1


async def test_runtime_keys_made_listed_and_revoked(sim_workers, gateways, http, tmp_path):
    store = tmp_path / "runtime-keys.json"
    gateway = await start(
        sim_workers,
        gateways,
        keys_file(tmp_path, {}),
        auth={"runtime_keys_file": str(store), "key_refresh_interval": 0.1},
    )
    admin = bearer(ADMIN)
    # the admin token is needed
    async with http.post(gateway.url + "/admin/keys", json={"name": "x", "tenant": "a"}) as response:
        assert response.status == 401
    body = {"name": "a-ci", "tenant": "a", "limits": {"requests_per_minute": 1}}
    async with http.post(gateway.url + "/admin/keys", json=body, headers=admin) as response:
        assert response.status == 201
        made = await response.json()
    key = made["key"]
    assert key.startswith("sk-my-") and made["tenant"] == "a"
    assert key not in store.read_text() and made["name"] in store.read_text()  # hashed at rest
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(key)) as response:
        assert response.status == 200 and response.headers["x-ratelimit-limit-requests"] == "1"
    async with http.get(gateway.url + "/admin/keys", headers=admin) as response:
        listed = {k["name"]: k for k in (await response.json())["keys"]}
    assert set(listed) == {"a-app", "b-app", "a-ci"} and listed["a-ci"]["source"] == "runtime"
    assert key not in json.dumps(listed)
    # bad input: each a 400 or 409 naming what is wrong
    for bad, status, words in [
        ({"name": "a-ci", "tenant": "a"}, 409, "exists already"),
        ({"name": "a-app", "tenant": "a"}, 409, "keys file"),
        ({"name": "z", "tenant": "nobody"}, 400, "key.tenant"),
        ({"name": "z", "tenant": "a", "models": ["echo"]}, 400, "key.models"),
        ({"name": "z", "tenant": "a", "limits": {"requests_per_minute": -1}}, 400, "requests_per_minute"),
        ({"name": "z", "tenant": "a", "owner": "me"}, 400, "unknown field owner"),
        ({"name": "z", "tenant": "a", "key": "short"}, 400, "key.key"),
    ]:
        async with http.post(gateway.url + "/admin/keys", json=bad, headers=admin) as response:
            assert response.status == status, bad
            assert words in (await response.json())["error"]["message"], bad
    async with http.delete(gateway.url + "/admin/keys/a-app", headers=admin) as response:
        assert response.status == 409  # the file's keys are revoked by editing the file
    async with http.delete(gateway.url + "/admin/keys/a-ci", headers=admin) as response:
        assert response.status == 200
    async with http.delete(gateway.url + "/admin/keys/a-ci", headers=admin) as response:
        assert response.status == 404
    async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(key)) as response:
        assert response.status == 401


async def test_without_a_store_runtime_keys_say_how_to_turn_them_on(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, keys_file(tmp_path, {}))
    body = {"name": "a-ci", "tenant": "a"}
    async with http.post(gateway.url + "/admin/keys", json=body, headers=bearer(ADMIN)) as response:
        assert response.status == 409
        assert "runtime_keys_file" in (await response.json())["error"]["message"]
    async with http.get(gateway.url + "/admin/keys", headers=bearer(ADMIN)) as response:
        assert {k["name"] for k in (await response.json())["keys"]} == {"a-app", "b-app"}


async def test_runtime_keys_on_redis_reach_every_gateway(sim_workers, gateways, http, tmp_path, redis_url):
    path = keys_file(tmp_path, {})
    state = {"backend": "redis", "url": redis_url, "key_prefix": "test-rk:"}
    auth = {"key_refresh_interval": 0.1}
    one = await start(sim_workers, gateways, path, state=state, auth=dict(auth))
    two = await start(sim_workers, gateways, path, state=state, auth=dict(auth))
    async with http.post(
        one.url + "/admin/keys", json={"name": "shared", "tenant": "b"}, headers=bearer(ADMIN)
    ) as response:
        key = (await response.json())["key"]

    async def works_on_two() -> bool:
        async with http.post(two.url + CHAT, json=chat(), headers=bearer(key)) as response:
            return response.status == 200

    await wait_until(works_on_two, attempts=100, interval=0.05)
    # revoked on two: refused on one within the refresh interval
    async with http.delete(two.url + "/admin/keys/shared", headers=bearer(ADMIN)) as response:
        assert response.status == 200

    async def refused_on_one() -> bool:
        async with http.post(one.url + CHAT, json=chat(), headers=bearer(key)) as response:
            return response.status == 401

    await wait_until(refused_on_one, attempts=100, interval=0.05)


async def test_a_key_revoked_mid_stream_finishes_its_stream(sim_workers, gateways, http, tmp_path):
    store = tmp_path / "runtime-keys.json"
    workers = await sim_workers(1, decode_ms_per_token=30.0)
    gateway = await gateways(
        [model_config("chat", workers)],
        auth={"enabled": True, "keys_file": str(keys_file(tmp_path, {})), "runtime_keys_file": str(store),
              "key_refresh_interval": 0.05},
        admin={"token": ADMIN},
    )  # fmt: skip
    async with http.post(
        gateway.url + "/admin/keys", json={"name": "s", "tenant": "a"}, headers=bearer(ADMIN)
    ) as r:
        key = (await r.json())["key"]
    async with http.post(
        gateway.url + CHAT, json=chat(stream=True, max_tokens=20), headers=bearer(key)
    ) as stream:
        assert stream.status == 200
        await stream.content.readuntil(b"\n\n")  # the first event is here: the stream is under way
        async with http.delete(gateway.url + "/admin/keys/s", headers=bearer(ADMIN)) as response:
            assert response.status == 200
        rest = await stream.read()
    assert rest.rstrip().endswith(b"data: [DONE]")

    async def refused() -> bool:
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(key)) as response:
            return response.status == 401

    await wait_until(refused, attempts=100, interval=0.02)


async def test_one_limit_holds_across_two_gateways_of_two_workers(
    sim_workers, serve_workers, redis_url, tmp_path
):
    """The issue's check: 2 gateways x 2 workers on one Redis, 100 requests a minute: 100 pass."""
    workers = await sim_workers(1)
    config = {
        "models": [model_config("chat", workers)],
        "auth": {"enabled": True, "keys_file": str(keys_file(tmp_path, {"requests_per_minute": 100}))},
        "state": {"backend": "redis", "url": redis_url, "key_prefix": "test-2x2:"},
    }
    replicas = [await serve_workers(config), await serve_workers(config)]
    connector = aiohttp.TCPConnector(force_close=True, limit=16)  # a connection each: both workers serve
    served: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def send(i: int) -> int:
            async with session.post(
                replicas[i % 2].url + CHAT, json=chat(), headers=bearer(KEY_A)
            ) as response:
                await response.read()
                return response.status

        codes = await asyncio.gather(*(send(i) for i in range(300)))
        for replica in replicas:  # every worker of both gateways answered some
            for _ in range(40):
                async with session.get(replica.url + "/healthz") as response:
                    worker = (await response.json())["worker"]
                served[worker] = served.get(worker, 0) + 1
    assert codes.count(200) == 100 and codes.count(429) == 200
    assert set(served) == {0, 1}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("local", [200, 200, 429]), ("refuse", [503, 503, 503]), ("allow", [200, 200, 200])],
)
async def test_while_redis_is_away_quotas_do_as_configured(
    sim_workers, gateways, http, tmp_path, mode, expected
):
    from support import free_ports

    (nobody,) = free_ports(1)  # nothing listens there
    gateway = await start(
        sim_workers,
        gateways,
        keys_file(tmp_path, {"requests_per_minute": 2}),
        state={"backend": "redis", "url": f"redis://127.0.0.1:{nobody}/0", "timeout": 0.05},
        auth={"quota_store_down": mode},
    )
    codes = []
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            codes.append(response.status)
    assert codes == expected


async def test_grpc_calls_and_graph_runs_count_against_the_limits_too(sim_workers, gateways, http, tmp_path):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [{"name": "a", "models": ["echo", "steps"], "limits": {"requests_per_minute": 2}}],
                "keys": [{"name": "a-app", "tenant": "a", "key": KEY_A}],
            }
        )
    )
    echo = await sim_workers(1, models=["echo"], oip_scale=2.0)
    graph = {"steps": {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "echo"}]}}}}
    gateway = await gateways(
        [model_config("echo", echo)],
        auth={"enabled": True, "keys_file": str(path)},
        graphs=graph,
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
    )
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    tensor = grpcclient.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    try:
        answer = await asyncio.to_thread(
            client.infer, "echo", [tensor], headers={"authorization": f"Bearer {KEY_A}"}, client_timeout=30
        )
        assert answer.as_numpy("x")[0] == 2.0
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with http.post(gateway.url + "/v1/graphs/steps", json=body, headers=bearer(KEY_A)) as response:
            assert response.status == 200 and response.headers["x-ratelimit-remaining-requests"] == "0"
        # the tenant's two requests a minute are spent: a third, by gRPC or as a graph, is refused
        with pytest.raises(InferenceServerException) as caught:
            await asyncio.to_thread(
                client.infer,
                "echo",
                [tensor],
                headers={"authorization": f"Bearer {KEY_A}"},
                client_timeout=30,
            )
        assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        async with http.post(gateway.url + "/v1/graphs/steps", json=body, headers=bearer(KEY_A)) as response:
            assert response.status == 429
    finally:
        await asyncio.to_thread(client.close)


async def test_a_request_that_falls_back_is_one_request_of_its_tenant(sim_workers, gateways, http, tmp_path):
    """Each model tried is an exchange of its own; the tenant's request is counted once, with the
    answer's tokens and status, and its concurrency slot freed once."""
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (spare,) = await sim_workers(1)
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [{"name": "a", "models": ["*"], "limits": {"max_concurrent_requests": 1}}],
                "keys": [{"name": "a-app", "tenant": "a", "key": KEY_A}],
            }
        )
    )
    gateway = await gateways(
        [model_config("main", [failing], fallbacks=["spare"]), model_config("spare", [spare])],
        auth={"enabled": True, "keys_file": str(path)},
        admin={"token": ADMIN},
    )
    for _ in range(2):  # the slot is free again after the first: the second is let in too
        async with http.post(
            gateway.url + CHAT, json={**chat(), "model": "main"}, headers=bearer(KEY_A)
        ) as response:
            assert response.status == 200 and response.headers["X-Modelyard-Fallback"] == "spare"
            tokens = (await response.json())["usage"]["total_tokens"]
    async with http.get(gateway.url + "/admin/usage", headers=bearer(ADMIN)) as response:
        (tenant,) = (await response.json())["tenants"]
    assert (tenant["requests"], tenant["tokens"], tenant["errors"]) == (2, 2 * tokens, 0)


async def test_a_request_refused_before_its_exchange_opens_frees_its_slot(
    sim_workers, gateways, http, tmp_path
):
    """A model whose routes take no request without a header: 404 after the quota let it in; the
    concurrency slot it took is given back (else the tenant would be locked out for the lease)."""
    workers = await sim_workers(1)
    path = keys_file(tmp_path, {"max_concurrent_requests": 1, "requests_per_minute": 100})
    routes = [
        {
            "name": "only-beta",
            "match": {"headers": [{"name": "x-beta", "exact": "1"}]},
            "destinations": [{"subset": "default"}],
        }
    ]
    gateway = await gateways(
        [model_config("chat", workers, routes=routes)],
        auth={"enabled": True, "keys_file": str(path)},
        admin={"token": ADMIN},
    )
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat(), headers=bearer(KEY_A)) as response:
            assert response.status == 404, await response.text()
            assert response.headers["x-ratelimit-limit-requests"] == "100"  # the gateway's own answers too
    async with http.post(
        gateway.url + CHAT, json=chat(), headers={**bearer(KEY_A), "x-beta": "1"}
    ) as response:
        assert response.status == 200
    async with http.get(gateway.url + "/admin/usage", headers=bearer(ADMIN)) as response:
        (tenant,) = (await response.json())["tenants"]
    assert (tenant["requests"], tenant["errors"]) == (4, 3)
