"""The sim worker over real sockets: OpenAI, OIP v2, KServe v1, metrics and the latency model."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from modelyard.simworker import SimWorker, SimWorkerConfig

FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0}
CHAT = "/v1/chat/completions"
POLL_SECONDS = 10.0

StartSim = Callable[..., Awaitable[SimWorker]]


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """`await start_sim(**config)`: a worker on an ephemeral port, zero latency unless overridden."""
    started: list[SimWorker] = []

    async def start(**overrides: Any) -> SimWorker:
        worker = SimWorker(SimWorkerConfig(**{**FAST, "port": 0, **overrides}))
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(client: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with client.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with client.get(url) as response:
        return response.status, await response.json(content_type=None)


async def sim_stats(client: aiohttp.ClientSession, worker: SimWorker) -> dict[str, Any]:
    return (await get(client, f"{worker.url}/sim/stats"))[1]


async def metrics(client: aiohttp.ClientSession, worker: SimWorker) -> dict[str, float]:
    """`name{labels}` -> value for every sample in /metrics."""
    async with client.get(f"{worker.url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


async def poll_stats(
    client: aiohttp.ClientSession, worker: SimWorker, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Poll /sim/stats until `done(stats)`, for at most POLL_SECONDS."""
    deadline = asyncio.get_running_loop().time() + POLL_SECONDS
    while asyncio.get_running_loop().time() < deadline:
        stats = await sim_stats(client, worker)
        if done(stats):
            return stats
    raise AssertionError(f"condition not reached within {POLL_SECONDS}s; last stats: {stats}")


async def next_event(response: aiohttp.ClientResponse) -> bytes:
    """The payload of the next SSE `data:` line."""
    for _ in range(100):
        line = await response.content.readline()
        if not line:
            raise AssertionError("stream ended")
        if line.startswith(b"data: "):
            return line[len(b"data: ") :].rstrip(b"\r\n")
    raise AssertionError("no data line in 100 lines")


async def read_events(response: aiohttp.ClientResponse, limit: int = 1000) -> list[bytes]:
    """Every remaining SSE payload up to and including [DONE]."""
    events = []
    for _ in range(limit):
        events.append(await next_event(response))
        if events[-1] == b"[DONE]":
            return events
    raise AssertionError(f"no [DONE] within {limit} events")


def chat_body(content: str = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": "any-model", "messages": [{"role": "user", "content": content}], **extra}


# OpenAI ------------------------------------------------------------------------------------------


async def test_chat_completion_json_and_usage(start_sim, client):
    worker = await start_sim()
    status, body = await post(client, worker.url + CHAT, chat_body(max_tokens=5))
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["model"] == "any-model"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 5, 8)
    _, again = await post(client, worker.url + CHAT, chat_body(max_tokens=5))
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_chat_defaults_to_16_tokens_and_accepts_max_completion_tokens(start_sim, client):
    worker = await start_sim()
    _, body = await post(client, worker.url + CHAT, chat_body())
    assert body["usage"]["completion_tokens"] == 16
    _, body = await post(client, worker.url + CHAT, chat_body(max_completion_tokens=2))
    assert body["usage"]["completion_tokens"] == 2


async def test_chat_stream_sends_the_first_chunk_while_the_request_still_runs(start_sim, client):
    worker = await start_sim(decode_ms_per_token=20.0)
    fast = await start_sim()
    body = chat_body("stream me", max_tokens=20, stream=True, stream_options={"include_usage": True})
    async with client.post(worker.url + CHAT, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = orjson.loads(await next_event(response))
        during = await sim_stats(client, worker)
        rest = await read_events(response)
    assert during["running"] == 1
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert rest[-1] == b"[DONE]"
    chunks = [first, *map(orjson.loads, rest[:-1])]
    assert len(chunks) == 20 + 2  # one per token, the finish chunk, the usage chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks[:20]] == [None] * 20
    assert chunks[20]["choices"][0]["finish_reason"] == "length"
    assert chunks[21]["choices"] == []
    assert chunks[21]["usage"]["completion_tokens"] == 20
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:21])
    _, plain = await post(client, fast.url + CHAT, chat_body("stream me", max_tokens=20))
    assert text == plain["choices"][0]["message"]["content"]


async def test_closing_a_stream_releases_its_slot(start_sim, client):
    worker = await start_sim(decode_ms_per_token=20.0)
    async with client.post(worker.url + CHAT, json=chat_body(max_tokens=200, stream=True)) as response:
        await next_event(response)
        response.close()
    await poll_stats(client, worker, lambda s: s["running"] == 0)


async def test_completions_json_and_stream(start_sim, client):
    worker = await start_sim()
    status, body = await post(
        client, worker.url + "/v1/completions", {"prompt": ["a b", "c"], "max_tokens": 3}
    )
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["model"] == "sim-model"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    request = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True}
    async with client.post(worker.url + "/v1/completions", json=request) as response:
        events = await read_events(response)
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]


async def test_embeddings_are_deterministic(start_sim, client):
    worker = await start_sim(embedding_dim=8)
    url = worker.url + "/v1/embeddings"
    status, one = await post(client, url, {"model": "emb", "input": "hello there"})
    assert status == 200
    assert one["object"] == "list"
    assert one["model"] == "emb"
    assert one["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    item = one["data"][0]
    assert (item["object"], item["index"], len(item["embedding"])) == ("embedding", 0, 8)
    _, many = await post(client, url, {"model": "emb", "input": ["hello there", "other"]})
    assert many["data"][0]["embedding"] == item["embedding"]
    assert many["data"][1]["embedding"] != item["embedding"]
    assert [d["index"] for d in many["data"]] == [0, 1]
    _, wide = await post(client, url, {"input": "x", "dimensions": 32})
    assert len(wide["data"][0]["embedding"]) == 32
    _, packed = await post(client, url, {"input": "hello there", "encoding_format": "base64"})
    floats = struct.unpack("<8f", base64.b64decode(packed["data"][0]["embedding"]))
    assert floats == pytest.approx(item["embedding"], abs=1e-6)


async def test_models_and_health(start_sim, client):
    worker = await start_sim(models=("a", "b"))
    assert await get(client, worker.url + "/health") == (200, {"status": "ok"})
    status, listing = await get(client, worker.url + "/v1/models")
    assert status == 200
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["a", "b"]
    assert {m["object"] for m in listing["data"]} == {"model"}


async def test_official_openai_client(start_sim):
    worker = await start_sim()
    oai = AsyncOpenAI(base_url=worker.url + "/v1", api_key="sim", max_retries=0)
    try:
        chat = await oai.chat.completions.create(
            model="gpt-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "gpt-sim"
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        content = chat.choices[0].message.content
        stream = await oai.chat.completions.create(
            model="gpt-sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(pieces) == content
        assert usage is not None and usage.total_tokens == 2 + 4
        completion = await oai.completions.create(model="gpt-sim", prompt="say this", max_tokens=3)
        assert len(completion.choices[0].text.split()) == 3
        embeddings = await oai.embeddings.create(model="emb", input=["a", "b"])
        assert [len(d.embedding) for d in embeddings.data] == [16, 16]
        models = await oai.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
    finally:
        await oai.close()


# Open Inference Protocol v2 and KServe v1 --------------------------------------------------------


async def test_oip_health_and_metadata(start_sim, client):
    worker = await start_sim()
    assert (await get(client, worker.url + "/v2/health/live"))[0] == 200
    assert (await get(client, worker.url + "/v2/health/ready"))[0] == 200
    status, server = await get(client, worker.url + "/v2")
    assert status == 200 and server["name"] == "modelyard-sim"
    status, meta = await get(client, worker.url + "/v2/models/iris")
    assert status == 200
    assert (meta["name"], meta["platform"]) == ("iris", "modelyard-sim")
    assert meta["inputs"] and meta["outputs"]
    _, versioned = await get(client, worker.url + "/v2/models/iris/versions/7")
    assert versioned["versions"] == ["7"]
    assert (await get(client, worker.url + "/v2/models/iris/ready"))[0] == 200
    assert (await get(client, worker.url + "/v2/models/iris/versions/7/ready"))[0] == 200


async def test_oip_infer_scales_numbers_and_echoes_bytes(start_sim, client):
    worker = await start_sim(oip_scale=2.0)
    request = {
        "id": "req-1",
        "inputs": [
            {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.5]},
            {"name": "n", "shape": [2], "datatype": "INT64", "data": [1, 2]},
            {"name": "s", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
        ],
    }
    status, body = await post(client, worker.url + "/v2/models/m/versions/3/infer", request)
    assert status == 200
    assert (body["model_name"], body["model_version"], body["id"]) == ("m", "3", "req-1")
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["x"] == {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [2.0, 4.0, 6.0, 9.0]}
    assert outputs["n"]["data"] == [2, 4]
    assert outputs["s"]["data"] == ["hi"]
    request["outputs"] = [{"name": "n"}]
    _, filtered = await post(client, worker.url + "/v2/models/m/infer", request)
    assert [o["name"] for o in filtered["outputs"]] == ["n"]
    assert "model_version" not in filtered


async def test_kserve_v1_predict(start_sim, client):
    worker = await start_sim(oip_scale=3.0)
    status, model = await get(client, worker.url + "/v1/models/iris")
    assert status == 200
    assert (model["name"], model["ready"], model["id"]) == ("iris", True, "iris")
    status, body = await post(client, worker.url + "/v1/models/iris:predict", {"instances": [[1, 2.5], "s"]})
    assert (status, body) == (200, {"predictions": [[3, 7.5], "s"]})
    _, body = await post(client, worker.url + "/v1/models/iris:predict", {"inputs": [1]})
    assert body == {"predictions": [3]}


# Errors ------------------------------------------------------------------------------------------


async def post_raw(client: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any]:
    async with client.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json(content_type=None)


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/embeddings"])
async def test_malformed_json_is_an_openai_400(start_sim, client, path):
    worker = await start_sim()
    status, body = await post_raw(client, worker.url + path, b"{not json")
    assert status == 400
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "messages": "hi"},
        {"model": "m", "messages": ["hi"]},
        {"model": "m", "messages": [], "max_tokens": -1},
        {"model": "m", "messages": [], "max_tokens": "5"},
        [1, 2],
    ],
)
async def test_bad_chat_requests_are_400(start_sim, client, body):
    worker = await start_sim()
    status, reply = await post(client, worker.url + CHAT, body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/v2/models/m/infer", b"nope"),
        ("/v2/models/m/infer", b'{"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": [1]}]}'),
        ("/v2/models/m/infer", b'{"inputs": []}'),
        ("/v1/models/m:predict", b"nope"),
        ("/v1/models/m:predict", b'{"rows": [1]}'),
    ],
)
async def test_bad_oip_and_kserve_requests_are_400(start_sim, client, path, data):
    worker = await start_sim()
    status, body = await post_raw(client, worker.url + path, data)
    assert status == 400
    assert isinstance(body["error"], str) and body["error"]


async def test_fail_rate_one_answers_500_in_each_protocol(start_sim, client):
    worker = await start_sim(fail_rate=1.0)
    status, body = await post(client, worker.url + CHAT, chat_body())
    assert status == 500
    assert body["error"]["type"] == "server_error"
    tensor = {"name": "a", "shape": [1], "datatype": "FP32", "data": [1.0]}
    status, body = await post(client, worker.url + "/v2/models/m/infer", {"inputs": [tensor]})
    assert status == 500 and isinstance(body["error"], str)
    status, body = await post(client, worker.url + "/v1/models/m:predict", {"instances": [1]})
    assert status == 500 and isinstance(body["error"], str)
    assert (await sim_stats(client, worker))["failures_total"] == 3


# Metrics, latency model, runtime config ----------------------------------------------------------


async def test_metrics_use_vllm_names(start_sim, client):
    worker = await start_sim(models=("llama",))
    await post(client, worker.url + CHAT, chat_body())
    samples = await metrics(client, worker)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert f'{name}{{model_name="llama"}}' in samples
    assert samples['modelyard_sim_requests_total{endpoint="chat_completions"}'] == 1


async def test_repeated_prompt_hits_the_prefix_cache(start_sim, client):
    worker = await start_sim(block_tokens=4)
    prompt = " ".join(f"w{i}" for i in range(20))  # 21 tokens with the role: 5 full blocks
    hits = 'vllm:prefix_cache_hits_total{model_name="sim-model"}'
    queries = 'vllm:prefix_cache_queries_total{model_name="sim-model"}'
    _, first = await post(client, worker.url + CHAT, chat_body(prompt))
    after_first = await metrics(client, worker)
    _, second = await post(client, worker.url + CHAT, chat_body(prompt))
    after_second = await metrics(client, worker)
    assert after_first[hits] == 0
    assert after_second[hits] == 20
    assert after_second[queries] == 42
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 20


async def test_workers_in_one_process_keep_separate_metrics(start_sim, client):
    busy, idle = await start_sim(), await start_sim()
    await post(client, busy.url + CHAT, chat_body())
    assert 'modelyard_sim_requests_total{endpoint="chat_completions"}' in await metrics(client, busy)
    assert 'modelyard_sim_requests_total{endpoint="chat_completions"}' not in await metrics(client, idle)
    assert (busy.stats.requests_total, idle.stats.requests_total) == (1, 0)


async def test_requests_beyond_max_concurrency_wait(start_sim, client):
    worker = await start_sim(max_concurrency=2, decode_ms_per_token=10.0)
    body = chat_body(max_tokens=50)
    requests = [asyncio.create_task(post(client, worker.url + CHAT, body)) for _ in range(3)]
    try:
        queued = await poll_stats(client, worker, lambda s: s["waiting"] >= 1)
        assert (queued["running"], queued["waiting"]) == (2, 1)
        samples = await metrics(client, worker)
        assert samples['vllm:num_requests_waiting{model_name="sim-model"}'] > 0
        assert samples['vllm:num_requests_running{model_name="sim-model"}'] == 2
        assert samples['vllm:gpu_cache_usage_perc{model_name="sim-model"}'] > 0
        results = await asyncio.wait_for(asyncio.gather(*requests), timeout=POLL_SECONDS)
    finally:
        for task in requests:
            task.cancel()
    assert [status for status, _ in results] == [200, 200, 200]
    final = await sim_stats(client, worker)
    assert (final["running"], final["waiting"], final["requests_total"]) == (0, 0, 3)


async def test_put_sim_config_changes_the_running_worker(start_sim, client):
    worker = await start_sim(max_concurrency=1, decode_ms_per_token=10.0)
    async with client.put(f"{worker.url}/sim/config", json={"slowdown": 5, "fail_rate": 0.25}) as response:
        assert response.status == 200
        config = await response.json()
    assert (config["slowdown"], config["fail_rate"]) == (5, 0.25)
    assert (await sim_stats(client, worker))["config"]["slowdown"] == 5
    assert worker.live_config.slowdown == 5
    for bad in ({"port": 1}, {"slowdown": -1}, [1]):
        async with client.put(f"{worker.url}/sim/config", json=bad) as response:
            assert response.status == 400
            assert isinstance((await response.json())["error"], str)
    async with client.put(f"{worker.url}/sim/config", json={"slowdown": 1, "fail_rate": 0}) as response:
        assert response.status == 200

    # Raising max_concurrency admits a queued request at once.
    requests = [
        asyncio.create_task(post(client, worker.url + CHAT, chat_body(max_tokens=50))) for _ in range(2)
    ]
    try:
        await poll_stats(client, worker, lambda s: s["waiting"] == 1)
        async with client.put(f"{worker.url}/sim/config", json={"max_concurrency": 2}) as response:
            assert response.status == 200
        both = await sim_stats(client, worker)
        assert (both["running"], both["waiting"]) == (2, 0)
        await asyncio.wait_for(asyncio.gather(*requests), timeout=POLL_SECONDS)
    finally:
        for task in requests:
            task.cancel()


async def test_worker_start_and_stop(client):
    worker = SimWorker(SimWorkerConfig(port=0, **FAST))
    url = await worker.start()
    assert url == worker.url == f"http://127.0.0.1:{worker.port}"
    assert worker.port and worker.port > 0
    assert (await get(client, url + "/health"))[0] == 200
    await worker.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await get(client, url + "/health")
    await worker.stop()  # idempotent
