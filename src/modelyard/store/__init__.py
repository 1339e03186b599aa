"""The scheduler's persistence: SQLite (a file, or :memory:), the only package that imports sqlite3.

records  StoredModel, StoredVersion, StoredReplica, StoredStatus, StoredServerReplica,
         StoredState (what load() returns), StoreWrite (one transaction's batch)
sqlite   Store(path): load(), write(batch), close(); SCHEMA_VERSION (PRAGMA user_version)
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
from modelyard.store.sqlite import MEMORY, SCHEMA_VERSION, Store

__all__ = [
    "MEMORY",
    "SCHEMA_VERSION",
    "Store",
    "StoreWrite",
    "StoredModel",
    "StoredReplica",
    "StoredServerReplica",
    "StoredState",
    "StoredStatus",
    "StoredVersion",
]
