"""Events encoded exactly as vLLM's publisher encodes them decode into the index.

The structs below are declared as vLLM declares them (vllm/distributed/kv_events.py: msgspec
Structs, array_like, omit_defaults, tagged by class name; the batch `[ts, events,
data_parallel_rank]`), independently of modelyard's, and encoded with msgspec's msgpack encoder,
as vLLM's ZmqEventPublisher does. The bytes of one batch are also checked against msgpack written
out by hand, so a change of either side's layout shows here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from modelyard.balancing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvIndex,
    block_keys,
    decode_batch,
)


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def vllm_encode(batch: VllmKVEventBatch) -> bytes:
    return msgspec.msgpack.Encoder().encode(batch)


def test_a_batch_as_vllm_encodes_it() -> None:
    tokens = list(range(32))
    payload = vllm_encode(
        VllmKVEventBatch(
            ts=1733400000.5,
            events=[
                VllmBlockStored([0x1234, 0xFFFFFFFFFFFFFFFF], None, tokens, 16, None, "GPU"),
                VllmBlockRemoved([0x1234], "GPU"),
                VllmAllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
    )
    decoded = decode_batch(payload)
    assert decoded.ts == 1733400000.5 and decoded.data_parallel_rank == 0
    first, second, third = decoded.events
    assert isinstance(first, BlockStored) and first.block_hashes == [0x1234, 0xFFFFFFFFFFFFFFFF]
    assert first.token_ids == tokens and first.block_size == 16 and first.medium == "GPU"
    assert isinstance(second, BlockRemoved) and second.block_hashes == [0x1234]
    assert isinstance(third, AllBlocksCleared)


def test_the_bytes_are_the_msgpack_vllm_sends() -> None:
    payload = vllm_encode(VllmKVEventBatch(ts=1.0, events=[VllmBlockRemoved([7], None)]))
    by_hand = (
        b"\x93"  # [ts, events, data_parallel_rank] (array-like: a default is not left out)
        + b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"  # 1.0, a float64
        + b"\x91"  # one event
        + b"\x93\xacBlockRemoved\x91\x07\xc0"  # [tag, [7], None]
        + b"\xc0"  # no data_parallel_rank
    )
    assert payload == by_hand
    assert decode_batch(by_hand).events == [BlockRemoved(block_hashes=[7], medium=None)]


def test_a_vllm_stream_builds_the_index_a_prompt_is_matched_against() -> None:
    prompt = list(range(1000, 1048))  # three blocks of 16
    kv = KvIndex()
    first = VllmKVEventBatch(ts=1.0, events=[VllmBlockStored([11, 12], None, prompt[:32], 16, None, None)])
    second = VllmKVEventBatch(ts=2.0, events=[VllmBlockStored([13], 12, prompt[32:], 16, None, None)])
    kv.apply("vllm-0", 0, vllm_encode(first), now=0.0)
    kv.apply("vllm-0", 1, vllm_encode(second), now=0.0)
    blocks = kv.usable("vllm-0", 0.0)
    assert blocks is not None and blocks.match(block_keys(prompt, 16)) == 3
    evicted = VllmKVEventBatch(ts=3.0, events=[VllmBlockRemoved([12, 13], None)])
    kv.apply("vllm-0", 2, vllm_encode(evicted), now=0.0)
    assert blocks.match(block_keys(prompt, 16)) == 1
