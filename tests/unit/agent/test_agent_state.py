"""LocalState: memory accounting with overcommit (Seldon's table, compat §7.5) and the LRU order."""

from __future__ import annotations

import pytest

from modelyard.agent import LocalState, ModelStatus


@pytest.mark.parametrize(
    ("capacity", "percent", "models", "size", "reported"),
    [
        (30, 0, 10, 2, 10),
        (20, 10, 10, 1, 12),
        (10, 0, 10, 1, 0),
        (10, 10, 10, 1, 1),
        (16, 50, 10, 2, 4),
        (8, 0, 10, 1, 0),
    ],
)
def test_available_memory_follows_seldons_table(capacity, percent, models, size, reported):
    state = LocalState(capacity, percent)
    for i in range(models):
        state.begin_load(f"m{i}", 1, size, now=float(i), stamp=i)
        state.loaded_ok(f"m{i}", 1, now=float(i))
    assert state.available_bytes == reported


def test_loading_models_reserve_memory_and_forget_releases_it():
    state = LocalState(1000)
    state.begin_load("a", 1, 300, now=0.0, stamp=1)
    assert state.available_bytes == 700
    assert state.loaded() == []  # not reported to the scheduler until loaded
    state.loaded_ok("a", 1, now=1.0, instance_count=2)
    assert [(m.name, m.version, m.instance_count) for m in state.loaded()] == [("a", 1, 2)]
    assert state.forget("a") is not None
    assert state.available_bytes == 1000
    assert state.get("a") is None


def test_a_new_version_replaces_the_old_one_under_the_same_name():
    state = LocalState(1000)
    state.begin_load("iris", 1, 400, now=0.0, stamp=1)
    state.loaded_ok("iris", 1, now=0.0)
    replaced = state.begin_load("iris", 2, 100, now=1.0, stamp=2)
    assert replaced is not None and replaced.version == 1
    assert state.holds("iris", 2) and not state.holds("iris", 1)
    assert state.registered_bytes == 100  # the old version no longer counts
    assert state.begin_load("iris", 2, 100, now=2.0, stamp=3) is None  # same version: nothing replaced


def test_unload_failed_keeps_the_model_counted():
    state = LocalState(1000)
    state.begin_load("a", 1, 300, now=0.0, stamp=1)
    state.loaded_ok("a", 1, now=0.0)
    state.begin_unload("a", 1)
    assert state.get("a").status is ModelStatus.UNLOADING
    state.unload_failed("a", 1)
    assert state.get("a").status is ModelStatus.LOADED
    assert state.available_bytes == 700


def test_changes_to_a_version_not_held_raise():
    state = LocalState(1000)
    state.begin_load("a", 2, 1, now=0.0, stamp=1)
    with pytest.raises(KeyError):
        state.loaded_ok("a", 1, now=0.0)


def test_too_large_names_both_sizes_and_overcommit_does_not_help():
    state = LocalState(1000, overcommit_percent=100)
    assert state.too_large(1000) == ""
    reason = state.too_large(2000)
    assert "2000" in reason and "1000" in reason


def test_lru_order_is_least_recently_used_first_and_touch_moves_a_model_back():
    state = LocalState(1000)
    for t, name in enumerate(["a", "b", "c"]):
        state.begin_load(name, 1, 1, now=float(t), stamp=t)
        state.loaded_ok(name, 1, now=float(t))
    state.begin_load("loading", 1, 1, now=0.0, stamp=9)  # not in memory yet: never a victim
    assert state.lru_order() == ["a", "b", "c"]
    state.touch("a", now=10.0)
    assert state.lru_order() == ["b", "c", "a"]
    state.touch("b", now=-1.0)  # a stale timestamp never moves a model forward
    assert state.lru_order() == ["b", "c", "a"]


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError):
        LocalState(-1)


def test_a_replace_waiting_for_room_keeps_the_old_versions_bytes_counted():
    state = LocalState(1000, 100)
    state.begin_load("x", 1, 500, now=0.0, stamp=1)
    state.reserve("x")
    state.loaded_ok("x", 1, now=0.0)
    state.begin_load("x", 2, 600, now=1.0, stamp=2)  # waits for room; the server still holds v1
    assert state.resident_bytes == 500
    state.reserve("x")
    assert state.resident_bytes == 600  # v2's own bytes from now on
