"""kv_aware affinity shared across gateways through a real redis-server; graceful when it is gone."""

from __future__ import annotations

import socket
import uuid

from support import metric_value, model_config

CHAT = "/v1/chat/completions"


def chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_affinity_learned_on_one_gateway_is_a_hit_on_another(sim_workers, gateways, http, redis_url):
    workers = await sim_workers(3)
    state = {"backend": "redis", "url": redis_url, "key_prefix": f"test-{uuid.uuid4().hex}:"}
    models = [model_config("m", workers, strategy="kv_aware")]
    gateway_a = await gateways(models, state=state, seed=1)
    gateway_b = await gateways(models, state=state, seed=2)

    for i in range(6):
        prompt = f"system prompt number {i} " * 10
        async with http.post(gateway_a.url + CHAT, json=chat(prompt)) as first:
            assert first.headers["X-Modelyard-Cache-Hit"] == "false"
        async with http.post(gateway_b.url + CHAT, json=chat(prompt)) as second:
            assert second.headers["X-Modelyard-Cache-Hit"] == "true"
            assert second.headers["X-Modelyard-Backend"] == first.headers["X-Modelyard-Backend"]
    assert await metric_value(http, gateway_b.url, "modelyard_kv_affinity_total", result="hit") == 6
    assert await metric_value(http, gateway_b.url, "modelyard_state_fallback_total") == 0


async def test_unreachable_redis_falls_back_to_local_routing(sim_workers, gateways, http, caplog):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    workers = await sim_workers(2)
    gateway = await gateways(
        [model_config("m", workers, strategy="kv_aware")], state={"backend": "redis", "url": dead}
    )

    backends = set()
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat("same prompt")) as response:
            assert response.status == 200
            backends.add(response.headers["X-Modelyard-Backend"])
    # Local affinity still keeps the prompt on one endpoint while Redis is away.
    assert len(backends) == 1
    assert await metric_value(http, gateway.url, "modelyard_state_fallback_total") >= 1
    assert any("shared state unavailable" in record.getMessage() for record in caplog.records)
