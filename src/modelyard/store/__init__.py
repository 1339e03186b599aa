"""The scheduler's persistence: SQLite (a file, or :memory:), the only package that imports sqlite3.

records  StoredModel, StoredVersion, StoredReplica, StoredStatus, StoredServerReplica,
         StoredState (what load() returns), StoreWrite (one transaction's batch)
sqlite   Store(path): load(), write(batch), close()
"""

from modelyard.store.records import (
    StoredModel,
    StoredReplica,
    StoredServerReplica,
    StoredState,
    StoredStatus,
    StoredVersion,
    StoreWrite,
)
from modelyard.store.sqlite import MEMORY, Store

__all__ = [
    "MEMORY",
    "Store",
    "StoreWrite",
    "StoredModel",
    "StoredReplica",
    "StoredServerReplica",
    "StoredState",
    "StoredStatus",
    "StoredVersion",
]
