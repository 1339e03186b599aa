"""`Store`: the scheduler's state in SQLite, written synchronously, one transaction per batch.

A scheduler mutation touches a handful of small rows, and SQLite commits those in well under a
millisecond in WAL mode, so writes run on the event loop: a thread hop would cost more than the
write. A model is written whole (its row, versions and replicas replaced in one transaction),
which keeps the write path one statement shape and makes a torn model impossible.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson

from modelyard.errors import ConfigError
from modelyard.store.records import (
    StoredModel,
    StoredReplica,
    StoredServerReplica,
    StoredState,
    StoredStatus,
    StoredVersion,
    StoreWrite,
)

MEMORY = ":memory:"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY, deleted INTEGER NOT NULL, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    model TEXT NOT NULL, version INTEGER NOT NULL, spec TEXT NOT NULL, server TEXT,
    instance_count INTEGER, state TEXT NOT NULL, reason TEXT NOT NULL, available INTEGER NOT NULL,
    unavailable INTEGER NOT NULL, draining INTEGER NOT NULL, timestamp REAL,
    PRIMARY KEY (model, version));
CREATE TABLE IF NOT EXISTS replicas (
    model TEXT NOT NULL, version INTEGER NOT NULL, idx INTEGER NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL, timestamp REAL NOT NULL, PRIMARY KEY (model, version, idx));
CREATE TABLE IF NOT EXISTS server_replicas (
    server TEXT NOT NULL, idx INTEGER NOT NULL, inference_url TEXT NOT NULL, memory INTEGER NOT NULL,
    capabilities TEXT NOT NULL, over_commit_percentage INTEGER NOT NULL, shared INTEGER NOT NULL,
    PRIMARY KEY (server, idx));
"""


class Store:
    """The scheduler's SQLite database at `path` (a file, created if missing, or ":memory:").

    An unusable path (a missing folder, a directory, not a database) raises ConfigError naming it."""

    def __init__(self, path: str | Path = MEMORY) -> None:
        self.path = str(path)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                if self.path != MEMORY:
                    self._db.execute("PRAGMA journal_mode=WAL")
                    self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
                self._db.executescript(_SCHEMA)
            except BaseException:
                self._db.close()
                raise
        except sqlite3.Error as exc:
            raise ConfigError(
                f"--db {self.path}", [f"cannot use it as the scheduler database: {exc}"]
            ) from None

    def close(self) -> None:
        self._db.close()

    def load(self) -> StoredState:
        """Every model (by name) with its versions and replicas, and every known server replica."""
        db = self._db
        replicas: dict[tuple[str, int], list[StoredReplica]] = {}
        for model, version, idx, state, reason, ts in db.execute(
            "SELECT model, version, idx, state, reason, timestamp FROM replicas ORDER BY model, version, idx"
        ):
            replicas.setdefault((model, version), []).append(StoredReplica(idx, state, reason, ts))
        versions: dict[str, list[StoredVersion]] = {}
        for row in db.execute(
            "SELECT model, version, spec, server, instance_count, state, reason, available, unavailable,"
            " draining, timestamp FROM versions ORDER BY model, version"
        ):
            model, version, spec, server, instances, *status = row
            versions.setdefault(model, []).append(
                StoredVersion(
                    version,
                    _object(spec),
                    StoredStatus(*status),
                    server,
                    instances,
                    tuple(replicas.get((model, version), ())),
                )
            )
        models = tuple(
            StoredModel(name, _object(spec), bool(deleted), tuple(versions.get(name, ())))
            for name, deleted, spec in db.execute("SELECT name, deleted, spec FROM models ORDER BY name")
        )
        servers = tuple(
            StoredServerReplica(server, idx, url, memory, tuple(orjson.loads(caps)), overcommit, bool(shared))
            for server, idx, url, memory, caps, overcommit, shared in db.execute(
                "SELECT server, idx, inference_url, memory, capabilities, over_commit_percentage, shared"
                " FROM server_replicas ORDER BY server, idx"
            )
        )
        return StoredState(models, servers)

    def write(self, batch: StoreWrite) -> None:
        """Apply `batch` in one transaction (nothing of it is stored if any part fails)."""
        if not batch:
            return
        with closing(self._db.cursor()) as cur:
            cur.execute("BEGIN IMMEDIATE")
            try:
                for name in batch.forget_models:
                    _forget_model(cur, name)
                for model in batch.models:
                    _forget_model(cur, model.name)
                    _insert_model(cur, model)
                for server, index in batch.forget_server_replicas:
                    cur.execute("DELETE FROM server_replicas WHERE server = ? AND idx = ?", (server, index))
                cur.executemany(
                    "INSERT OR REPLACE INTO server_replicas VALUES (?, ?, ?, ?, ?, ?, ?)",
                    list(_server_rows(batch.server_replicas)),
                )
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")


def _forget_model(cur: sqlite3.Cursor, name: str) -> None:
    for table, column in (("replicas", "model"), ("versions", "model"), ("models", "name")):
        cur.execute(f"DELETE FROM {table} WHERE {column} = ?", (name,))


def _insert_model(cur: sqlite3.Cursor, model: StoredModel) -> None:
    cur.execute("INSERT INTO models VALUES (?, ?, ?)", (model.name, int(model.deleted), _json(model.spec)))
    for v in model.versions:
        s = v.status
        cur.execute(
            "INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                model.name,
                v.version,
                _json(v.spec),
                v.server,
                v.instance_count,
                s.state,
                s.reason,
                s.available,
                s.unavailable,
                s.draining,
                s.timestamp,
            ),
        )
        cur.executemany(
            "INSERT INTO replicas VALUES (?, ?, ?, ?, ?, ?)",
            [(model.name, v.version, r.index, r.state, r.reason, r.timestamp) for r in v.replicas],
        )


def _server_rows(replicas: list[StoredServerReplica]) -> Iterator[tuple[Any, ...]]:
    for r in replicas:
        caps = _json(list(r.capabilities))
        yield (r.server, r.index, r.inference_url, r.memory, caps, r.over_commit_percentage, int(r.shared))


def _json(value: object) -> str:
    return orjson.dumps(value).decode()


def _object(text: str) -> dict[str, Any]:
    value = orjson.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"stored spec is not an object: {text[:80]}")
    return value
