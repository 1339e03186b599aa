"""The feed entry during a rollout (compat §6.2): both versions with their shares while both serve."""

from __future__ import annotations

from scheduler_harness import Harness, spec

from modelyard.placement import ModelSpec
from modelyard.scheduler import AgentEventKind


def _entry(h: Harness, name: str = "iris") -> dict:
    return [line for line in h.lines if line.get("name") == name and line["type"] == "model"][-1]


def _shares(entry: dict) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
    return (
        [(v["version"], v["weight"]) for v in entry["versions"]],
        [(e["name"], e["version"]) for e in entry["endpoints"]],
    )


def _v2(**fields) -> ModelSpec:
    return spec(**fields).model_copy(update={"storage_uri": "file:///models/iris-v2"})


def test_a_new_version_on_other_replicas_splits_until_it_is_available_then_the_old_unloads():
    h = Harness()
    for index in range(3):
        h.connect(index=index)
    h.state.apply(spec(memory=100), 1.0)
    h.answer()
    assert _shares(_entry(h)) == ([(1, 100)], [("mlserver-0", 1)])

    h.state.apply(_v2(memory=100), 2.0)
    assert h.take() == [("load", "mlserver", 1, "iris", 2)]  # not over the old version
    h.state.event("mlserver", 1, "iris", 2, kind=AgentEventKind.LOADED, now=3.0)
    split, single = [_shares(line) for line in h.lines[-2:]]
    assert split == ([(1, 50), (2, 50)], [("mlserver-0", 1), ("mlserver-1", 2)])
    assert single == ([(2, 100)], [("mlserver-1", 2)])
    assert h.take() == [("unload", "mlserver", 0, "iris", 1)]


def test_two_replicas_replaced_one_at_a_time_split_by_routable_replicas():
    h = Harness()
    for index in range(2):
        h.connect(index=index)
    h.state.apply(spec(memory=100, replicas=2), 1.0)
    h.answer()
    h.state.apply(_v2(memory=100, replicas=2), 2.0)
    assert sorted(h.take()) == [("load", "mlserver", 0, "iris", 2), ("load", "mlserver", 1, "iris", 2)]
    h.state.event("mlserver", 0, "iris", 2, kind=AgentEventKind.LOADED, now=3.0)
    # Replica 0 now serves version 2 (it replaced version 1 there): 1 old, 1 new.
    assert h.model_state("iris") == "ModelProgressing"
    assert _shares(_entry(h)) == ([(1, 50), (2, 50)], [("mlserver-1", 1), ("mlserver-0", 2)])
    h.state.event("mlserver", 1, "iris", 2, kind=AgentEventKind.LOADED, now=4.0)
    assert h.model_state("iris") == "ModelAvailable"
    assert _shares(_entry(h)) == ([(2, 100)], [("mlserver-0", 2), ("mlserver-1", 2)])


def test_a_new_version_that_fails_leaves_the_old_one_in_the_feed_and_says_why():
    h = Harness()
    for index in range(2):
        h.connect(index=index)
    h.state.apply(spec(memory=100), 1.0)
    h.answer()
    h.state.apply(_v2(memory=100), 2.0)
    h.answer(now=3.0, fail="no such file")
    entry = _entry(h)
    assert (entry["version"], entry["state"], entry["reason"]) == (2, "ModelFailed", "no such file")
    assert _shares(entry) == ([(1, 100)], [("mlserver-0", 1)])
    assert h.replicas("iris", 1) == {0: "Available"}


def test_an_old_version_the_agent_lost_in_a_failed_replace_stops_being_routed():
    """One replica: version 2 replaces version 1 there and fails, and the server dropped version 1
    too, so the agent reports it UNLOADED though nobody asked: the scheduler believes it."""
    h = Harness()
    h.connect()
    h.state.apply(spec(memory=100), 1.0)
    h.answer()
    h.state.apply(_v2(memory=100), 2.0)
    assert h.take() == [("load", "mlserver", 0, "iris", 2)]
    h.state.event("mlserver", 0, "iris", 2, AgentEventKind.LOAD_FAILED, message="boom", now=3.0)
    assert _shares(_entry(h)) == ([(1, 100)], [("mlserver-0", 1)])  # version 1 serves on there
    h.state.event(
        "mlserver",
        0,
        "iris",
        1,
        AgentEventKind.UNLOADED,
        message="replaced by version 2, which failed",
        now=3.0,
    )
    assert h.state.model("iris").version(1) is None  # unloaded, so pruned: it holds nothing
    assert h.model_state("iris") == "ModelFailed"
    assert _shares(_entry(h))[1] == []  # nothing to route to: the gateway answers 503 with the state
