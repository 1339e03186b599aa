"""Shared routing state (kv_aware affinity) behind one protocol: in memory, or in Redis."""

from modelyard.state.base import SharedState
from modelyard.state.factory import open_state
from modelyard.state.fallback import FallbackState
from modelyard.state.memory import MemoryState
from modelyard.state.redis import RedisState

__all__ = ["FallbackState", "MemoryState", "RedisState", "SharedState", "open_state"]
