"""Build the configured SharedState."""

from __future__ import annotations

from collections.abc import Callable

from modelyard.config import StateConfig
from modelyard.state.base import SharedState
from modelyard.state.fallback import FallbackState
from modelyard.state.memory import MemoryState
from modelyard.state.redis import RedisState


def open_state(
    config: StateConfig,
    *,
    on_fallback: Callable[[Exception], None] | None = None,
    on_writeback: Callable[[int], None] | None = None,
) -> SharedState:
    """`on_fallback` is called when Redis fails, `on_writeback` with the number of keys written
    back to Redis after it returned (both only for the redis backend)."""
    local = MemoryState(max_entries=config.max_entries)
    if config.backend == "memory":
        return local
    remote = RedisState(config.url, key_prefix=config.key_prefix, timeout=config.timeout)
    return FallbackState(remote, local, on_fallback=on_fallback, on_writeback=on_writeback)
