"""The latency model, pure: prefix cache, block hashing and costs. No clock, no sleeps, no I/O.

A prompt's tokens are cut into full blocks of `block_tokens`; each block is named by a chained
hash (previous block's id + this block's tokens, as vLLM does), so a block only matches when
everything before it matches too. The cached prefix is the run of leading blocks already in the
cache; those tokens cost no prefill.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockId = bytes
_ROOT: BlockId = b"\x00" * 8


def block_hashes(tokens: Sequence[str], block_tokens: int) -> list[BlockId]:
    """Chained ids of the full blocks of `tokens`; a trailing partial block gets none."""
    ids: list[BlockId] = []
    prev = _ROOT
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = "\x1f".join(tokens[start : start + block_tokens]).encode()
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

    def insert(self, blocks: Sequence[BlockId]) -> None:
        """Insert or touch `blocks`, evicting the least recently used beyond capacity.

        Blocks are touched last-to-first so that, as in vLLM's free-block queue, a prompt's tail
        is evicted before its head and a shared prefix outlives the suffixes built on it.
        """
        if self.capacity <= 0:
            return
        for block in reversed(blocks):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:  # bounded: shrinks by one each round
            self._blocks.popitem(last=False)

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
    """One admitted prompt: its tokens and how many of them the prefix cache held."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def plan_prefill(cache: PrefixCache | None, tokens: Sequence[str], block_tokens: int) -> Prefill:
    """Match `tokens` against `cache` and record their blocks. `cache=None`: nothing is cached."""
    if cache is None or cache.capacity <= 0:
        return Prefill(len(tokens), 0)
    hit_blocks = cache.match_and_insert(block_hashes(tokens, block_tokens))
    return Prefill(len(tokens), hit_blocks * block_tokens)


def kv_blocks_needed(prompt_tokens: int, max_tokens: int, block_tokens: int) -> int:
    """Blocks a running request occupies for its prompt and its whole output (ceiling)."""
    return -(-(prompt_tokens + max_tokens) // block_tokens)


def cache_usage(blocks_in_use: int, capacity: int) -> float:
    """vLLM's `gpu_cache_usage_perc`: the fraction of blocks held by running requests, 0..1."""
    if capacity <= 0:
        return 0.0
    return min(1.0, blocks_in_use / capacity)
