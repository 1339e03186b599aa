"""The latency model, pure: prefix cache, block hashing and costs. No clock, no sleeps, no I/O.

A prompt's tokens (words, or a tokenizer's ids) are cut into full blocks of `block_tokens`; each
block is named by a chained hash (previous block's id + this block's tokens, as vLLM does), so a
block only matches when everything before it matches too. The cached prefix is the run of leading
blocks already in the cache; those tokens cost no prefill. A prefill also says which blocks it
added and which the cache evicted for them: what vLLM's KV-cache events tell (cache_events.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

BlockId = bytes
# A prompt's tokens: whitespace-separated words, or token ids when the worker has a tokenizer.
Tokens = Sequence[str] | Sequence[int]
_ROOT: BlockId = b"\x00" * 8
# Token ids chain from another root: a prompt of ids never shares blocks with one of words (the
# word "5" and the id 5), so the blocks events name are only ever built on blocks events named.
_IDS_ROOT: BlockId = b"\x00" * 7 + b"\x01"


def block_hashes(tokens: Tokens, block_tokens: int) -> list[BlockId]:
    """Chained ids of the full blocks of `tokens`; a trailing partial block gets none."""
    ids: list[BlockId] = []
    prev = _ROOT
    if tokens and type(tokens[0]) is not str:
        words = [str(t) for t in tokens]
        prev = _IDS_ROOT
    else:
        words = cast("list[str]", tokens)
    for start in range(0, len(words) - block_tokens + 1, block_tokens):
        block = "\x1f".join(words[start : start + block_tokens]).encode()
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        ids.append(prev)
    return ids


class PrefixCache:
    """An LRU set of block ids holding at most `capacity` blocks (0 disables caching)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[BlockId, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[BlockId]) -> int:
        """How many leading blocks are cached. Does not touch the LRU order."""
        hit = 0
        for block in blocks:
            if block not in self._blocks:
                break
            hit += 1
        return hit

    def insert(self, blocks: Sequence[BlockId]) -> list[BlockId]:
        """Insert or touch `blocks`, evicting the least recently used beyond capacity; returns
        the evicted blocks, oldest first (usually none: the list costs nothing then).

        Blocks are touched last-to-first so that, as in vLLM's free-block queue, a prompt's tail
        is evicted before its head and a shared prefix outlives the suffixes built on it. So the
        cache only ever holds whole prefixes: a block's parent is cached whenever it is.
        """
        evicted: list[BlockId] = []
        if self.capacity <= 0:
            return evicted
        cached = self._blocks
        for block in reversed(blocks):
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity:  # bounded: shrinks by one each round
            evicted.append(cached.popitem(last=False)[0])
        return evicted

    def clear(self) -> None:
        self._blocks.clear()

    def match_and_insert(self, blocks: Sequence[BlockId]) -> int:
        hit = self.match(blocks)
        self.insert(blocks)
        return hit


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_ms_per_token: float
    decode_ms_per_token: float
    slowdown: float = 1.0

    def prefill_ms(self, uncached_tokens: int) -> float:
        return uncached_tokens * self.prefill_ms_per_token * self.slowdown

    def decode_ms(self, steps: int = 1) -> float:
        return steps * self.decode_ms_per_token * self.slowdown


@dataclass(frozen=True, slots=True)
class Prefill:
    """One admitted prompt: its tokens and how many of them the prefix cache held; with a cache,
    its full blocks, how many of them were cached, and what the cache evicted to hold the rest."""

    prompt_tokens: int
    cached_tokens: int
    blocks: Sequence[BlockId] = ()
    cached_blocks: int = 0
    evicted: Sequence[BlockId] = ()

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def stored(self) -> Sequence[BlockId]:
        """The blocks this prefill added to the cache: all after the cached prefix (the cache holds
        whole prefixes, so none of them was there)."""
        return self.blocks[self.cached_blocks :]

    @property
    def parent(self) -> BlockId | None:
        """The block the stored ones are built on; None: they start the prompt."""
        return self.blocks[self.cached_blocks - 1] if self.cached_blocks else None


def plan_prefill(cache: PrefixCache | None, tokens: Tokens, block_tokens: int) -> Prefill:
    """Match `tokens` against `cache` and record their blocks. `cache=None`: nothing is cached."""
    if cache is None or cache.capacity <= 0:
        return Prefill(len(tokens), 0)
    blocks = block_hashes(tokens, block_tokens)
    hit = cache.match(blocks)
    evicted = cache.insert(blocks)
    return Prefill(len(tokens), hit * block_tokens, blocks, hit, evicted)


def kv_blocks_needed(prompt_tokens: int, max_tokens: int, block_tokens: int) -> int:
    """Blocks a running request occupies for its prompt and its whole output (ceiling)."""
    return -(-(prompt_tokens + max_tokens) // block_tokens)


def cache_usage(blocks_in_use: int, capacity: int) -> float:
    """vLLM's `gpu_cache_usage_perc`: the fraction of blocks held by running requests, 0..1."""
    if capacity <= 0:
        return 0.0
    return min(1.0, blocks_in_use / capacity)
