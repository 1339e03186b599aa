"""`Store`: the scheduler's state in SQLite, written synchronously, one transaction per batch.

A scheduler mutation touches a handful of small rows, and SQLite commits those in well under a
millisecond in WAL mode, so writes run on the event loop: a thread hop would cost more than the
write. A model is written whole (its row, versions and replicas replaced in one transaction),
which keeps the write path one statement shape and makes a torn model impossible; the scheduler
prunes a model's retired versions, so "whole" stays a handful of rows.

Only the scheduler process writes the file, so a lock is never worth waiting for: the busy timeout
is short (a write that cannot get the lock fails fast with StoreWriteFailed instead of blocking the
event loop for SQLite's default 5 s).

The schema is versioned with `PRAGMA user_version` (`SCHEMA_VERSION`). A database of version 0
with the original tables (before versioning) is upgraded in place; a newer version, or tables that
are not this schema's, are refused with a ConfigError naming the file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson

from modelyard.errors import ConfigError, StoreWriteFailed
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
SCHEMA_VERSION = 1
BUSY_TIMEOUT = 1.0  # seconds; see the module docstring

_TABLES = {
    "models": "name TEXT PRIMARY KEY, deleted INTEGER NOT NULL, spec TEXT NOT NULL",
    "versions": (
        "model TEXT NOT NULL, version INTEGER NOT NULL, spec TEXT NOT NULL, server TEXT,"
        " instance_count INTEGER, state TEXT NOT NULL, reason TEXT NOT NULL, available INTEGER NOT NULL,"
        " unavailable INTEGER NOT NULL, draining INTEGER NOT NULL, timestamp REAL,"
        " PRIMARY KEY (model, version)"
    ),
    "replicas": (
        "model TEXT NOT NULL, version INTEGER NOT NULL, idx INTEGER NOT NULL, state TEXT NOT NULL,"
        " reason TEXT NOT NULL, timestamp REAL NOT NULL, PRIMARY KEY (model, version, idx)"
    ),
    "server_replicas": (
        "server TEXT NOT NULL, idx INTEGER NOT NULL, inference_url TEXT NOT NULL, memory INTEGER NOT NULL,"
        " capabilities TEXT NOT NULL, over_commit_percentage INTEGER NOT NULL, shared INTEGER NOT NULL,"
        " PRIMARY KEY (server, idx)"
    ),
    # Schema 1: the highest version number each model name has had, kept when the model is
    # forgotten, so that a model created again never reuses a version an agent may still hold.
    "version_marks": "name TEXT PRIMARY KEY, version INTEGER NOT NULL",
}
_V0_TABLES = ("models", "versions", "replicas", "server_replicas")


class Store:
    """The scheduler's SQLite database at `path` (a file, created if missing, or ":memory:").

    An unusable path (a missing folder, a directory, not a database) raises ConfigError naming it."""

    def __init__(self, path: str | Path = MEMORY) -> None:
        self.path = str(path)
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT
            )
            try:
                if self.path != MEMORY:
                    self._db.execute("PRAGMA journal_mode=WAL")
                    self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
                self._migrate()
            except BaseException:
                self._db.close()
                raise
        except sqlite3.Error as exc:
            raise self._error(f"cannot use it as the scheduler database: {exc}") from None

    def _error(self, problem: str) -> ConfigError:
        return ConfigError(f"--db {self.path}", [problem])

    def _migrate(self) -> None:
        """Create the schema, upgrade a version-0 database, or refuse one this code cannot read."""
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise self._error(
                f"its schema version {version} is newer than this modelyard reads ({SCHEMA_VERSION});"
                " run a newer modelyard, or use another --db"
            )
        found = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table in sorted(found & set(_TABLES)):
            self._check_columns(table)
        needed = _TABLES if version == SCHEMA_VERSION else _V0_TABLES if found else ()
        if missing := [t for t in needed if t not in found]:
            raise self._error(
                f"not a modelyard scheduler database (schema version {version}, no table"
                f" {', '.join(missing)})"
            )
        if version == SCHEMA_VERSION:
            return
        # Version 0 (or a new file): create what is missing; a version-0 database's marks are its
        # models' highest versions (the names it forgot are not known any more).
        tables = "".join(f"CREATE TABLE IF NOT EXISTS {t} ({c});\n" for t, c in _TABLES.items())
        db.executescript(
            f"BEGIN IMMEDIATE;\n{tables}"
            "INSERT OR IGNORE INTO version_marks SELECT model, MAX(version) FROM versions GROUP BY model;\n"
            f"PRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;"
        )

    def _check_columns(self, table: str) -> None:
        want = [column.split()[0] for column in _TABLES[table].split(", PRIMARY KEY")[0].split(",")]
        have = [row[1] for row in self._db.execute(f"PRAGMA table_info({table})")]
        if have != want:
            raise self._error(
                f"not a modelyard scheduler database of a known schema: table {table} has columns"
                f" {', '.join(have)}; expected {', '.join(want)}"
            )

    def close(self) -> None:
        self._db.close()

    def load(self) -> StoredState:
        """Every model (by name) with its versions and replicas, every known server replica, and every
        name's version mark. A row it cannot read raises ConfigError naming the file."""
        try:
            return self._load()
        except (sqlite3.Error, ValueError) as exc:  # orjson's JSONDecodeError is a ValueError
            raise self._error(f"cannot read the stored state: {exc}") from None

    def _load(self) -> StoredState:
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
        marks = tuple(db.execute("SELECT name, version FROM version_marks ORDER BY name"))
        return StoredState(models, servers, marks)

    def write(self, batch: StoreWrite) -> None:
        """Apply `batch` in one transaction (nothing of it is stored if any part fails). Writing a
        model raises its name's version mark to its highest version. A database error (locked, disk
        full, read-only) raises StoreWriteFailed."""
        if not batch:
            return
        try:
            self._write(batch)
        except sqlite3.Error as exc:
            raise StoreWriteFailed(f"cannot write the scheduler database {self.path}: {exc}") from None

    def _write(self, batch: StoreWrite) -> None:
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
                cur.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT leaves it open: the next write needs it closed
                    cur.execute("ROLLBACK")
                raise


def _forget_model(cur: sqlite3.Cursor, name: str) -> None:
    for table, column in (("replicas", "model"), ("versions", "model"), ("models", "name")):
        cur.execute(f"DELETE FROM {table} WHERE {column} = ?", (name,))


def _insert_model(cur: sqlite3.Cursor, model: StoredModel) -> None:
    cur.execute("INSERT INTO models VALUES (?, ?, ?)", (model.name, int(model.deleted), _json(model.spec)))
    if model.versions:
        cur.execute(
            "INSERT INTO version_marks VALUES (?, ?)"
            " ON CONFLICT (name) DO UPDATE SET version = MAX(version, excluded.version)",
            (model.name, max(v.version for v in model.versions)),
        )
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
