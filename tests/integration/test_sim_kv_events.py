"""The sim-worker's KV-cache events over real sockets: what vLLM publishes, the replay, the chaos.

A SUB socket misses what is published before its subscription reaches the publisher (ZMQ's slow
joiner), so `Subscriber.join` asks the sim to clear its cache (an `AllBlocksCleared` batch) until
one arrives; everything published after that arrives, in order.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from typer.testing import CliRunner

from kv_tokenizer import WORDS, ids, make_tokenizer, vocabulary, words
from modelyard.balancing.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from modelyard.balancing.tokens import PromptTokens, TokenizerError
from modelyard.cli.main import app as cli_app
from modelyard.simworker import SimWorker, SimWorkerConfig
from modelyard.simworker.latency import block_hashes

FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0}
DEADLINE = 5.0  # seconds any one wait may take before the test fails
BLOCK = 4

StartSim = Callable[..., Awaitable[SimWorker]]


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    return make_tokenizer(tmp_path / "tokenizer")


@pytest.fixture
def start_sim(tokenizer: Path, sim_workers: Any) -> StartSim:
    """`await start_sim(**config)`: a worker publishing events on free ports, blocks of BLOCK
    (conftest's `sim_workers`, which stops it)."""

    async def start(**overrides: Any) -> SimWorker:
        settings = {"tokenizer": tokenizer, "kv_events_port": 0, "kv_replay_port": 0, "block_tokens": BLOCK}
        (worker,) = await sim_workers(1, **{**settings, **overrides})
        return worker

    return start


class Sockets:
    """The test's own ZMQ sockets, closed at its end (one dropped unclosed warns)."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.opened: list[zmq.asyncio.Socket] = []

    def open(self, kind: int) -> zmq.asyncio.Socket:
        opened = self.context.socket(kind)
        opened.setsockopt(zmq.LINGER, 0)
        self.opened.append(opened)
        return opened

    def close(self) -> None:
        for opened in self.opened:
            opened.close()
        self.context.term()


@pytest.fixture
async def sockets() -> AsyncIterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE)) as session:
        yield session


async def post(client: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with client.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def control(client: aiohttp.ClientSession, worker: SimWorker, body: object) -> dict[str, Any]:
    status, state = await post(client, f"{worker.url}/sim/kv-events", body)
    assert status == 200, state
    return state


async def complete(client: aiohttp.ClientSession, worker: SimWorker, prompt: object) -> dict[str, Any]:
    status, body = await post(client, f"{worker.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return body


async def stats(client: aiohttp.ClientSession, worker: SimWorker) -> dict[str, Any]:
    async with client.get(f"{worker.url}/sim/stats") as response:
        return await response.json()


class Subscriber:
    """A SUB socket on a worker's events."""

    def __init__(self, sockets: Sockets, url: str) -> None:
        self.socket = sockets.open(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(url)
        self.last_seq = -1

    async def join(self, client: aiohttp.ClientSession, worker: SimWorker) -> None:
        """Clear the sim's cache until the subscription sees it; then drain the clears sent."""
        deadline = asyncio.get_running_loop().time() + DEADLINE
        while True:
            last = (await control(client, worker, {"clear": True}))["next_seq"] - 1
            if await self.socket.poll(20):
                break
            assert asyncio.get_running_loop().time() < deadline, "the subscription never joined"
        while self.last_seq < last:
            await self.next()

    async def frames(self) -> list[bytes]:
        return await asyncio.wait_for(self.socket.recv_multipart(), DEADLINE)

    async def next(self) -> tuple[int, KVEventBatch]:
        """The next batch: its sequence number and its events."""
        _topic, seq, payload = await self.frames()
        self.last_seq = int.from_bytes(seq, "big")
        return self.last_seq, decode_batch(payload)

    async def nothing_pending(self) -> bool:
        return not await self.socket.poll(0)


async def subscribe(sockets: Sockets, client: aiohttp.ClientSession, worker: SimWorker) -> Subscriber:
    assert worker.kv_events_url is not None
    subscriber = Subscriber(sockets, worker.kv_events_url)
    await subscriber.join(client, worker)
    return subscriber


async def replay(sockets: Sockets, worker: SimWorker, start: int) -> list[tuple[int, bytes]]:
    """What the replay socket sends back for `start` (a DEALER, as the gateway's), up to its end."""
    assert worker.kv_replay_url is not None
    dealer = sockets.open(zmq.DEALER)
    dealer.connect(worker.kv_replay_url)
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[tuple[int, bytes]] = []
    while True:
        empty, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), DEADLINE)
        assert empty == b""
        if seq == END_OF_REPLAY:
            assert payload == b""
            return got
        got.append((int.from_bytes(seq, "big"), payload))


def test_the_test_tokenizer_is_what_it_says(tokenizer: Path) -> None:
    tokens = PromptTokens.load(tokenizer)
    assert tokens.ids({"prompt": words(3, 5)}) == [4, 5, 6, 7, 8] == ids(words(3, 5))
    chat = {"messages": [{"role": "user", "content": words(0, 3)}]}
    assert tokens.ids(chat) == [vocabulary()["<|user|>"], 1, 2, 3, vocabulary()["<|assistant|>"]]


async def test_completions_store_their_new_blocks_with_their_token_ids(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    first = words(0, 10)  # two full blocks and a part
    answer = await complete(client, worker, first)
    assert answer["usage"]["prompt_tokens"] == 10  # the tokenizer's tokens
    seq, batch = await events.next()
    [stored] = batch.events
    first_blocks = block_hashes(ids(first), BLOCK)
    assert stored == BlockStored(
        block_hashes=first_blocks, parent_block_hash=None, token_ids=ids(first)[:8], block_size=BLOCK
    )
    # A prompt sharing those two blocks stores only what follows them, built on the second.
    second = f"{words(0, 8)} {words(100, 6)}"
    answer = await complete(client, worker, second)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    next_seq, batch = await events.next()
    assert next_seq == seq + 1
    [stored] = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == first_blocks[1]
    assert stored.block_hashes == block_hashes(ids(second), BLOCK)[2:]
    assert stored.token_ids == ids(words(100, 4))
    # Token ids as the prompt, and several prompts: one batch, a BlockStored per prompt.
    await complete(client, worker, [[7, 7, 7, 7, 7], ids(words(200, 4))])
    _, batch = await events.next()
    assert [e.token_ids for e in batch.events] == [[7, 7, 7, 7], ids(words(200, 4))]
    # Nothing new, nothing said; a partial block is nothing new either.
    await complete(client, worker, words(0, 11))
    await complete(client, worker, words(300, 3))
    assert (await stats(client, worker))["kv_batches_published"] == events.last_seq + 1
    assert await events.nothing_pending()


async def test_a_chat_stores_the_blocks_of_its_rendered_template(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    body = {
        "messages": [{"role": "system", "content": words(0, 3)}, {"role": "user", "content": words(9, 6)}]
    }
    status, answer = await post(client, f"{worker.url}/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200, answer
    rendered = ids(f"<|system|>{words(0, 3)}\n<|user|>{words(9, 6)}\n<|assistant|>")  # 12 tokens
    assert answer["usage"]["prompt_tokens"] == len(rendered) == 12
    _, batch = await events.next()
    [stored] = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == rendered and stored.block_hashes == block_hashes(rendered, BLOCK)


async def test_evictions_are_published_as_block_removed(start_sim, sockets, client):
    worker = await start_sim(cache_blocks=3)
    events = await subscribe(sockets, client, worker)
    await complete(client, worker, words(0, 12))  # three blocks: the cache is full
    _, batch = await events.next()
    [old] = batch.events
    await complete(client, worker, words(50, 8))  # two more: the old prompt's tail goes
    _, batch = await events.next()
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.token_ids == ids(words(50, 8))
    assert isinstance(old, BlockStored) and removed == BlockRemoved(block_hashes=old.block_hashes[:0:-1])
    assert (await stats(client, worker))["cached_blocks"] == 3


async def test_batches_are_numbered_from_0_and_replayed_then_end_of_replay(start_sim, sockets, client):
    worker = await start_sim(kv_topic="kv@sim")
    assert worker.kv_events_url is not None
    sub = Subscriber(sockets, worker.kv_events_url)
    await sub.join(client, worker)  # batches 0..last_seq: the clears
    joined = sub.last_seq
    for i in range(3):
        await complete(client, worker, words(10 * i, 4))
    received = []
    for _ in range(3):
        topic, seq, payload = await sub.frames()
        assert topic == b"kv@sim"
        received.append((int.from_bytes(seq, "big"), payload))
    assert [seq for seq, _ in received] == [joined + 1, joined + 2, joined + 3]
    everything = await replay(sockets, worker, 0)
    assert [seq for seq, _ in everything] == list(range(joined + 4))
    assert everything[-3:] == received  # the very payloads
    assert await replay(sockets, worker, joined + 2) == received[1:]
    assert await replay(sockets, worker, joined + 4) == []
    assert all(type(e) is AllBlocksCleared for _, p in everything[:-3] for e in decode_batch(p).events)


async def test_the_replay_keeps_only_the_last_buffer_steps(start_sim, sockets, client):
    worker = await start_sim(kv_buffer_steps=2)
    for i in range(4):
        await complete(client, worker, words(10 * i, 4))
    assert [seq for seq, _ in await replay(sockets, worker, 0)] == [2, 3]


async def test_pause_publishes_nothing_and_numbers_nothing(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    joined = events.last_seq
    assert (await control(client, worker, {"pause": True}))["paused"] is True
    await complete(client, worker, words(0, 4))  # made while paused: gone
    await control(client, worker, {"pause": False})
    await complete(client, worker, words(20, 4))
    seq, batch = await events.next()
    assert seq == joined + 1
    assert batch.events[0].token_ids == ids(words(20, 4))
    assert [seq for seq, _ in await replay(sockets, worker, joined)] == [joined, joined + 1]


async def test_drop_leaves_a_gap_the_replay_fills(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    joined = events.last_seq
    published = (await stats(client, worker))["kv_batches_published"]
    await control(client, worker, {"drop": 1})
    await complete(client, worker, words(0, 4))  # numbered and kept, not sent
    await complete(client, worker, words(20, 4))
    assert (await events.next())[0] == joined + 2
    [(gap, payload), (after, _)] = await replay(sockets, worker, joined + 1)
    assert (gap, after) == (joined + 1, joined + 2)
    assert decode_batch(payload).events[0].token_ids == ids(words(0, 4))
    counters = await stats(client, worker)
    assert (counters["kv_batches_published"], counters["kv_batches_dropped"]) == (published + 1, 1)


async def test_lose_leaves_a_gap_the_replay_cannot_fill(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    joined = events.last_seq
    await control(client, worker, {"lose": 1})
    await complete(client, worker, words(0, 4))  # numbered, neither sent nor kept
    await complete(client, worker, words(20, 4))
    assert (await events.next())[0] == joined + 2
    assert [seq for seq, _ in await replay(sockets, worker, joined + 1)] == [joined + 2]
    assert (await stats(client, worker))["kv_batches_dropped"] == 1


async def test_garbage_sends_a_numbered_payload_that_is_not_msgpack(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    joined = events.last_seq
    await control(client, worker, {"garbage": 1})
    await complete(client, worker, words(0, 4))
    _, seq, payload = await events.frames()
    assert int.from_bytes(seq, "big") == joined + 1
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)
    await complete(client, worker, words(20, 4))
    assert (await events.next())[0] == joined + 2  # and then batches again


async def test_clear_empties_the_cache_and_says_all_blocks_cleared(start_sim, sockets, client):
    worker = await start_sim()
    events = await subscribe(sockets, client, worker)
    await complete(client, worker, words(0, 8))
    await events.next()
    assert (await stats(client, worker))["cached_blocks"] == 2
    await control(client, worker, {"clear": True})
    assert (await events.next())[1].events == [AllBlocksCleared()]
    assert (await stats(client, worker))["cached_blocks"] == 0
    await complete(client, worker, words(0, 8))  # stored again, from the start
    assert (await events.next())[1].events[0].parent_block_hash is None


@pytest.mark.parametrize(
    "body",
    [{}, {"pause": 1}, {"drop": -1}, {"lose": True}, {"garbage": "2"}, {"clear": "yes"}, {"flood": 1}, [1]],
)
async def test_a_bad_control_is_refused(start_sim, client, body):
    worker = await start_sim()
    status, answer = await post(client, f"{worker.url}/sim/kv-events", body)
    assert status == 400 and isinstance(answer["error"], str), answer


async def test_stats_say_where_the_events_are_and_their_counters(start_sim, client):
    worker = await start_sim()
    await complete(client, worker, words(0, 4))
    counters = await stats(client, worker)
    assert counters["kv_events"] == worker.kv_events_url and counters["kv_events"].startswith(
        "tcp://127.0.0.1:"
    )
    assert counters["kv_replay"] == worker.kv_replay_url and counters["kv_replay"] != counters["kv_events"]
    assert (counters["kv_batches_published"], counters["kv_batches_dropped"]) == (1, 0)
    off = await start_sim(tokenizer=None, kv_events_port=None, kv_replay_port=None)
    counters = await stats(client, off)
    assert (counters["kv_events"], counters["kv_replay"], counters["kv_batches_published"]) == (None, None, 0)
    status, answer = await post(client, f"{off.url}/sim/kv-events", {"clear": True})
    assert status == 409 and "off" in answer["error"]


async def test_a_tokenizer_without_events_counts_tokens(start_sim, client):
    worker = await start_sim(kv_events_port=None, kv_replay_port=None)
    assert (await complete(client, worker, f"{WORDS[0]} {WORDS[0]}, {WORDS[1]}"))["usage"][
        "prompt_tokens"
    ] == 4
    status, answer = await post(client, f"{worker.url}/v1/embeddings", {"input": [words(0, 3), words(7, 2)]})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 5
    status, answer = await post(client, f"{worker.url}/v1/completions", {"prompt": [1, len(vocabulary())]})
    assert status == 400 and "out of vocabulary" in answer["error"]["message"]


async def test_stop_unbinds_the_event_ports(start_sim, sockets):
    worker = await start_sim()
    urls = [worker.kv_events_url, worker.kv_replay_url]
    await worker.stop()
    for url in urls:
        sockets.open(zmq.PUB).bind(url)  # free again


def test_a_tokenizer_that_cannot_be_loaded_is_a_startup_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        SimWorker(SimWorkerConfig(tokenizer=bad))
    result = CliRunner().invoke(cli_app, ["sim-worker", "--port", "0", "--tokenizer", str(bad)])
    assert result.exit_code == 1 and str(bad) in result.output


def test_cli_refuses_events_without_a_tokenizer_and_names_a_port_in_use(tokenizer: Path) -> None:
    result = CliRunner().invoke(cli_app, ["sim-worker", "--kv-events-port", "0"])
    assert result.exit_code == 1
    assert "--kv-events-port needs a --tokenizer" in result.output
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = ["sim-worker", "--port", "0", "--tokenizer", str(tokenizer), "--kv-events-port", str(port)]
        result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 1
    assert (
        f"cannot listen on 127.0.0.1:{port} (sim-worker KV events): Address already in use" in result.output
    )
