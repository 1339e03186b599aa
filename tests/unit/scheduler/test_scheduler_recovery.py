"""Reconnects, restarts, store failures, deletions that cannot finish, version numbering and
history: the cases a review found, each driven step by step through the harness."""

from __future__ import annotations

import itertools
import sqlite3
import time
from pathlib import Path

import pytest
from scheduler_harness import Harness, spec

from modelyard.errors import ConfigError, StoreWriteFailed
from modelyard.placement import ModelSpec
from modelyard.scheduler import AgentEventKind, LoadedVersion
from modelyard.scheduler.connections import MAX_BACKOFF
from modelyard.store import Store, StoreWrite


class FlakyStore(Store):
    """A store whose writes fail while `failing` is set."""

    failing = False

    def write(self, batch: StoreWrite) -> None:
        if self.failing:
            raise StoreWriteFailed("cannot write the scheduler database: database is locked")
        super().write(batch)


def test_a_model_an_agent_brings_back_after_it_moved_is_placed_so_the_extra_copy_unloads() -> None:
    h = Harness()
    h.connect(index=0)
    h.connect(index=1)
    h.state.apply(spec(memory=100), 1.0)
    h.answer()
    assert h.replicas("iris") == {0: "Available"}
    h.state.disconnect("mlserver", 0, 3.0)  # a network glitch: the model moves to replica 1
    h.answer(now=4.0)
    assert h.replicas("iris") == {1: "Available"}
    h.connect(index=0, loaded=(LoadedVersion("iris", 1),), now=5.0)  # it still holds it
    assert [(op.kind.value, op.index) for op in h.sent] == [("unload", 1)]  # one is wanted: one goes
    assert h.model_state("iris") == "ModelAvailable"
    h.answer(now=6.0)
    assert h.replicas("iris") == {0: "Available", 1: "Unloaded"}


def test_after_a_restart_an_unload_decided_during_the_resync_is_sent(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    h = Harness(Store(db))
    h.connect("a")
    h.state.apply(spec(server="a"), 1.0)
    h.answer()
    h.connect("b")
    h.state.apply(spec(server="b"), 3.0)  # a new version on b; v1 on a serves meanwhile
    assert h.take() == [("load", "b", 0, "iris", 2)]
    h.store.close()

    again = Harness(Store(db))
    again.connect("b", loaded=(LoadedVersion("iris", 2),), now=10.0)  # v2 available: v1 must go
    assert again.take() == []  # a's agent is not back yet
    again.connect("a", loaded=(LoadedVersion("iris", 1),), now=11.0)
    assert again.state.ready
    assert again.take() == [("unload", "a", 0, "iris", 1)]


def test_a_failed_store_write_keeps_the_change_and_sends_nothing_until_it_is_written(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    store = FlakyStore(db)
    h = Harness(store)
    h.connect()
    store.failing = True
    lines = len(h.lines)
    with pytest.raises(StoreWriteFailed, match="database is locked"):
        h.state.apply(spec(), 1.0)
    assert h.take() == [] and len(h.lines) == lines  # neither the agent nor the feed was told
    assert h.replicas("iris") == {0: "Loading"}  # in memory, waiting to be written
    with pytest.raises(StoreWriteFailed):
        h.state.retry(2.0)  # still failing: still kept
    store.failing = False
    h.state.retry(3.0)  # the timer writes it, then sends
    assert h.take() == [("load", "mlserver", 0, "iris", 1)]
    assert h.lines[-1]["name"] == "iris"
    store.close()
    assert [m.name for m in Store(db).load().models] == ["iris"]


def test_an_operation_overtaken_before_its_write_succeeded_is_not_sent() -> None:
    store = FlakyStore()
    h = Harness(store)
    h.connect()
    store.failing = True
    with pytest.raises(StoreWriteFailed):
        h.state.apply(spec(), 1.0)
    with pytest.raises(StoreWriteFailed):
        h.state.apply(spec(replicas=0), 2.0)  # scaled to zero: the queued LOAD is stale
    store.failing = False
    h.state.retry(3.0)
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]


def test_a_locked_database_fails_the_write_fast(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = Store(db)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    started = time.monotonic()
    with pytest.raises(StoreWriteFailed, match="locked"):
        store.write(StoreWrite(forget_models=["x"]))
    assert time.monotonic() - started < 3.0  # SQLite's default would block the loop for 5 s
    other.execute("ROLLBACK")
    store.write(StoreWrite(forget_models=["x"]))  # the store is usable again


def test_a_deleted_model_whose_unload_keeps_failing_is_terminate_failed_and_retried_by_the_timer() -> None:
    h = Harness()
    h.connect()
    h.state.apply(spec(), 1.0)
    h.answer()
    h.state.delete("iris", 2.0)
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.UNLOAD_FAILED, message="refused", now=3.0)
    assert h.take() == []  # no loop through the agent
    model = h.state.model("iris")  # not forgotten: it may still be loaded
    assert (model.latest.status.state.value, model.latest.status.reason) == (
        "ModelTerminateFailed",
        "refused",
    )
    h.state.retry(13.0)  # the timer tries again
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.UNLOADED, now=14.0)
    assert "iris" not in h.state.models


def test_a_deleted_models_failed_unload_is_done_when_the_agent_reconnects_without_it() -> None:
    h = Harness()
    h.connect()
    h.state.apply(spec(), 1.0)
    h.answer()
    h.state.delete("iris", 2.0)
    h.answer(now=3.0, fail="refused")
    h.connect(now=4.0)  # reports nothing: the model is gone
    assert "iris" not in h.state.models


def test_a_model_created_again_never_reuses_a_version_a_stale_agent_holds(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    h = Harness(Store(db))
    h.connect()
    h.state.apply(ModelSpec(name="iris", storage_uri="file:///old"), 1.0)
    h.answer()
    h.state.disconnect("mlserver", 0, 2.0)  # partitioned: its agent still holds iris v1
    h.state.delete("iris", 3.0)
    assert "iris" not in h.state.models
    h.store.close()

    again = Harness(Store(db))  # across a restart too
    again.state.finish_resync(4.0)
    again.state.apply(ModelSpec(name="iris", storage_uri="file:///new"), 5.0)
    assert again.state.model("iris").latest.version == 2
    again.connect(loaded=(LoadedVersion("iris", 1),), now=6.0)  # the partition heals
    assert again.take() == [("unload", "mlserver", 0, "iris", 1), ("load", "mlserver", 0, "iris", 2)]
    assert again.replicas("iris") == {0: "Loading"}


def test_retired_versions_are_pruned_so_history_stays_bounded(tmp_path: Path) -> None:
    h = Harness(Store(tmp_path / "s.db"))
    h.connect("a")
    h.connect("b")
    h.state.apply(spec(), 1.0)
    h.answer()
    for flap in range(30):  # each loss of the hosting replica is a server move: a new version
        server = h.state.model("iris").latest.server
        assert server is not None
        h.state.disconnect(server, 0, 2.0 + flap)
        h.answer(now=2.0 + flap)
        h.connect(server, now=2.0 + flap)
        h.answer(now=2.0 + flap)
    model = h.state.model("iris")
    assert model.latest.version == 31 and len(model.versions) <= 2
    assert len(h.store.load().models[0].versions) == len(model.versions)
    for n in range(10):  # re-versioning: each rollout retires the previous version
        h.state.apply(spec(parameters={"n": str(n)}), 40.0)
        h.answer(now=40.0)
        h.answer(now=40.0)
    assert len(h.state.model("iris").versions) == 1


def test_an_unreadable_stored_model_is_a_config_error_naming_the_database(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    h = Harness(Store(db))
    h.connect()
    h.state.apply(spec(), 1.0)
    h.store.close()
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE replicas SET state = 'Bogus'")
    with pytest.raises(ConfigError, match=r"--db .*s\.db.*'iris'.*Bogus"):
        Harness(Store(db))
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE replicas SET state = 'Loading'")
        raw.execute("""UPDATE models SET spec = '{"name": "Iris Bad", "storage_uri": "x"}'""")
    with pytest.raises(ConfigError, match="cannot read stored model 'iris': name: "):
        Harness(Store(db))


def test_a_model_whose_load_keeps_failing_is_retried_with_backoff() -> None:
    h = Harness()
    h.connect()
    h.state.apply(spec(), 0.0)
    h.answer(now=0.0, fail="no such file")
    retried = []
    for tick in range(1, 200):  # the timer, every 10 s
        h.state.retry(tick * 10.0)
        if h.sent:
            retried.append(tick * 10)
            h.answer(now=tick * 10.0, fail="no such file")
    assert retried[:5] == [10, 20, 40, 80, 160]
    gaps = [b - a for a, b in itertools.pairwise(retried)]
    assert max(gaps) == MAX_BACKOFF
    h.state.apply(spec(), 2000.0)  # applied again: retried at once
    assert h.take() == [("load", "mlserver", 0, "iris", 1)]
