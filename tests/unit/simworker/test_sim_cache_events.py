"""What the sim's prefix cache says in vLLM's KV-cache events: the pure parts and the engine."""

import pytest
from pydantic import ValidationError

from modelyard.balancing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvIndex,
    decode_batch,
    encode_batch,
)
from modelyard.simworker import SimWorkerConfig
from modelyard.simworker.cache_events import prefill_events
from modelyard.simworker.engine import KvEvent, SimEngine
from modelyard.simworker.latency import PrefixCache, block_hashes, plan_prefill

FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0}


def test_insert_reports_what_it_evicts_oldest_first():
    cache = PrefixCache(capacity=3)
    assert cache.insert([b"a", b"b"]) == []
    assert cache.insert([b"c", b"d"]) == [b"b"]  # a prompt's tail goes before its head
    assert cache.insert([b"e"]) == [b"a"]
    assert cache.insert([b"c"]) == []  # touched, not new
    assert PrefixCache(capacity=0).insert([b"a"]) == []


def test_clear_empties_the_cache():
    cache = PrefixCache(capacity=4)
    cache.insert([b"a", b"b"])
    cache.clear()
    assert len(cache) == 0 and cache.match([b"a"]) == 0


def test_token_ids_never_share_blocks_with_words():
    assert block_hashes([1, 2], 2) != block_hashes(["1", "2"], 2)
    assert block_hashes([1, 2, 3, 4], 2)[0] == block_hashes([1, 2, 9], 2)[0]  # chained as words are


def test_a_prefill_says_which_blocks_are_new_and_what_they_follow():
    cache = PrefixCache(capacity=16)
    first = plan_prefill(cache, list(range(10)), 4)  # two full blocks, a partial one
    assert first.cached_blocks == 0 and first.parent is None
    assert list(first.stored) == block_hashes(list(range(10)), 4)
    second = plan_prefill(cache, [*range(8), 50, 51, 52, 53, 54], 4)
    blocks = block_hashes([*range(8), 50, 51, 52, 53], 4)
    assert second.cached_tokens == 8
    assert list(second.stored) == blocks[2:] and second.parent == blocks[1]
    assert list(plan_prefill(cache, list(range(8)), 4).stored) == []


def test_events_of_a_prompt_sharing_a_prefix_with_an_earlier_one():
    cache = PrefixCache(capacity=16)
    first_tokens = list(range(100, 112))
    first = plan_prefill(cache, first_tokens, 4)
    [stored] = prefill_events(first, first_tokens, 4)
    assert stored == BlockStored(
        block_hashes=block_hashes(first_tokens, 4),
        parent_block_hash=None,
        token_ids=first_tokens,
        block_size=4,
    )
    tokens = [*range(100, 108), 7, 8, 9, 10, 11, 12, 13]  # shares two blocks, then one new and a part
    second = plan_prefill(cache, tokens, 4)
    [stored] = prefill_events(second, tokens, 4)
    blocks = block_hashes(tokens, 4)
    assert stored.block_hashes == blocks[2:]
    assert stored.parent_block_hash == blocks[1] == block_hashes(first_tokens, 4)[1]
    assert stored.token_ids == [7, 8, 9, 10]  # full blocks only
    # On the wire, and understood by the gateway's index: it holds both prompts' blocks.
    batch = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=[*prefill_events(first, first_tokens, 4)])))
    index = KvIndex()
    assert index.apply("w", 0, encode_batch(batch), 1.0) == "applied"
    assert index.apply("w", 1, encode_batch(KVEventBatch(ts=2.0, events=[stored])), 2.0) == "applied"
    assert len(index.endpoints["w"].held) == 4


def test_evictions_become_block_removed_after_the_stored_blocks():
    cache = PrefixCache(capacity=3)
    old = list(range(6))
    plan_prefill(cache, old, 2)
    tokens = [9, 9, 8, 8]
    prefill = plan_prefill(cache, tokens, 2)
    stored, removed = prefill_events(prefill, tokens, 2)
    assert isinstance(stored, BlockStored) and stored.token_ids == tokens
    old_blocks = block_hashes(old, 2)
    assert removed == BlockRemoved(block_hashes=[old_blocks[2], old_blocks[1]])  # the tail first


def test_words_store_nothing_but_their_evictions_are_said():
    cache = PrefixCache(capacity=2)
    ids = [1, 2, 3, 4]
    plan_prefill(cache, ids, 2)
    prefill = plan_prefill(cache, ["a", "b"], 2)
    assert prefill_events(prefill, ["a", "b"], 2) == [BlockRemoved(block_hashes=[block_hashes(ids, 2)[1]])]
    assert prefill_events(plan_prefill(cache, ["c"], 2), ["c"], 2) == []


def engine(**overrides: object) -> tuple[SimEngine, list[list[KvEvent]]]:
    sim = SimEngine(SimWorkerConfig(**{**FAST, **overrides}))
    batches: list[list[KvEvent]] = []
    sim.kv_events = batches.append
    return sim, batches


async def test_one_batch_per_admission_and_none_when_nothing_changed():
    sim, batches = engine(block_tokens=2)
    async with sim.admit([[1, 2, 3, 4], [1, 2, 5, 6]], 1):
        pass
    [batch] = batches
    assert [type(e) for e in batch] == [BlockStored, BlockStored]
    assert batch[1].parent_block_hash == block_hashes([1, 2], 2)[0]
    async with sim.admit([[1, 2, 3, 4]], 1):
        pass
    async with sim.admit([[7, 8]], 0, use_cache=False):  # embeddings: the cache plays no part
        pass
    assert len(batches) == 1


async def test_clear_cache_says_all_blocks_cleared():
    sim, batches = engine(block_tokens=2)
    async with sim.admit([[1, 2]], 1):
        pass
    sim.clear_cache()
    assert batches[-1] == [AllBlocksCleared()] and len(sim.cache) == 0


def test_kv_events_need_a_tokenizer(tmp_path):
    with pytest.raises(ValidationError, match="kv_events_port needs a tokenizer"):
        SimWorkerConfig(kv_events_port=0)
    with pytest.raises(ValidationError, match="kv_replay_port"):
        SimWorkerConfig(tokenizer=tmp_path, kv_replay_port=0)
    with pytest.raises(ValidationError, match="must differ"):
        SimWorkerConfig(tokenizer=tmp_path, kv_events_port=5557, kv_replay_port=5557)
    with pytest.raises(ValidationError, match="kv_buffer_steps"):
        SimWorkerConfig(tokenizer=tmp_path, kv_events_port=0, kv_buffer_steps=0)
    config = SimWorkerConfig(tokenizer=tmp_path, kv_events_port=0, kv_replay_port=0)
    assert config.kv_buffer_steps == 10000 and config.kv_topic == ""
