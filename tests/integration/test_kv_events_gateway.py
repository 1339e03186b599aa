"""prefix_aware's precise mode in a running gateway: it subscribes to each endpoint's KV-cache
events (here a publisher that sends exactly what vLLM's does: PUB frames [topic, seq, msgpack
batch], a ROUTER replay socket), routes on the blocks each says it holds, and falls back to the
approximate index, saying so in /admin/overview and /metrics, when the events are lost, garbled or
stop. The sim-workers answer the requests (their own caches play no part here)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kv_tokenizer import WORDS, make_tokenizer
from modelyard.balancing.kv_events import (
    END_OF_REPLAY,
    REBUILT_AFTER,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from modelyard.balancing.tokens import PromptTokens
from modelyard.errors import ConfigError
from modelyard.gateway.gateway import GATEWAY
from support import metric_value, model_config, wait_until

CHAT = "/v1/chat/completions"
BLOCK = 16


def chat(seed: int, words: int = 200) -> dict[str, Any]:
    text = " ".join(WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(words))
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": f"{seed} {text}"}]}


class FakeVllm:
    """What vLLM's ZmqEventPublisher does, driven by the test: batches numbered from 0 on a PUB
    socket, the last ones kept for a ROUTER replay socket."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = context.socket(zmq.ROUTER)
        self.replay.bind("tcp://127.0.0.1:*")
        self.events_url = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_url = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self._serving = asyncio.create_task(self._serve_replay())

    async def publish(self, *events: object, send: bool = True, payload: bytes | None = None) -> int:
        seq = self.seq
        self.seq += 1
        data = payload if payload is not None else encode_batch(KVEventBatch(ts=0.0, events=list(events)))
        self.buffer.append((seq, data))
        if send:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), data])
        return seq

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, data in self.buffer:
                if seq >= first:
                    await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), data])
            await self.replay.send_multipart([client, b"", END_OF_REPLAY, b""])

    async def close(self) -> None:
        self._serving.cancel()
        await asyncio.gather(self._serving, return_exceptions=True)
        self.pub.close(0)
        self.replay.close(0)


@pytest.fixture
async def vllms():
    context = zmq.asyncio.Context()
    made: list[FakeVllm] = []

    def make(n: int) -> list[FakeVllm]:
        made.extend(FakeVllm(context) for _ in range(n))
        return made[-n:]

    yield make
    for vllm in made:
        await vllm.close()
    context.term()


def stored_for(tokens: PromptTokens, body: dict[str, Any], blocks: int, first_hash: int) -> BlockStored:
    ids = tokens.ids(body)
    assert ids is not None and len(ids) >= blocks * BLOCK
    return BlockStored(list(range(first_hash, first_hash + blocks)), None, ids[: blocks * BLOCK], BLOCK)


async def overview_kv(http, gateway) -> dict[str, Any]:
    async with http.get(gateway.url + "/admin/overview") as r:
        model = (await r.json())["models"][0]
    return {e["name"]: e["kv_events"] for e in model["endpoints"]}


async def until_live(http, gateway, vllm: FakeVllm, name: str) -> None:
    """ZMQ's slow joiner: batches sent before the subscription is made are lost, so empty ones
    are sent until one arrives (the first, numbered 0, makes the index live)."""

    async def live() -> bool:
        state = (await overview_kv(http, gateway))[name]
        if state["state"] == "live":
            return True
        if state["last_seq"] < 0:
            vllm.seq, vllm.buffer = 0, []  # nothing was seen yet: start the numbering again
            await vllm.publish()
        return False

    await wait_until(live, interval=0.02)


@pytest.fixture
def one_live(sim_workers, gateways, http, vllms, tmp_path):
    """`await one_live(**prefix_aware)`: a gateway in precise mode over one sim-worker (w0) whose
    events a FakeVllm publishes, its index live; (gateway, that publisher, the PromptTokens)."""

    async def make(**prefix: Any) -> tuple[Any, FakeVllm, PromptTokens]:
        folder = make_tokenizer(tmp_path)
        workers = await sim_workers(1)
        (vllm,) = vllms(1)
        gateway = await gateways([precise_model(workers, [vllm], folder, **prefix)])
        await until_live(http, gateway, vllm, "w0")
        return gateway, vllm, PromptTokens.load(folder)

    return make


def precise_model(workers, vllms_: list[FakeVllm], folder: Path, **prefix: Any) -> dict[str, Any]:
    config = model_config("m", workers, strategy="prefix_aware")
    for endpoint, vllm in zip(config["endpoints"], vllms_, strict=False):
        endpoint["kv_events"] = vllm.events_url
        endpoint["kv_replay"] = vllm.replay_url
    config["prefix_aware"] = {"tokenizer": str(folder), **prefix}
    return config


async def test_requests_go_where_the_events_say_their_prompt_is_cached(
    sim_workers, gateways, http, vllms, tmp_path
):
    folder = make_tokenizer(tmp_path)
    tokens = PromptTokens.load(folder)
    workers = await sim_workers(2)
    a, b = vllms(2)
    gateway = await gateways([precise_model(workers, [a, b], folder)])
    await until_live(http, gateway, a, "w0")
    await until_live(http, gateway, b, "w1")
    for seed in range(6):
        body = chat(seed)
        holder, name = (a, "w0") if seed % 2 else (b, "w1")
        await holder.publish(stored_for(tokens, body, 8, 1000 * seed))

        async def told(name: str = name, want: int = 8 * (seed // 2 + 1)) -> bool:
            return (await overview_kv(http, gateway))[name]["blocks"] == want

        await wait_until(told)
        async with http.post(gateway.url + CHAT, json=body) as r:
            assert r.status == 200
            await r.read()
            assert r.headers["X-Modelyard-Backend"] == name, seed
    assert await metric_value(http, gateway.url, "modelyard_kv_events_precise", model="m", backend="w0") == 1
    assert (
        await metric_value(
            http,
            gateway.url,
            "modelyard_kv_events_total",
            model="m",
            backend="w1",
            kind="stored",
        )
        == 3
    )


async def test_a_gap_is_filled_from_the_replay_endpoint(one_live, http):
    gateway, a, tokens = await one_live()
    await a.publish(stored_for(tokens, chat(1), 4, 10), send=False)  # lost on the way
    await a.publish(stored_for(tokens, chat(2), 4, 20))

    async def both() -> bool:
        return (await overview_kv(http, gateway))["w0"]["blocks"] == 8

    await wait_until(both)
    state = (await overview_kv(http, gateway))["w0"]
    assert state["state"] == "live" and state["precise"] and "gaps" not in state["counts"]


async def test_a_gap_nothing_can_fill_falls_back_and_rebuilds(one_live, http, caplog):
    gateway, a, tokens = await one_live()
    a.seq += 3  # three batches neither sent nor kept for replay
    await a.publish(stored_for(tokens, chat(1), 4, 10))

    async def rebuilding() -> bool:
        state = (await overview_kv(http, gateway))["w0"]
        return state["state"] == "rebuilding" and state["counts"].get("gaps") == 1

    await wait_until(rebuilding)
    assert await metric_value(http, gateway.url, "modelyard_kv_events_precise", model="m", backend="w0") == 0
    async with http.post(gateway.url + CHAT, json=chat(1)) as r:  # routed approximately meanwhile
        assert r.status == 200
    assert sum("were lost" in record.message for record in caplog.records) == 1
    # 32 stores built on blocks the index knows make it trusted again
    for i in range(32):
        await a.publish(BlockStored([100 + i], None, [1] * BLOCK, BLOCK))

    async def live() -> bool:
        return (await overview_kv(http, gateway))["w0"]["state"] == "live"

    await wait_until(live)


async def test_garbage_and_malformed_messages_are_counted_and_never_stop_the_gateway(one_live, http):
    gateway, a, _ = await one_live()
    await a.publish(payload=b"\xc1\xc1 not msgpack")
    await a.pub.send_multipart([b"only one frame"])
    await a.pub.send_multipart([b"", b"short", b"x"])

    async def counted() -> bool:
        counts = (await overview_kv(http, gateway))["w0"]["counts"]
        return counts.get("garbage") == 1 and counts.get("gaps", 0) >= 2

    await wait_until(counted)
    async with http.post(gateway.url + CHAT, json=chat(3)) as r:
        assert r.status == 200
    assert (await overview_kv(http, gateway))["w0"]["state"] == "rebuilding"


async def test_events_that_stop_while_answers_go_on_fall_back_until_they_resume(one_live, http):
    gateway, a, _ = await one_live(kv_stale_after="200ms")
    await a.publish(BlockStored([1], None, [1] * BLOCK, BLOCK))  # (a block size: the index is usable)

    async def stored() -> bool:  # (before the answers: a batch resets their count)
        return (await overview_kv(http, gateway))["w0"]["blocks"] == 1

    await wait_until(stored)
    for seed in range(8):
        async with http.post(gateway.url + CHAT, json=chat(seed)) as r:
            assert r.status == 200

    async def quiet() -> bool:
        state = (await overview_kv(http, gateway))["w0"]
        return state["state"] == "quiet" and not state["precise"]

    await wait_until(quiet)
    await a.publish()

    async def resumed() -> bool:
        return (await overview_kv(http, gateway))["w0"]["precise"]

    await wait_until(resumed)


async def test_an_unreachable_events_endpoint_leaves_routing_approximate(
    sim_workers, gateways, http, tmp_path
):
    folder = make_tokenizer(tmp_path)
    workers = await sim_workers(2)
    config = model_config("m", workers, strategy="prefix_aware")
    config["endpoints"][0]["kv_events"] = "tcp://127.0.0.1:9"  # nothing listens there
    config["prefix_aware"] = {"tokenizer": str(folder)}
    gateway = await gateways([config])
    for seed in range(4):
        async with http.post(gateway.url + CHAT, json=chat(seed)) as r:
            assert r.status == 200
    state = await overview_kv(http, gateway)
    assert state["w0"]["state"] == "waiting" and not state["w0"]["precise"] and state["w1"] is None
    assert gateway.app[GATEWAY].clusters["m"].balancer.kv is not None


async def test_a_tokenizer_that_cannot_be_loaded_is_an_error_naming_the_model_and_file(gateways, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    config = {
        "name": "m",
        "strategy": "prefix_aware",
        "endpoints": [{"url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:9"}],
        "prefix_aware": {"tokenizer": str(bad)},
    }
    with pytest.raises(ConfigError) as caught:
        await gateways([config])
    message = str(caught.value)
    assert "model 'm'" in message and "prefix_aware.tokenizer" in message and str(bad) in message


async def test_the_whole_loop_on_sim_workers_that_publish_their_cache(sim_workers, gateways, http, tmp_path):
    """Sim-workers publish their own caches' events: a prompt one of them was sent directly,
    behind the gateway's back, is routed there next, which no guess from what the gateway sent
    could know."""
    folder = make_tokenizer(tmp_path)
    workers = await sim_workers(2, tokenizer=folder, kv_events_port=0, kv_replay_port=0, block_tokens=BLOCK)
    config = model_config("m", workers, strategy="prefix_aware")
    for endpoint, worker in zip(config["endpoints"], workers, strict=True):
        endpoint["kv_events"], endpoint["kv_replay"] = worker.kv_events_url, worker.kv_replay_url
    config["prefix_aware"] = {"tokenizer": str(folder)}
    gateway = await gateways([config])

    async def live() -> bool:
        states = await overview_kv(http, gateway)
        if all(s["state"] == "live" for s in states.values()):
            return True
        for worker in workers:  # (a batch, until the subscription is there to see one)
            async with http.post(worker.url + "/sim/kv-events", json={"clear": True}) as r:
                assert r.status == 200
        return False

    await wait_until(live, interval=0.02)
    for seed, (worker, name) in enumerate([(workers[1], "w1"), (workers[0], "w0"), (workers[1], "w1")]):
        body = chat(100 + seed)
        before = (await overview_kv(http, gateway))[name]["blocks"]
        async with http.post(worker.url + CHAT, json=body) as r:  # straight to the server
            assert r.status == 200

        async def told(name: str = name, before: int = before) -> bool:
            return (await overview_kv(http, gateway))[name]["blocks"] > before

        await wait_until(told)
        async with http.post(gateway.url + CHAT, json=body) as r:
            assert r.status == 200
            assert r.headers["X-Modelyard-Backend"] == name, seed
            assert r.headers["X-Modelyard-Cache-Hit"] == "true"
    states = await overview_kv(http, gateway)
    assert all(
        s["precise"] and not {"gaps", "garbage", "unknown_parent"} & set(s["counts"]) for s in states.values()
    )


async def test_a_gateway_that_joins_after_the_replay_rolled_learns_the_hot_prefix_from_its_own_traffic(
    sim_workers, gateways, http, tmp_path
):
    """A server holds a long conversation's history, stored before the gateway started and long
    gone from its replay buffer (2 batches here): the blocks it stores for the next turns chain on
    a parent the gateway never saw. The gateway learns that parent from the prompts it sends there
    (blocks stored right after one it sent continue it), and the endpoint is trusted again after
    REBUILT_AFTER such stores, instead of staying approximate for as long as the history is cached."""
    folder = make_tokenizer(tmp_path)
    (worker,) = await sim_workers(
        1, tokenizer=folder, kv_events_port=0, kv_replay_port=0, block_tokens=BLOCK, kv_buffer_steps=2
    )
    history = chat(1, words=300)
    async with http.post(worker.url + CHAT, json=history) as r:  # before the gateway: stored, unseen
        assert r.status == 200
    for seed in range(2, 6):  # the replay buffer rolls past it
        async with http.post(worker.url + CHAT, json=chat(seed, words=40)) as r:
            assert r.status == 200
    config = model_config("m", [worker], strategy="prefix_aware")
    config["endpoints"][0]["kv_events"] = worker.kv_events_url
    config["endpoints"][0]["kv_replay"] = worker.kv_replay_url
    config["prefix_aware"] = {"tokenizer": str(folder)}
    gateway = await gateways([config])

    def turn(n: int) -> dict[str, Any]:  # the history, then a new message of 20 words
        said = " ".join(WORDS[(n * 11 + i * 5) % len(WORDS)] for i in range(20))
        return {**history, "messages": [*history["messages"], {"role": "user", "content": f"{n} {said}"}]}

    fresh = iter(range(1000, 2000))

    async def joined() -> bool:  # (new prompts, new batches, until the subscription sees one: a gap)
        async with http.post(worker.url + CHAT, json=chat(next(fresh), words=40)) as r:
            assert r.status == 200
        return (await overview_kv(http, gateway))["w0"]["state"] == "rebuilding"

    await wait_until(joined, interval=0.05)
    for n in range(REBUILT_AFTER + 8):
        async with http.post(gateway.url + CHAT, json=turn(n)) as r:
            assert r.status == 200

    async def trusted() -> bool:
        state = (await overview_kv(http, gateway))["w0"]
        return state["state"] == "live" and state["precise"]

    await wait_until(trusted)
    counts = (await overview_kv(http, gateway))["w0"]["counts"]
    assert counts["learnt_parents"] >= 1 and counts["gaps"] == 1


async def test_a_hostile_chat_body_is_routed_approximately_not_failed(one_live, http):
    gateway, a, _ = await one_live()
    await a.publish(BlockStored([1], None, [1] * BLOCK, BLOCK))
    nested = "[" * 1000 + '"x"' + "]" * 1000  # deeper than the template's renderer recurses
    body = '{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ' + nested + "}]}"
    headers = {"Content-Type": "application/json"}
    async with http.post(gateway.url + CHAT, data=body, headers=headers) as r:
        assert r.status in (200, 400), await r.text()  # (the server's to refuse, not the gateway's to fail)
        assert r.headers.get("X-Modelyard-Backend") == "w0"


def test_vllms_bind_address_is_refused_with_what_to_write_instead():
    from modelyard.config import validate_config

    data = {"models": [{"name": "m", "endpoints": [{"url": "http://h:8000", "kv_events": "tcp://*:5557"}]}]}
    with pytest.raises(ConfigError) as caught:
        validate_config(data, "gateway.yaml")
    assert "models[0].endpoints[0].kv_events" in str(caught.value) and "tcp://*:port" in str(caught.value)
