"""SchedulerState driven step by step: the fake agents answer only when the test says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_harness import Harness, spec

from modelyard.errors import Conflict, ModelBeingDeleted, ModelNotFound, NotFound
from modelyard.scheduler import AgentEventKind, LoadedVersion
from modelyard.store import Store


def placed(h: Harness, name: str = "iris", **fields: object) -> None:
    h.state.apply(spec(name, **fields), 1.0)  # type: ignore[arg-type]
    h.answer()


def test_created_model_is_loaded_then_available_and_published() -> None:
    h = Harness()
    h.connect()
    model, change = h.state.apply(spec(memory=100), 1.0)
    assert change == "created" and model.latest.version == 1
    assert h.take() == [("load", "mlserver", 0, "iris", 1)]
    assert h.replicas("iris") == {0: "Loading"}
    assert h.model_state("iris") == "ModelProgressing"
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.LOADED, now=2.0)
    assert h.replicas("iris") == {0: "Available"}  # the feed publish is the route update
    assert h.model_state("iris") == "ModelAvailable"
    assert h.endpoints("iris") == ["mlserver-0"]
    assert h.lines[-1]["state"] == "ModelAvailable"


def test_the_feed_says_how_many_replicas_are_ready_of_those_desired() -> None:
    h = Harness()
    h.state.apply(spec(replicas=1), 1.0)  # no server yet: nowhere to go
    failed = h.lines[-1]
    assert (failed["state"], failed["available_replicas"], failed["unavailable_replicas"]) == (
        "ScheduleFailed",
        0,
        1,
    )
    assert failed["reason"].startswith("Failed to schedule") and failed["endpoints"] == []
    h.connect()
    h.answer()
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.LOADED, now=2.0)
    available = h.lines[-1]
    assert (available["state"], available["available_replicas"], available["unavailable_replicas"]) == (
        "ModelAvailable",
        1,
        0,
    )


@pytest.mark.parametrize(
    ("second", "change", "version"),
    [
        ({}, "unchanged", 1),
        ({"replicas": 2}, "scaling", 1),
        ({"memory": 5}, "new_version", 2),
        ({"requirements": ["x"]}, "new_version", 2),
    ],
)
def test_apply_again(second: dict[str, object], change: str, version: int) -> None:
    h = Harness()
    h.connect(index=0)
    h.connect(index=1)
    placed(h)
    model, got = h.state.apply(spec(**second), 3.0)  # type: ignore[arg-type]
    assert got == change and model.latest.version == version


def test_scaling_in_place_loads_one_more_replica() -> None:
    h = Harness()
    h.connect(index=0)
    h.connect(index=1)
    placed(h)
    h.state.apply(spec(replicas=2), 3.0)
    assert h.take() == [("load", "mlserver", 1, "iris", 1)]
    h.connect(index=1)  # (re-subscribe changes nothing for a Loading replica it does not hold yet)


def test_new_version_rolls_out_then_the_cleaner_unloads_the_old_one() -> None:
    h = Harness()
    h.connect(index=0)
    h.connect(index=1)
    placed(h)
    h.state.apply(spec(memory=1), 3.0)
    assert [(op.kind.value, op.version) for op in h.sent] == [("load", 2)]
    assert h.replicas("iris", 1) == {0: "Available"}  # the old version keeps serving
    h.answer(now=4.0)
    assert h.model_state("iris") == "ModelAvailable"
    assert h.replicas("iris", 1) == {0: "Unloading"}
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]


def test_delete_then_409_while_unloading_then_forgotten_and_created_again() -> None:
    h = Harness()
    h.connect()
    placed(h)
    model = h.state.delete("iris", 3.0)
    assert model.deleted and model.latest.status.state.value == "ModelTerminating"
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]
    assert h.endpoints("iris") == []
    with pytest.raises(ModelBeingDeleted):
        h.state.apply(spec(), 3.5)
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.UNLOADED, now=4.0)
    assert h.lines[-1] == {"type": "removed", "name": "iris"}
    with pytest.raises(ModelNotFound):
        h.state.model("iris")
    _, change = h.state.apply(spec(), 5.0)
    assert change == "created" and h.state.model("iris").latest.version == 2  # never reused


def test_a_model_never_placed_is_forgotten_at_once_on_delete() -> None:
    h = Harness()
    h.state.apply(spec(), 1.0)
    assert h.model_state("iris") == "ScheduleFailed"
    h.state.delete("iris", 2.0)
    assert "iris" not in h.state.models


def test_events_are_compare_and_set() -> None:
    h = Harness()
    h.connect()
    h.state.apply(spec(), 1.0)
    with pytest.raises(Conflict, match="expects Unloading but it is Loading"):
        h.state.event("mlserver", 0, "iris", 1, AgentEventKind.UNLOADED, now=2.0)
    with pytest.raises(Conflict, match="not placed"):
        h.state.event("mlserver", 0, "iris", 7, AgentEventKind.LOADED, now=2.0)
    with pytest.raises(NotFound):
        h.state.event("other", 0, "iris", 1, AgentEventKind.LOADED, now=2.0)
    assert h.replicas("iris") == {0: "Loading"}
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.LOADED, now=2.0)
    h.state.event("mlserver", 0, "iris", 1, AgentEventKind.LOADED, now=2.0)  # repeated: no-op
    assert h.replicas("iris") == {0: "Available"}


def test_load_failed_event_fails_the_model_with_the_reason() -> None:
    h = Harness()
    h.connect()
    h.state.apply(spec(), 1.0)
    h.answer(fail="no such file")
    assert h.model_state("iris") == "ModelFailed"
    assert h.state.model("iris").latest.status.reason == "no such file"


def test_a_send_failure_is_load_failed_with_the_reason() -> None:
    h = Harness()
    h.connect()
    h.send_error = "queue full"
    h.state.apply(spec(), 1.0)
    assert h.replicas("iris") == {0: "LoadFailed"}
    assert h.state.model("iris").latest.status.reason == "queue full"


def test_agent_loss_replaces_on_another_replica_and_drops_the_endpoint_at_once() -> None:
    h = Harness()
    h.connect(index=0)
    placed(h)
    h.connect(index=1)
    h.state.disconnect("mlserver", 0, 3.0)
    assert h.endpoints("iris") == []
    assert [(op.index, op.version) for op in h.sent] == [(1, 1)]
    h.answer()
    assert h.endpoints("iris") == ["mlserver-1"]


def test_agent_loss_moving_to_another_server_makes_a_new_version() -> None:
    h = Harness()
    h.connect("a")
    placed(h)
    h.connect("b")
    h.state.disconnect("a", 0, 3.0)
    assert h.take() == [("load", "b", 0, "iris", 2)]
    assert "a" not in h.state.servers  # the last replica takes the server with it


def test_agent_loss_of_an_old_version_unloads_and_prunes_it() -> None:
    h = Harness()
    h.connect(index=0)
    placed(h)
    h.state.apply(spec(memory=1), 2.0)  # v2 placed on replica 0 as well (most free memory)
    h.connect(index=1)
    h.state.disconnect("mlserver", 0, 3.0)
    # v1 was Unloaded (REMOVED_WITH_REPLICA) and, a retired version holding nothing, pruned
    assert [v.version for v in h.state.model("iris").versions] == [2]
    assert [v.version for v in h.store.load().models[0].versions] == [2]
    assert h.replicas("iris") == {1: "Loading"}


def test_retry_timer_places_a_schedule_failed_model_once_memory_frees() -> None:
    h = Harness()
    h.connect(memory=1000)
    h.state.apply(spec("big", memory=800), 1.0)
    h.state.apply(spec("small", memory=500), 1.0)
    assert h.model_state("small") == "ScheduleFailed"  # big's load reserves 800
    h.state.retry(2.0)
    assert h.model_state("small") == "ScheduleFailed"
    h.state.apply(spec("big", memory=800, replicas=0), 2.5)  # frees it, retries nothing else
    assert h.model_state("small") == "ScheduleFailed"
    h.sent.clear()
    h.state.retry(3.0)  # the timer
    assert h.take() == [("load", "mlserver", 0, "small", 1)]


def test_a_server_joining_places_schedule_failed_models() -> None:
    h = Harness()
    h.state.apply(spec(), 1.0)
    assert h.model_state("iris") == "ScheduleFailed"
    assert h.state.model("iris").latest.status.reason.startswith("Failed to schedule")
    h.connect()
    assert h.take() == [("load", "mlserver", 0, "iris", 1)]


def test_reservations_are_summed_from_states_and_never_leak() -> None:
    h = Harness()
    h.connect(memory=1000)
    h.state.apply(spec("a", memory=600), 1.0)
    assert h.reserved() == {("mlserver", 0): 600}
    h.state.apply(spec("b", memory=600), 1.0)
    assert h.model_state("b") == "ScheduleFailed"
    h.state.apply(spec("a", memory=600, replicas=0), 2.0)  # scaled to zero while loading
    assert h.reserved() == {("mlserver", 0): 0}
    h.sent.clear()
    h.state.retry(3.0)
    assert [(op.model, op.kind.value) for op in h.sent] == [("b", "load")]
    h.answer(fail="boom")
    assert h.reserved() == {("mlserver", 0): 0}


def test_drain_moves_models_and_waits_for_them() -> None:
    h = Harness()
    h.connect(index=0)
    placed(h)
    h.connect(index=1)
    names = h.state.drain("mlserver", 0, 3.0)
    assert names == {"iris"}
    assert h.replicas("iris") == {0: "Draining", 1: "Loading"}
    assert not h.state.drained(names)
    assert h.endpoints("iris") == ["mlserver-0"]  # draining replicas serve until the new one does
    h.answer()
    assert h.state.drained(names)
    assert h.endpoints("iris") == ["mlserver-1"]
    with pytest.raises(NotFound):
        h.state.drain("mlserver", 9, 3.0)


def test_drain_answers_at_once_for_a_model_that_cannot_move() -> None:
    h = Harness()
    h.connect()
    placed(h)
    names = h.state.drain("mlserver", 0, 3.0)
    assert h.model_state("iris") == "ScheduleFailed"
    assert h.state.drained(names)


def test_drain_waits_for_the_same_models_when_asked_again() -> None:
    h = Harness()
    h.connect(index=0)
    placed(h)
    h.connect(index=1)
    names = h.state.drain("mlserver", 0, 3.0)
    assert h.state.drain("mlserver", 0, 3.5) == names == {"iris"}  # the agent retried
    assert not h.state.drained(names)
    h.answer()
    assert h.state.drained(names)
    # Once the agent goes, its Draining entry goes with it (rule 16).
    h.state.disconnect("mlserver", 0, 4.0)
    assert h.replicas("iris") == {1: "Available"}
    assert h.model_state("iris") == "ModelAvailable"


def test_drain_places_a_load_on_its_way_elsewhere_and_does_not_route_to_it() -> None:
    h = Harness()
    h.connect(index=0)
    h.state.apply(spec(), 1.0)  # loading on 0, no answer yet
    h.sent.clear()
    h.connect(index=1)
    names = h.state.drain("mlserver", 0, 3.0)
    assert names == {"iris"}
    # Not Draining: a Draining entry would be routed to, and this one serves nothing yet.
    assert h.replicas("iris") == {0: "Unloading", 1: "Loading"}
    assert h.endpoints("iris") == []
    assert not h.state.drained(names)
    h.answer()
    assert h.replicas("iris") == {0: "Unloaded", 1: "Available"}
    assert h.state.drained(names)


def test_drain_of_a_model_on_both_replicas_answers_at_once_and_routes_to_the_other() -> None:
    h = Harness()
    h.connect(index=0)
    h.connect(index=1)
    placed(h, replicas=2, min_replicas=1)
    names = h.state.drain("mlserver", 1, 3.0)
    assert h.replicas("iris") == {0: "Available", 1: "Draining"}
    assert h.state.drained(names)
    assert h.endpoints("iris") == ["mlserver-0"]  # the Draining replica is dropped at once
    assert h.take() == []


def test_drained_does_not_count_a_replica_that_is_draining_too() -> None:
    h = Harness()
    h.connect(index=0)
    placed(h)
    h.connect(index=1)
    names = h.state.drain("mlserver", 0, 3.0)
    h.answer()
    assert h.state.drained(names)
    h.state.drain("mlserver", 1, 4.0)  # both go: nowhere left to serve
    assert h.model_state("iris") == "ScheduleFailed"
    assert h.endpoints("iris") == ["mlserver-0", "mlserver-1"]  # the Draining ones serve meanwhile
    assert h.state.drained(names)


def test_restart_restores_state_waits_for_replicas_and_reloads_nothing(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    h = Harness(Store(db))
    h.connect(index=0)
    h.connect(index=1)
    placed(h)
    placed(h, "other")
    h.store.close()

    again = Harness(Store(db))
    state = again.state
    assert not state.ready and state.awaiting == {("mlserver", 0), ("mlserver", 1)}
    snapshot = {e["name"]: [p["name"] for p in e["endpoints"]] for e in state.feed_snapshot()}
    assert snapshot == {"iris": ["mlserver-0"], "other": ["mlserver-0"]}  # served before any agent is back
    again.connect(index=0, loaded=(LoadedVersion("iris", 1), LoadedVersion("other", 1)))
    assert not state.ready and again.take() == []
    again.connect(index=1)
    assert state.ready
    assert again.take() == []  # nothing loaded again
    assert again.model_state("iris") == "ModelAvailable" and again.replicas("iris") == {0: "Available"}


def test_resync_timeout_removes_missing_replicas_and_places_their_models(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    h = Harness(Store(db))
    h.connect(index=0)
    placed(h)
    h.store.close()
    again = Harness(Store(db))
    again.connect(index=1)
    assert not again.state.ready
    again.state.finish_resync(5.0)
    assert again.state.ready
    assert again.take() == [("load", "mlserver", 1, "iris", 1)]
    assert Store(db).load().server_replicas[0].index == 1


def test_a_reconnecting_agent_that_lost_a_model_has_it_placed_again() -> None:
    h = Harness()
    h.connect()
    placed(h)
    h.connect()  # reports nothing: it lost the model
    assert h.take() == [("load", "mlserver", 0, "iris", 1)]


def test_an_unknown_reported_model_is_unloaded() -> None:
    h = Harness()
    h.connect(loaded=(LoadedVersion("ghost", 3),))
    assert h.take() == [("unload", "mlserver", 0, "ghost", 3)]
    assert "ghost" not in h.state.models


def test_every_mutation_is_persisted() -> None:
    h = Harness()
    h.connect()
    placed(h)
    stored = h.store.load()
    assert [m.name for m in stored.models] == ["iris"]
    assert stored.models[0].versions[0].replicas[0].state == "Available"
    assert stored.server_replicas[0].inference_url == "http://mlserver-0.test"
