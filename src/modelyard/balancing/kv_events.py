"""prefix_aware's precise mode: what each endpoint really holds, from vLLM's KV-cache events.

vLLM (`--kv-events-config`) publishes on a ZMQ PUB socket, per engine step, one message of three
frames: a topic, an 8-byte big-endian sequence number, and an `EventBatch` encoded by msgspec as
msgpack: `[ts, events, data_parallel_rank]`, each event a tagged array
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`. The wire types below mirror
vLLM's (`vllm.distributed.kv_events`); older vLLMs send fewer trailing fields, newer ones may send
more, and both decode.

vLLM names a block by a hash the gateway cannot compute (its seed is random unless PYTHONHASHSEED
is set, and the algorithm is a server flag), so the index names blocks by keys of its own: a
64-bit BLAKE2b chained over the token ids (`block_keys`), computed from the `token_ids` a
`BlockStored` carries and from the prompt's tokens (the model's tokenizer) when routing. Each
endpoint maps the server's hashes to those keys, so `BlockRemoved` (hashes only) finds its keys.

`KvIndex` is pure (DESIGN.md habit 1): time is an argument; the sockets are the gateway's
(gateway/kv_subscriber.py). Per endpoint it says whether the index can be trusted (`usable`):
- `waiting`: no event yet; `live`: every event since the server's start (or since a clear) seen;
- `rebuilding`: events were lost (a sequence gap the replay did not fill, an undecodable batch,
  a block built on a parent never seen): the index is kept but routing uses the approximate one
  until 32 `BlockStored` in a row build on blocks the index knows (or on none), which says the
  index covers what the server builds on again;
- quiet: answers keep coming from the endpoint (8 or more since its last batch) but no batch for
  `stale_after` seconds: the events stopped, and routing falls back until they resume.
An endpoint's index is bounded (`max_blocks`, least recently stored dropped first).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from hashlib import blake2b as _blake2b
from typing import Any

import msgspec

# A block hash as vLLM sends it: an int (64-bit hash algorithms, older releases) or bytes (sha256).
BlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name, as vLLM's are."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) for what is not a batch of these events."""
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


# The end of a replay (vLLM's publisher): a sequence number of -1 and an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

_ROOT = bytes(8)


def block_keys(
    token_ids: Sequence[int], block_size: int, parent: int | None = None, lora: int | None = None
) -> list[int]:
    """The index's keys of the full blocks of `token_ids` (a partial tail block has none, as in
    vLLM's prefix cache), chained from `parent` (the key of the block before the first; None: the
    prompt's start, of the base model or of the LoRA adapter `lora`). Raises OverflowError for a
    token id outside 64 bits."""
    keys: list[int] = []
    if parent is not None:
        previous = parent.to_bytes(8, "big")
    elif lora is not None:
        previous = _blake2b(b"lora:%d" % lora, digest_size=8).digest()
    else:
        previous = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        previous = _blake2b(previous + tokens, digest_size=8).digest()
        keys.append(int.from_bytes(previous, "big"))
    return keys


WAITING, LIVE, REBUILDING = "waiting", "live", "rebuilding"
# What the index holds for a block it learnt is held without its hash (`_learn_parent`): never a
# server's hash, which are 8 or 32 bytes, or an int.
_LEARNT = b"learnt:"


def _learnt(key: int) -> bytes:
    return _LEARNT + key.to_bytes(8, "big")


# BlockStored events in a row, built on blocks the index knows, after which a rebuilding index is
# trusted again.
REBUILT_AFTER = 32
# Answers from an endpoint since its last batch after which silence means its events stopped.
QUIET_ANSWERS = 8
# vLLM's hashes are 8 (64-bit algorithms) or 32 bytes (sha256); longer ones are garbage.
_MAX_HASH_BYTES = 64
# Blocks of prompts sent to a rebuilding endpoint, kept to learn the parents its events name
# (`EndpointBlocks.sent`): enough for the prompts of the last few seconds of a busy endpoint.
_SENT_BLOCKS = 8192
# Tiers that are not the server's GPU prefix cache (vLLM's CPU offloading): not counted as held.
_GPU_MEDIUMS = (None, "GPU", "gpu")


class EndpointBlocks:
    """One endpoint's blocks, as its events say."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.state = WAITING
        self.last_seq = -1  # the next batch expected is last_seq + 1
        self.block_size: int | None = None
        self.last_batch = float("-inf")
        self.answered = 0  # answers relayed from it since its last batch
        self.clean = 0  # BlockStored in a row built on known blocks (rebuilding)
        # our key -> the server's hash, least recently stored first
        self.held: OrderedDict[int, BlockHash] = OrderedDict()
        self.keys: dict[BlockHash, int] = {}  # the server's hash -> our key
        # Blocks the index dropped itself (over max_blocks) that the server may still hold: their
        # keys, so that blocks stored on them later still chain (bounded too).
        self.forgotten: OrderedDict[BlockHash, int] = OrderedDict()
        # While rebuilding: each full block of the prompts sent here, by its tokens -> (the
        # prompt's token ids, its keys, the block's position), to learn the parents stored before
        # the index joined (`_learn_parent`).
        self.recent: OrderedDict[bytes, tuple[Sequence[int], list[int], int]] = OrderedDict()
        self.counts: Counter[str] = Counter()  # events by kind, and faults

    def clear(self) -> None:
        self.held.clear()
        self.keys.clear()
        self.forgotten.clear()
        self.recent.clear()

    def sent(self, token_ids: Sequence[int], keys: list[int]) -> None:
        """A prompt of these token ids (and these keys, at this endpoint's block size) was sent
        here: its blocks are kept, by their tokens, for `_learn_parent` (bounded)."""
        size = self.block_size
        assert size is not None
        recent = self.recent
        for position in range(1, len(keys)):
            start = position * size
            recent[array("q", token_ids[start : start + size]).tobytes()] = (token_ids, keys, position)
        while len(recent) > _SENT_BLOCKS:  # bounded: one removal per round
            recent.popitem(last=False)

    def _learn_parent(self, event: BlockStored) -> int | None:
        """The key of the unknown parent of `event`'s blocks, learnt from a prompt sent here: a
        server stores the blocks of a prompt past the ones it holds, chained on the last one it
        holds, so blocks whose tokens continue a prompt sent here at block `k` are chained on that
        prompt's block `k - 1`, and the server holds the prompt's blocks up to it (marked held
        now, with the parent's hash; the others' hashes are learnt when stored again). None when
        no prompt sent here continues with these tokens."""
        size = event.block_size
        if size != self.block_size or len(event.token_ids) < size:
            return None
        found = self.recent.get(array("q", event.token_ids[:size]).tobytes())
        if found is None:
            return None
        token_ids, keys, position = found
        start = position * size
        if list(token_ids[start : start + len(event.token_ids)]) != list(event.token_ids):
            return None  # the same block in another prompt: not this one
        held = self.held
        parent = keys[position - 1]
        for index in range(position - 1, -1, -1):  # (tail first, as `store` does)
            key = keys[index]
            if key not in held:
                held[key] = _learnt(key)
        old = held[parent]
        if type(old) is bytes and old.startswith(_LEARNT):
            held[parent] = event.parent_block_hash  # type: ignore[assignment]
        self.keys[event.parent_block_hash] = parent  # type: ignore[index]
        self.counts["learnt_parents"] += 1
        return parent

    def store(self, event: BlockStored) -> bool:
        """False when the event builds on a parent the index does not know (its blocks cannot be
        named: they are left out)."""
        if event.medium not in _GPU_MEDIUMS:
            self.counts["other_medium"] += 1
            return True
        size = event.block_size
        if size < 1:
            raise ValueError(f"block_size {size}")
        self.block_size = size  # (the server's, whatever the block chains on: prompts are sent by it)
        parent = event.parent_block_hash
        if parent is None:
            key = None
        else:
            key = self.keys.get(parent)
            if key is None:
                key = self.forgotten.get(parent)
                if key is None:
                    key = self._learn_parent(event) if self.recent else None
                    if key is None:
                        return False
        # A LoRA adapter's blocks chain from a root of their own: a base model's prompt never
        # matches them (the gateway does not know which adapter a request names).
        named = block_keys(event.token_ids, size, key, event.lora_id)
        if len(named) != len(event.block_hashes):
            raise ValueError(f"{len(event.block_hashes)} block hashes for {len(event.token_ids)} tokens")
        held, keys = self.held, self.keys
        # Tail first, so that a prompt's head is the most recently stored of its blocks: the
        # index's own bound then drops tails before the heads others build on, as vLLM evicts.
        for block, name in zip(reversed(event.block_hashes), reversed(named), strict=True):
            if type(block) is bytes and len(block) > _MAX_HASH_BYTES:
                raise ValueError("a block hash over 64 bytes")
            old = held.pop(name, None)
            if old is not None and old != block:
                keys.pop(old, None)
            other = keys.get(block)
            if other is not None and other != name:
                held.pop(other, None)  # one server hash, one key: the older one goes
            held[name] = block
            keys[block] = name
        forgotten = self.forgotten
        while len(held) > self.max_blocks:  # bounded: one removal per round
            dropped, block = held.popitem(last=False)
            if keys.get(block) == dropped:
                del keys[block]
                forgotten[block] = dropped
                if len(forgotten) > max(1024, self.max_blocks // 8):
                    forgotten.popitem(last=False)
            self.counts["dropped"] += 1
        return True

    def remove(self, event: BlockRemoved) -> int:
        """Removes the blocks; returns how many the index did not know."""
        if event.medium not in _GPU_MEDIUMS:
            return 0
        unknown = 0
        for block in event.block_hashes:
            self.forgotten.pop(block, None)
            key = self.keys.pop(block, None)
            if key is None:
                unknown += 1
            else:
                self.held.pop(key, None)
        return unknown

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these keys the endpoint holds."""
        held = self.held
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count


class Applied:
    """What `KvIndex.apply` did with a batch."""

    APPLIED, GAP, RESTART, GARBAGE = "applied", "gap", "restart", "garbage"


class KvIndex:
    """The endpoints' blocks, from their event streams (`apply`), for prefix_aware (`held`)."""

    def __init__(self, max_blocks: int = 131072, stale_after: float = 5.0) -> None:
        self.max_blocks = max_blocks
        self.stale_after = stale_after
        self.endpoints: dict[str, EndpointBlocks] = {}

    def track(self, endpoint: str) -> EndpointBlocks:
        """The endpoint's blocks, made when it is first subscribed to."""
        blocks = self.endpoints.get(endpoint)
        if blocks is None:
            blocks = self.endpoints[endpoint] = EndpointBlocks(self.max_blocks)
        return blocks

    def keep_only(self, endpoints: Iterable[str]) -> None:
        keep = set(endpoints)
        for name in [n for n in self.endpoints if n not in keep]:
            del self.endpoints[name]

    def apply(self, endpoint: str, seq: int, payload: bytes, now: float) -> str:
        """Apply the batch numbered `seq`. Returns Applied.GAP, without applying it, when batches
        before it were not seen (the caller asks the replay endpoint for them, or calls `lost`);
        Applied.RESTART when the numbering went back (the server restarted: its cache is empty,
        and the index with it); Applied.GARBAGE when it does not decode (the index is then
        rebuilding)."""
        blocks = self.track(endpoint)
        result = Applied.APPLIED
        if seq <= blocks.last_seq:
            blocks.clear()
            blocks.counts["restarts"] += 1
            blocks.state = LIVE if seq == 0 else REBUILDING
            blocks.clean = 0
            result = Applied.RESTART
        elif seq != blocks.last_seq + 1:
            return Applied.GAP
        blocks.last_seq = seq
        blocks.last_batch = now
        blocks.answered = 0
        if blocks.state == WAITING:
            blocks.state = LIVE  # (seq 0: every event since the server started)
        try:
            batch = decode_batch(payload)
            for event in batch.events:
                self._apply_event(blocks, event)
        except (
            msgspec.DecodeError,
            ValueError,
            OverflowError,
        ):  # (DecodeError: not a ValueError before 0.19.x)
            blocks.counts["garbage"] += 1
            self._lose(blocks)
            return Applied.GARBAGE
        return result

    def lost(self, endpoint: str, upto: int) -> None:
        """The batches before `upto` cannot be had: the index goes on from `upto`, rebuilding."""
        blocks = self.track(endpoint)
        blocks.counts["gaps"] += 1
        blocks.last_seq = upto - 1
        self._lose(blocks)

    def sent(self, endpoint: str, token_ids: Sequence[int], keys_by_size: Mapping[int, list[int]]) -> None:
        """A prompt of these token ids (its keys by block size) was sent to `endpoint`: while its
        index is rebuilding, kept to learn the parents of what it stores next."""
        blocks = self.endpoints.get(endpoint)
        if blocks is None or blocks.state != REBUILDING or blocks.block_size is None:
            return
        keys = keys_by_size.get(blocks.block_size)
        if keys:
            blocks.sent(token_ids, keys)

    def answered(self, endpoint: str) -> None:
        """An answer from `endpoint` was relayed (a server that answers stores blocks and says so)."""
        blocks = self.endpoints.get(endpoint)
        if blocks is not None:
            blocks.answered += 1

    def usable(self, endpoint: str, now: float) -> EndpointBlocks | None:
        """The endpoint's blocks if routing can trust them now, else None (approximate routing)."""
        blocks = self.endpoints.get(endpoint)
        if blocks is None or blocks.state != LIVE or blocks.block_size is None:
            return None
        if blocks.answered >= QUIET_ANSWERS and now - blocks.last_batch > self.stale_after:
            return None
        return blocks

    def status(self, endpoint: str, now: float) -> str:
        """waiting, live, rebuilding or quiet (for /admin/overview and metrics)."""
        blocks = self.endpoints.get(endpoint)
        if blocks is None:
            return WAITING
        if blocks.state == LIVE and self.usable(endpoint, now) is None and blocks.block_size is not None:
            return "quiet"
        return blocks.state

    def describe(self, endpoint: str, now: float) -> dict[str, object] | None:
        """The endpoint's precise-mode status for /admin/overview (None: it has no KV events)."""
        blocks = self.endpoints.get(endpoint)
        if blocks is None:
            return None
        return {
            "state": self.status(endpoint, now),
            "precise": self.usable(endpoint, now) is not None,
            "blocks": len(blocks.held),
            "block_size": blocks.block_size,
            "last_seq": blocks.last_seq,
            "seconds_since_event": None
            if blocks.last_batch == float("-inf")
            else round(now - blocks.last_batch, 3),
            "counts": dict(blocks.counts),
        }

    def _apply_event(self, blocks: EndpointBlocks, event: object) -> None:
        counts = blocks.counts
        if type(event) is BlockStored:
            counts["stored"] += 1
            if blocks.store(event):
                if blocks.state == REBUILDING:
                    blocks.clean += 1
                    if blocks.clean >= REBUILT_AFTER:
                        blocks.state = LIVE
                        blocks.recent.clear()  # (only a rebuilding index learns parents)
            else:
                counts["unknown_parent"] += 1
                self._lose(blocks)
        elif type(event) is BlockRemoved:
            counts["removed"] += 1
            unknown = blocks.remove(event)
            if unknown:
                # A block evicted before the index saw it stored (one it joined or rebuilt after):
                # removing nothing is harmless, so counted and nothing more.
                counts["unknown_removed"] += unknown
        else:  # AllBlocksCleared: the server holds nothing, and the index knows it all
            counts["cleared"] += 1
            blocks.clear()
            blocks.state = LIVE

    @staticmethod
    def _lose(blocks: EndpointBlocks) -> None:
        blocks.state = REBUILDING
        blocks.clean = 0
