"""What a prefill did to the prefix cache, as vLLM's KV-cache events say it (pure).

vLLM publishes, per engine step, a `BlockStored` for the blocks a request newly cached (their
hashes, the hash of the block they follow, their token ids) and a `BlockRemoved` for those evicted
to make room; the gateway's precise prefix routing (balancing/kv_events.py) rebuilds each server's
cache from them. The sim names its blocks by its own ids (latency.block_hashes), sent as bytes, as
vLLM's sha256 hashes are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from modelyard.balancing.kv_events import BlockRemoved, BlockStored
from modelyard.simworker.latency import Prefill, Tokens


def prefill_events(prefill: Prefill, tokens: Tokens, block_tokens: int) -> list[BlockStored | BlockRemoved]:
    """The events of one admitted prompt: its new blocks (when its tokens are token ids: words
    cannot be told to a subscriber, which hashes ids) and what the cache evicted for them."""
    events: list[BlockStored | BlockRemoved] = []
    stored = prefill.stored
    if stored and type(tokens[0]) is int:
        first = prefill.cached_blocks * block_tokens
        token_ids = list(cast("Sequence[int]", tokens)[first : first + len(stored) * block_tokens])
        events.append(
            BlockStored(
                block_hashes=list(stored),
                parent_block_hash=prefill.parent,
                token_ids=token_ids,
                block_size=block_tokens,
            )
        )
    if prefill.evicted:
        # (Blocks of a word prompt too: the subscriber never knew them and ignores them, but an
        # evicted block it knows must be said gone whichever prompt pushed it out.)
        events.append(BlockRemoved(block_hashes=list(prefill.evicted)))
    return events
