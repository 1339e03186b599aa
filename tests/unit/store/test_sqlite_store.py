from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from modelyard.errors import ConfigError
from modelyard.store import (
    SCHEMA_VERSION,
    Store,
    StoredModel,
    StoredReplica,
    StoredServerReplica,
    StoredState,
    StoredStatus,
    StoredVersion,
    StoreWrite,
)

SPEC = {"name": "iris", "storage_uri": "file:///m", "memory": 10, "replicas": 1}


def _model(name: str = "iris", *, deleted: bool = False, state: str = "Available") -> StoredModel:
    version = StoredVersion(
        1,
        {**SPEC, "name": name},
        StoredStatus("ModelAvailable", "", 1, 0, 0, 5.0),
        server="mlserver",
        instance_count=2,
        replicas=(StoredReplica(0, state, "", 5.0), StoredReplica(1, "LoadFailed", "boom", 4.0)),
    )
    return StoredModel(name, {**SPEC, "name": name}, deleted, (version,))


REPLICA = StoredServerReplica("mlserver", 0, "http://127.0.0.1:1", 100, ("sklearn", "xgboost"), 10, False)


def test_empty_store_loads_nothing() -> None:
    assert Store().load() == StoredState()


def test_round_trip_in_memory() -> None:
    store = Store()
    store.write(StoreWrite(models=[_model()], server_replicas=[REPLICA]))
    assert store.load() == StoredState((_model(),), (REPLICA,), (("iris", 1),))


def test_a_model_write_replaces_the_stored_one_whole() -> None:
    store = Store()
    store.write(StoreWrite(models=[_model()]))
    later = StoredModel("iris", SPEC, True, ())
    store.write(StoreWrite(models=[later]))
    assert store.load().models == (later,)


def test_forget_models_and_server_replicas() -> None:
    store = Store()
    store.write(StoreWrite(models=[_model("a"), _model("b")], server_replicas=[REPLICA]))
    store.write(StoreWrite(forget_models=["a"], forget_server_replicas=[("mlserver", 0)]))
    state = store.load()
    assert [m.name for m in state.models] == ["b"]
    assert state.server_replicas == ()


def test_a_file_database_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = Store(path)
    store.write(StoreWrite(models=[_model()], server_replicas=[REPLICA]))
    store.close()
    reopened = Store(path)
    assert reopened.load() == StoredState((_model(),), (REPLICA,), (("iris", 1),))
    reopened.close()


def test_a_failed_batch_stores_nothing() -> None:
    store = Store()
    bad = StoredModel("x", {"a": object()}, False, ())  # not JSON: fails after the first model
    with pytest.raises(TypeError):
        store.write(StoreWrite(models=[_model(), bad]))
    assert store.load() == StoredState()


def test_empty_batch_is_falsy_and_a_no_op() -> None:
    assert not StoreWrite()
    Store().write(StoreWrite())


@pytest.mark.parametrize("name", ["missing/dir/s.db", "."])
def test_unusable_path_is_a_config_error_naming_it(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="--db"):
        Store(tmp_path / name)


def test_a_forgotten_models_version_mark_is_kept() -> None:
    store = Store()
    store.write(StoreWrite(models=[_model()]))
    store.write(StoreWrite(forget_models=["iris"]))
    assert store.load() == StoredState((), (), (("iris", 1),))


def _raw(path: Path, *statements: str) -> None:
    db = sqlite3.connect(path)
    for statement in statements:
        db.execute(statement)
    db.commit()
    db.close()


def test_a_version_0_database_is_upgraded_with_its_models_marks(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = Store(path)
    store.write(StoreWrite(models=[_model()], server_replicas=[REPLICA]))
    store.close()
    _raw(path, "DROP TABLE version_marks", "PRAGMA user_version = 0")  # as written before schema 1
    upgraded = Store(path)
    assert upgraded.load() == StoredState((_model(),), (REPLICA,), (("iris", 1),))
    upgraded.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


@pytest.mark.parametrize(
    ("statements", "message"),
    [
        (["PRAGMA user_version = 99"], "schema version 99 is newer than this modelyard reads"),
        (["CREATE TABLE models (name TEXT PRIMARY KEY, spec TEXT)"], "table models has columns name, spec"),
        (["CREATE TABLE notes (x TEXT)"], "not a modelyard scheduler database"),
    ],
)
def test_a_database_of_another_schema_is_refused_clearly(
    tmp_path: Path, statements: list[str], message: str
) -> None:
    path = tmp_path / "s.db"
    _raw(path, *statements)
    with pytest.raises(ConfigError, match=f"--db {path}.*{message}"):
        Store(path)


def test_an_unreadable_row_is_a_config_error_naming_the_database(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = Store(path)
    store.write(StoreWrite(models=[_model()]))
    _raw(path, "UPDATE models SET spec = 'not json'")
    with pytest.raises(ConfigError, match=f"--db {path}: cannot read the stored state"):
        store.load()
