"""Fallback models (models[].fallbacks, fallback_on, context_window): a request its model cannot serve
goes on to the next fallback, named in the body (OpenAI) or the path (OIP v2, KServe v1), before its
first byte only; the answer says which model gave it (X-Modelyard-Fallback); a fallback the caller's
key may not use is skipped; each model's exchange is counted for that model, the fallback's records
carrying the model asked for."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelyard.config import validate_config
from modelyard.errors import ConfigError
from modelyard.gateway import GATEWAY
from otlp_receiver import OtlpReceiver
from support import free_ports, metric_value, model_config, sim_stats, wait_until

CHAT = "/v1/chat/completions"
FALLBACK = "X-Modelyard-Fallback"
NO_RETRIES = [{"name": "default", "destinations": [{"subset": "default"}], "retries": {"attempts": 0}}]


def chat(model: str = "main", words: int = 1, **extra: Any) -> dict[str, Any]:
    content = " ".join(["hi"] * words)
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


async def served(http: Any, worker: Any, kind: str = "chat_completions") -> int:
    return int((await sim_stats(http, worker))["requests_by_endpoint"].get(kind, 0))


async def log_records(http: Any, gateway: Any, request_id: str) -> list[dict[str, Any]]:
    async with http.get(gateway.url + "/admin/log") as response:
        records = (await response.json())["records"]
    return [r for r in records if r["request_id"] == request_id]


async def test_a_5xx_after_retries_goes_to_the_first_fallback_named_in_the_body(sim_workers, gateways, http):
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (spare,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("main", [failing], fallbacks=["spare"]), model_config("spare", [spare])]
    )
    headers = {"X-Request-Id": "fb-5xx"}
    async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
        assert response.status == 200, await response.text()
        assert response.headers[FALLBACK] == "spare"
        assert (await response.json())["model"] == "spare"  # the body sent named the fallback
    assert await served(http, failing) == 1 and await served(http, spare) == 1
    # counted for each model: the asked model's 500, the fallback's 200; the step on by its reason
    assert await metric_value(http, gateway.url, "modelyard_requests_total", model="main", code="500") == 1
    assert await metric_value(http, gateway.url, "modelyard_requests_total", model="spare", code="200") == 1
    fell = await metric_value(
        http, gateway.url, "modelyard_fallbacks_total", model="main", fallback="spare", reason="server_error"
    )
    assert fell == 1
    records = await log_records(http, gateway, "fb-5xx")
    assert [(r["model"], r["status"], r["fallback_for"]) for r in records] == [
        ("main", 500, ""),
        ("spare", 200, "main"),
    ]
    # a model that answers has no fallback header, and its body is forwarded as it came
    async with http.post(gateway.url + CHAT, json=chat("spare")) as response:
        assert response.status == 200 and FALLBACK not in response.headers


async def test_the_fallbacks_are_tried_in_order_and_the_last_ones_answer_is_the_clients(
    sim_workers, gateways, http
):
    (first,) = await sim_workers(1, fail_rate=1.0)
    (second,) = await sim_workers(1, fail_rate=1.0)
    (third,) = await sim_workers(1, fail_rate=1.0)
    gateway = await gateways(
        [
            model_config("main", [first], fallbacks=["b", "c"]),
            model_config("b", [second], fallbacks=["main"]),  # only the asked model's list is tried
            model_config("c", [third]),
        ]
    )
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "fb-all"}) as response:
        assert response.status == 500  # c's own answer, relayed as it is
        assert response.headers[FALLBACK] == "c"
    assert [await served(http, w) for w in (first, second, third)] == [1, 1, 1]
    records = await log_records(http, gateway, "fb-all")
    assert [(r["model"], r["fallback_for"]) for r in records] == [("main", ""), ("b", "main"), ("c", "main")]


async def test_a_saturated_model_sends_its_overflow_to_the_fallback(sim_workers, gateways, http):
    (busy,) = await sim_workers(1, decode_ms_per_token=50.0)
    (spare,) = await sim_workers(1)
    full = {"max_requests": 1, "max_pending_requests": 0}
    gateway = await gateways(
        [
            model_config("main", [busy], circuit_breakers=full, fallbacks=["spare"]),
            model_config("spare", [spare]),
        ]
    )
    long = chat(max_tokens=200, stream=True)
    async with http.post(gateway.url + CHAT, json=long) as holding:
        await holding.content.readline()  # it holds main's one slot
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            assert response.status == 200 and response.headers[FALLBACK] == "spare"
        # OIP too, which could otherwise refuse a full model before reading the body
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with http.post(gateway.url + "/v2/models/main/infer", json=body) as response:
            assert response.status == 200 and response.headers[FALLBACK] == "spare"
    reason = {"model": "main", "fallback": "spare", "reason": "saturated"}
    assert await metric_value(http, gateway.url, "modelyard_fallbacks_total", **reason) == 2
    assert await metric_value(http, gateway.url, "modelyard_requests_total", model="main", code="429") == 2


async def test_a_model_with_no_healthy_endpoint_falls_back(sim_workers, gateways, http):
    (spare,) = await sim_workers(1)
    (port,) = free_ports(1)
    down = {"interval": "60s", "unhealthy_threshold": 1}
    gateway = await gateways(
        [
            {
                "name": "main",
                "endpoints": [{"name": "gone", "url": f"http://127.0.0.1:{port}"}],
                "health_check": down,
                "fallbacks": ["spare"],
            },
            model_config("spare", [spare]),
        ]
    )
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "spare"
    reason = {"model": "main", "fallback": "spare", "reason": "no_endpoint"}
    assert await metric_value(http, gateway.url, "modelyard_fallbacks_total", **reason) == 1


async def test_a_timeout_falls_back_and_only_the_conditions_named_do(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=5000.0)
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (spare,) = await sim_workers(1)
    quick = [{**NO_RETRIES[0], "timeout": "300ms"}]
    gateway = await gateways(
        [
            model_config("main", [slow], routes=quick, fallbacks=["spare"]),
            # only timeouts: its 500 is the client's
            model_config("picky", [failing], fallbacks=["spare"], fallback_on=["timeout"]),
            model_config("spare", [spare]),
        ]
    )
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "spare"
    reason = {"model": "main", "fallback": "spare", "reason": "timeout"}
    assert await metric_value(http, gateway.url, "modelyard_fallbacks_total", **reason) == 1
    assert await metric_value(http, gateway.url, "modelyard_requests_total", model="main", code="504") == 1
    async with http.post(gateway.url + CHAT, json=chat("picky")) as response:
        assert response.status == 500 and FALLBACK not in response.headers
    assert await served(http, spare) == 1


async def test_a_prompt_too_long_for_the_model_goes_to_a_longer_one(sim_workers, gateways, http):
    (short,) = await sim_workers(1, max_model_len=10)
    (long,) = await sim_workers(1, max_model_len=1000)
    gateway = await gateways(
        [
            model_config("main", [short], fallbacks=["long"]),
            model_config("long", [long]),
            model_config("windowed", [short], context_window=10, fallbacks=["long"]),
        ]
    )
    # the server says so (vLLM's message, OpenAI's code): read, and sent on
    async with http.post(gateway.url + CHAT, json=chat(words=20)) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "long"
    assert await served(http, short) == 1
    # a 400 that is not about the context is the client's, as it came
    async with http.post(gateway.url + CHAT, json=chat(max_tokens=-1)) as response:
        assert response.status == 400 and FALLBACK not in response.headers
        assert (await response.json())["error"]["code"] == "invalid_max_tokens"
    # context_window: estimated over it, straight to the fallback; the short model never sees it
    async with http.post(gateway.url + CHAT, json=chat("windowed", words=20)) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "long"
    async with http.post(gateway.url + CHAT, json=chat("windowed", words=3)) as response:
        assert response.status == 200 and FALLBACK not in response.headers
    assert await served(http, short) == 3  # the long request, the bad one, the short windowed one
    for model in ("main", "windowed"):
        reason = {"model": model, "fallback": "long", "reason": "context_length"}
        assert await metric_value(http, gateway.url, "modelyard_fallbacks_total", **reason) == 1


async def test_a_stream_falls_back_before_its_first_byte_and_never_after(sim_workers, gateways, http):
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (stalling,) = await sim_workers(1, decode_ms_per_token=5000.0)
    (spare,) = await sim_workers(1)
    idle = [{**NO_RETRIES[0], "stream_idle_timeout": "200ms"}]
    gateway = await gateways(
        [
            model_config("main", [failing], fallbacks=["spare"]),
            model_config("stalls", [stalling], routes=idle, fallbacks=["spare"]),
            model_config("spare", [spare]),
        ]
    )
    async with http.post(gateway.url + CHAT, json=chat(stream=True, max_tokens=3)) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "spare"
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
    assert '"model":"spare"' in text and text.endswith("data: [DONE]\n\n")
    # its 200 went out, then it went idle: it ends with an error event, never moves to the fallback
    async with http.post(gateway.url + CHAT, json=chat("stalls", stream=True)) as response:
        assert response.status == 200 and FALLBACK not in response.headers
        text = await response.text()
    assert '"error"' in text and "sent nothing" in text
    assert await served(http, spare) == 1


async def test_the_oip_path_names_the_fallback(sim_workers, gateways, http):
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (spare,) = await sim_workers(1, oip_scale=2.0)
    gateway = await gateways(
        [model_config("main", [failing], fallbacks=["spare"]), model_config("spare", [spare])]
    )
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    for path in ("/v2/models/main/infer", "/v2/models/main/versions/7/infer"):
        async with http.post(gateway.url + path, json=body) as response:
            assert response.status == 200 and response.headers[FALLBACK] == "spare"
            answer = await response.json()
        assert answer["model_name"] == "spare" and "model_version" not in answer
        assert answer["outputs"][0]["data"] == [2.0]
    async with http.post(gateway.url + "/v1/models/main:predict", json={"instances": [[1.0]]}) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "spare"
    # metadata and readiness are the model's own: no fallback
    async with http.get(gateway.url + "/v2/models/main/ready") as response:
        assert FALLBACK not in response.headers


async def test_a_fallback_the_callers_key_may_not_use_is_skipped(sim_workers, gateways, http, tmp_path: Path):
    keys = {
        "tenants": [{"name": "a", "models": ["main", "open"]}],
        "keys": [{"name": "a-app", "tenant": "a", "key": "sk-team-a-0123456789"}],
    }
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(keys))
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (closed,) = await sim_workers(1)
    (open_,) = await sim_workers(1)
    gateway = await gateways(
        [
            model_config("main", [failing], fallbacks=["closed", "open"]),
            model_config("closed", [closed]),
            model_config("open", [open_]),
        ],
        auth={"enabled": True, "keys_file": str(path)},
    )
    headers = {"Authorization": "Bearer sk-team-a-0123456789"}
    async with http.post(gateway.url + CHAT, json=chat(), headers=headers) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "open"
    assert await served(http, closed) == 0 and await served(http, open_) == 1
    skipped = {"model": "main", "fallback": "closed", "why": "not_allowed"}
    assert await metric_value(http, gateway.url, "modelyard_fallbacks_skipped_total", **skipped) == 1


async def test_the_access_log_has_a_line_per_model_tried(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO, logger="modelyard.access")
    (failing,) = await sim_workers(1, fail_rate=1.0)
    (spare,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("main", [failing], fallbacks=["spare"]), model_config("spare", [spare])],
        logging={"access_log": True},
    )
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "fb-log"}) as response:
        assert response.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "modelyard.access"]
    assert len(lines) == 2 and all('"request_id":"fb-log"' in line for line in lines)
    assert '"model":"main"' in lines[0] and "fallback_for" not in lines[0]
    assert '"model":"spare"' in lines[1] and '"fallback_for":"main"' in lines[1]


async def test_a_client_gone_while_the_first_model_fails_is_not_sent_on(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=5000.0)
    (spare,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("main", [slow], fallbacks=["spare"]), model_config("spare", [spare])]
    )
    task = asyncio.create_task(http.post(gateway.url + CHAT, json=chat()))

    async def running() -> bool:
        return int((await sim_stats(http, slow))["running"]) == 1

    await wait_until(running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def closed() -> bool:
        return (
            await metric_value(http, gateway.url, "modelyard_requests_total", model="main", code="499") == 1
        )

    await wait_until(closed)
    assert await served(http, spare) == 0


async def test_one_trace_holds_every_model_tried(sim_workers, gateways, http):
    receiver = await OtlpReceiver().start()
    try:
        (failing,) = await sim_workers(1, fail_rate=1.0)
        (spare,) = await sim_workers(1)
        gateway = await gateways(
            [model_config("main", [failing], fallbacks=["spare"]), model_config("spare", [spare])],
            telemetry={"otlp_endpoint": receiver.url},
        )
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            assert response.status == 200
        tracer = gateway.app[GATEWAY].tracer
        assert tracer is not None and await asyncio.to_thread(tracer.force_flush)
        (asked,) = [s for s in receiver.spans if s.kind == "server"]
        assert asked.name == "POST main" and asked.attributes["http.response.status_code"] == 500
        (fallback,) = [s for s in receiver.children(asked) if s.kind == "internal"]
        assert fallback.name == "POST spare" and fallback.trace_id == asked.trace_id
        assert fallback.attributes["modelyard.fallback_for"] == "main"
        assert fallback.attributes["http.response.status_code"] == 200
    finally:
        await receiver.stop()


async def test_the_readmes_example_works_as_it_says(sim_workers, gateways, http):
    example = yaml.safe_load((Path(__file__).parents[2] / "examples" / "fallbacks.yaml").read_text())
    (small,) = await sim_workers(1, max_model_len=64, max_concurrency=1, decode_ms_per_token=20.0)
    (large,) = await sim_workers(1, max_model_len=4096)
    (backup,) = await sim_workers(1)
    workers = {"small": small, "large": large, "backup": backup}
    models = [
        {**m, "endpoints": [{**e, "url": workers[m["name"]].url} for e in m["endpoints"]]}
        for m in example["models"]
    ]
    gateway = await gateways(models)
    async with http.post(gateway.url + CHAT, json=chat("small", words=100)) as response:
        assert response.status == 200 and response.headers[FALLBACK] == "large"
    async with http.post(gateway.url + CHAT, json=chat("small", words=3)) as response:
        assert response.status == 200 and FALLBACK not in response.headers
    assert await served(http, small) == 1


def test_config_errors_name_the_field_and_what_was_wrong() -> None:
    endpoints = [{"url": "http://127.0.0.1:9"}]
    data = {
        "models": [
            {"name": "a", "endpoints": endpoints, "fallbacks": ["a", "b", "b", "nowhere"]},
            {"name": "b", "endpoints": endpoints, "fallback_on": ["5xx"], "context_window": 0},
        ]
    }
    with pytest.raises(ConfigError) as caught:
        validate_config(data, "gateway.yaml")
    problems = caught.value.problems
    assert caught.value.source == "gateway.yaml"
    assert "models[0].fallbacks[0]: a model cannot fall back to itself ('a')" in problems
    assert "models[0].fallbacks[2]: 'b' is named twice" in problems
    assert "models[0].fallbacks[3]: 'nowhere' is not a model of this gateway (models: a, b)" in problems
    assert any(p.startswith("models[1].fallback_on[0]: expected one of 'saturated'") for p in problems)
    assert any(p.startswith("models[1].context_window: ") for p in problems)
    # following a scheduler, a fallback may be a model it places later
    follows = {"models": [data["models"][1] | {"fallback_on": ["timeout"], "context_window": 5}]}
    follows["models"][0]["fallbacks"] = ["placed-later"]
    config = validate_config({**follows, "placement": {"scheduler": "127.0.0.1:9"}}, "gateway.yaml")
    assert config.models[0].fallbacks == ["placed-later"]
