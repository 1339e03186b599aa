"""Shared routing state (kv_aware affinity; channels for prefix_aware's index) behind one protocol:
in memory, or in Redis."""

from modelyard.state.base import Entry, RemoteState, SharedState
from modelyard.state.factory import open_state
from modelyard.state.fallback import FallbackState
from modelyard.state.memory import MemoryState
from modelyard.state.redis import RedisState

__all__ = ["Entry", "FallbackState", "MemoryState", "RedisState", "RemoteState", "SharedState", "open_state"]
