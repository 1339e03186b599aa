"""KvIndex: what each endpoint holds, from vLLM's KV-cache events, and when it can be trusted."""

from __future__ import annotations

import msgspec
import pytest

from modelyard.balancing.kv_events import (
    LIVE,
    QUIET_ANSWERS,
    REBUILDING,
    REBUILT_AFTER,
    WAITING,
    AllBlocksCleared,
    Applied,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvIndex,
    block_keys,
    decode_batch,
    encode_batch,
)

SIZE = 4


def stored(
    hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int], medium: str | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=SIZE, medium=medium
    )


def batch(*events: object) -> bytes:
    return encode_batch(KVEventBatch(ts=1.0, events=list(events)))


PROMPT = list(range(100, 116))  # four blocks of four tokens
KEYS = block_keys(PROMPT, SIZE)


def live_index(**kwargs: float) -> KvIndex:
    kv = KvIndex(**kwargs)  # type: ignore[arg-type]
    assert kv.apply("a", 0, batch(stored([1, 2], None, PROMPT[:8])), now=0.0) == Applied.APPLIED
    return kv


def test_block_keys_chain_over_full_blocks_only() -> None:
    assert len(block_keys([*PROMPT, 1, 2], SIZE)) == 4  # a partial tail block has no key
    # a chain started from a parent continues the whole prompt's chain
    assert block_keys(PROMPT[8:], SIZE, KEYS[1]) == KEYS[2:]
    assert block_keys([9, *PROMPT[1:]], SIZE)[0] != KEYS[0]


def test_stored_blocks_are_matched_by_the_prompts_tokens() -> None:
    kv = live_index()
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.block_size == SIZE
    assert blocks.match(KEYS) == 2
    # the next blocks, built on the server's hash of block 2, extend the same chain
    kv.apply("a", 1, batch(stored([3, 4], 2, PROMPT[8:])), now=0.0)
    assert blocks.match(KEYS) == 4
    assert blocks.match(block_keys([*PROMPT[:8], 7, 7, 7, 7], SIZE)) == 2


def test_removed_blocks_are_no_longer_held() -> None:
    kv = live_index()
    kv.apply("a", 1, batch(stored([3, 4], 2, PROMPT[8:])), now=0.0)
    kv.apply("a", 2, batch(BlockRemoved(block_hashes=[3])), now=0.0)
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 2
    # a block evicted before the index saw it stored: counted, harmless
    kv.apply("a", 3, batch(BlockRemoved(block_hashes=[99])), now=0.0)
    assert blocks.counts["unknown_removed"] == 1 and kv.usable("a", 0.0) is not None


def test_all_blocks_cleared_empties_the_index_and_it_stays_trusted() -> None:
    kv = live_index()
    kv.apply("a", 1, batch(AllBlocksCleared()), now=0.0)
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 0 and not blocks.held


def test_hashes_may_be_bytes_as_newer_vllms_send_them() -> None:
    kv = KvIndex()
    kv.apply("a", 0, batch(stored([b"\x01" * 32, b"\x02" * 32], None, PROMPT[:8])), now=0.0)
    kv.apply("a", 1, batch(stored([b"\x03" * 32], b"\x02" * 32, PROMPT[8:12])), now=0.0)
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 3


def test_a_late_joiner_sees_a_gap_and_rebuilds_until_stores_chain_again() -> None:
    kv = KvIndex()
    assert kv.status("a", 0.0) == WAITING
    payload = batch(stored([1, 2], None, PROMPT[:8]))
    assert kv.apply("a", 5, payload, now=0.0) == Applied.GAP  # batches 0 to 4 were never seen
    assert kv.track("a").last_seq == -1  # not applied
    kv.lost("a", 5)
    assert kv.apply("a", 5, payload, now=0.0) == Applied.APPLIED
    assert kv.status("a", 0.0) == REBUILDING and kv.usable("a", 0.0) is None
    assert kv.track("a").counts["gaps"] == 1
    # stores built on known blocks (or on none) rebuild trust
    seq = 6
    for i in range(REBUILT_AFTER - 1):
        kv.apply("a", seq, batch(stored([1000 + i], None, [i, i, i, i])), now=0.0)
        seq += 1
    kv.apply("a", seq, batch(stored([5000], 2, PROMPT[8:12])), now=0.0)
    assert kv.status("a", 0.0) == LIVE
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 3


def test_a_block_built_on_an_unknown_parent_sends_the_endpoint_back_to_approximate() -> None:
    kv = live_index()
    kv.apply("a", 1, batch(stored([8], 12345, PROMPT[8:12])), now=0.0)
    assert kv.usable("a", 0.0) is None and kv.status("a", 0.0) == REBUILDING
    assert kv.track("a").counts["unknown_parent"] == 1
    assert kv.track("a").match(KEYS) == 2  # what it knew stays, for when it is trusted again


def rebuilding_after_its_hot_prefix() -> KvIndex:
    """An index that joined a server after the blocks of a prompt's first two blocks (hashes 1, 2)
    were stored: the server's replay no longer has them."""
    kv = KvIndex()
    assert kv.apply("a", 7, batch(stored([90], None, [9, 9, 9, 9])), now=0.0) == Applied.GAP
    kv.lost("a", 7)
    kv.apply("a", 7, batch(stored([90], None, [9, 9, 9, 9])), now=0.0)  # (its block size is known)
    assert kv.status("a", 0.0) == REBUILDING
    return kv


def test_a_parent_stored_before_the_index_joined_is_learnt_from_a_prompt_sent_there() -> None:
    """The server holds PROMPT's first two blocks (from before the index joined); the gateway sends
    it PROMPT, and it stores blocks 3 and 4 on block 2's hash: the index learns that hash is
    PROMPT's block 2, and that the server holds the whole prompt."""
    kv = rebuilding_after_its_hot_prefix()
    kv.sent("a", PROMPT, {SIZE: KEYS})
    kv.apply("a", 8, batch(stored([3, 4], 2, PROMPT[8:])), now=0.0)
    blocks = kv.track("a")
    assert blocks.counts["learnt_parents"] == 1 and blocks.counts["unknown_parent"] == 0
    assert blocks.match(KEYS) == 4
    # the learnt parent chains what comes next on it too, without another prompt
    other = [*PROMPT[:8], 7, 7, 7, 7]
    kv.apply("a", 9, batch(stored([5], 2, [7, 7, 7, 7])), now=0.0)
    assert blocks.match(block_keys(other, SIZE)) == 3
    # and enough such stores make it live again
    seq = 10
    for i in range(REBUILT_AFTER):
        kv.apply("a", seq, batch(stored([600 + i], 4, [i, i, i, i])), now=0.0)
        seq += 1
    assert kv.status("a", 0.0) == LIVE and not blocks.recent  # (nothing kept once live)


def test_a_block_whose_tokens_continue_no_prompt_sent_there_is_still_unknown() -> None:
    kv = rebuilding_after_its_hot_prefix()
    kv.sent("a", PROMPT, {SIZE: KEYS})
    # block 3's tokens, but going on with others than PROMPT's: not PROMPT's continuation
    kv.apply("a", 8, batch(stored([3, 4], 2, [*PROMPT[8:12], 1, 1, 1, 1])), now=0.0)
    # tokens no prompt sent there has
    kv.apply("a", 9, batch(stored([8], 77, [5, 5, 5, 5])), now=0.0)
    blocks = kv.track("a")
    assert blocks.counts["unknown_parent"] == 2 and blocks.counts["learnt_parents"] == 0
    assert blocks.match(KEYS) == 0


def test_prompts_are_kept_to_learn_from_only_while_the_endpoint_rebuilds_and_boundedly() -> None:
    kv = live_index()
    kv.sent("a", PROMPT, {SIZE: KEYS})
    assert not kv.track("a").recent  # live: everything chains, nothing to learn
    kv = rebuilding_after_its_hot_prefix()
    for n in range(3000):  # 3 blocks past the first of each: 9,000 kept at most 8,192
        ids = [n * 16 + t for t in range(16)]
        kv.sent("a", ids, {SIZE: block_keys(ids, SIZE)})
    assert len(kv.track("a").recent) == 8192


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 not msgpack",
        msgspec.msgpack.encode([1.0, [["Unknown", 1]]]),
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode(
            [1.0, [["BlockStored", [1, 2], None, [1, 2, 3], SIZE, None, None]]]
        ),  # 2 hashes, 0 blocks
        msgspec.msgpack.encode(
            [1.0, [["BlockStored", [1], None, [1, 2, 3, (1 << 64) - 1], SIZE, None, None]]]
        ),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0, None, None]]]),
    ],
    ids=["not-msgpack", "unknown-tag", "a-map", "hash-count", "token-over-64-bits", "block-size-0"],
)
def test_garbage_is_counted_and_the_endpoint_rebuilds(payload: bytes) -> None:
    kv = live_index()
    assert kv.apply("a", 1, payload, now=0.0) == Applied.GARBAGE
    assert kv.usable("a", 0.0) is None and kv.track("a").counts["garbage"] == 1
    assert kv.apply("a", 2, batch(stored([3], 2, PROMPT[8:12])), now=0.0) == Applied.APPLIED  # and goes on


def test_a_restarted_server_starts_empty() -> None:
    kv = live_index()
    kv.apply("a", 1, batch(stored([3], 2, PROMPT[8:12])), now=0.0)
    assert kv.apply("a", 0, batch(stored([7], None, PROMPT[:4])), now=0.0) == Applied.RESTART
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 1 and blocks.counts["restarts"] == 1


def test_events_that_stop_while_answers_go_on_fall_back_until_they_resume() -> None:
    kv = live_index(stale_after=5.0)
    for _ in range(QUIET_ANSWERS):
        kv.answered("a")
    assert kv.usable("a", 4.0) is not None  # not yet stale_after seconds without a batch
    assert kv.usable("a", 6.0) is None and kv.status("a", 6.0) == "quiet"
    kv.apply("a", 1, batch(), now=6.0)  # an empty batch is a sign of life too
    assert kv.usable("a", 6.0) is not None


def test_an_idle_server_is_not_taken_for_a_dead_one() -> None:
    kv = live_index(stale_after=5.0)
    assert kv.usable("a", 3600.0) is not None  # nothing answered, nothing to report


def test_the_index_is_bounded_tails_first_and_still_chains_on_what_it_dropped() -> None:
    kv = KvIndex(max_blocks=3)
    kv.apply("a", 0, batch(stored([1, 2, 3, 4], None, PROMPT)), now=0.0)
    blocks = kv.track("a")
    assert len(blocks.held) == 3 and len(blocks.keys) == 3 and blocks.counts["dropped"] == 1
    assert blocks.match(KEYS) == 3  # the tail went first: the head others build on stays
    # a block stored on the one the index dropped still chains: no fault, the endpoint stays live
    more = [*PROMPT, 5, 5, 5, 5]
    kv.apply("a", 1, batch(stored([5], 4, more[16:])), now=0.0)
    assert kv.usable("a", 0.0) is not None and "unknown_parent" not in blocks.counts
    assert block_keys(more, SIZE)[4] in blocks.held


def test_lora_blocks_never_match_a_base_model_prompt() -> None:
    kv = KvIndex()
    lora = BlockStored([1, 2], None, PROMPT[:8], SIZE, lora_id=7)
    kv.apply("a", 0, batch(lora, stored([3], 2, PROMPT[8:12])), now=0.0)
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 0 and len(blocks.held) == 3


def test_other_tiers_are_not_the_gpu_prefix_cache() -> None:
    kv = live_index()
    kv.apply("a", 1, batch(stored([3], 2, PROMPT[8:12], medium="CPU")), now=0.0)
    blocks = kv.usable("a", 0.0)
    assert blocks is not None and blocks.match(KEYS) == 2 and blocks.counts["other_medium"] == 1


def test_describe_says_what_the_overview_shows() -> None:
    kv = live_index()
    described = kv.describe("a", 2.5)
    assert described is not None
    assert described["state"] == LIVE and described["precise"] is True and described["blocks"] == 2
    assert described["block_size"] == SIZE and described["last_seq"] == 0
    assert described["seconds_since_event"] == 2.5
    assert kv.describe("b", 0.0) is None


def test_keep_only_forgets_endpoints_no_longer_subscribed() -> None:
    kv = live_index()
    kv.track("b")
    kv.keep_only(["b"])
    assert set(kv.endpoints) == {"b"} and kv.usable("b", 0.0) is None


def test_decode_round_trips_and_takes_older_and_newer_layouts() -> None:
    sent = KVEventBatch(
        ts=2.0, events=[stored([1], None, PROMPT[:4]), BlockRemoved(block_hashes=[1]), AllBlocksCleared()]
    )
    assert decode_batch(encode_batch(sent)) == sent
    # vLLM before `medium` (five fields) and a future one with a field more
    older = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], SIZE, None]]])
    newer = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [1, 2, 3, 4], SIZE, None, "GPU", "x"]], 0]
    )
    assert decode_batch(older).events[0].medium is None
    decoded = decode_batch(newer)
    assert decoded.events[0].medium == "GPU" and decoded.data_parallel_rank == 0
