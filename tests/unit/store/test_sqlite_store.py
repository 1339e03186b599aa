from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.errors import ConfigError
from modelyard.store import (
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
    assert store.load() == StoredState((_model(),), (REPLICA,))


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
    assert reopened.load() == StoredState((_model(),), (REPLICA,))
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
