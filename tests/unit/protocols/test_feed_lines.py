"""Parsing the scheduler's feed lines (protocols/feed.py)."""

from __future__ import annotations

import re

import pytest

from modelyard.protocols.feed import (
    FeedEndpoint,
    FeedLineInvalid,
    ModelChanged,
    ModelRemoved,
    Ping,
    PlacedModel,
    Snapshot,
    VersionShare,
    parse_feed_line,
)

ENTRY = (
    b'{"name": "iris", "version": 2, "state": "ModelAvailable", "reason": "",'
    b' "endpoints": [{"name": "mlserver-0", "url": "http://127.0.0.1:8080"}]}'
)
IRIS = PlacedModel("iris", 2, "ModelAvailable", "", (FeedEndpoint("mlserver-0", "http://127.0.0.1:8080"),))


def test_each_line_type():
    assert parse_feed_line(b'{"type": "ping"}') == Ping()
    assert parse_feed_line(b'{"type": "removed", "name": "iris"}') == ModelRemoved("iris")
    assert parse_feed_line(b'{"type": "model", ' + ENTRY[1:]) == ModelChanged(IRIS)
    assert parse_feed_line(b'{"type": "snapshot", "models": [' + ENTRY + b"]}") == Snapshot((IRIS,))


def test_replica_counts_are_read_and_anything_but_a_count_is_unknown():
    counted = parse_feed_line(
        b'{"type": "model", "available_replicas": 0, "unavailable_replicas": 1, ' + ENTRY[1:]
    )
    assert isinstance(counted, ModelChanged)
    assert (counted.model.available_replicas, counted.model.unavailable_replicas) == (0, 1)
    assert (IRIS.available_replicas, IRIS.unavailable_replicas) == (None, None)  # an older scheduler
    odd = b'{"type": "model", "available_replicas": -1, "unavailable_replicas": true, ' + ENTRY[1:]
    assert parse_feed_line(odd) == ModelChanged(IRIS)  # shown, never routed on: not worth refusing


def test_blank_lines_and_unknown_types_are_skipped():
    assert parse_feed_line(b"   ") is None
    assert parse_feed_line(b'{"type": "server", "name": "mlserver"}') is None


def test_an_entry_without_endpoints_has_none_and_defaults_state():
    event = parse_feed_line(b'{"type": "model", "name": "iris", "version": 1, "endpoints": null}')
    assert event == ModelChanged(PlacedModel("iris", 1, "Unknown", "", ()))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1]", "expected a JSON object"),
        (b'{"type": "model", "version": 1}', "model.name: expected a non-empty string"),
        (b'{"type": "model", "name": "a", "version": "1"}', "model (a).version: expected an integer"),
        (b'{"type": "model", "name": "a", "endpoints": [{}]}', "model (a).endpoints[0].url"),
        (b'{"type": "removed"}', "removed.name"),
        (b'{"type": "snapshot"}', "snapshot.models: expected a list"),
    ],
)
def test_bad_lines_say_what_is_wrong(line, message):
    with pytest.raises(FeedLineInvalid, match=re.escape(message)):
        parse_feed_line(line)


def test_a_bad_snapshot_entry_is_left_out_with_its_problem():
    event = parse_feed_line(b'{"type": "snapshot", "models": [' + ENTRY + b', {"name": ""}]}')
    assert isinstance(event, Snapshot)
    assert event.models == (IRIS,)
    assert event.problems == ("snapshot.models[1].name: expected a non-empty string",)


def test_a_rollout_entry_names_each_endpoints_version_and_each_versions_share():
    line = (
        b'{"type": "model", "name": "iris", "version": 2, "state": "ModelProgressing",'
        b' "endpoints": [{"name": "a-0", "url": "http://h:1", "version": 1},'
        b' {"name": "a-1", "url": "http://h:2", "version": 2}],'
        b' "versions": [{"version": 1, "weight": 34}, {"version": 2, "weight": 66}]}'
    )
    event = parse_feed_line(line)
    assert isinstance(event, ModelChanged)
    model = event.model
    assert [(e.name, e.version) for e in model.endpoints] == [("a-0", 1), ("a-1", 2)]
    assert model.versions == (VersionShare(1, 34), VersionShare(2, 66))
    assert model.split
    assert not IRIS.split  # an older scheduler's entry


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        (b'"x"', "versions: expected a list"),
        (b'[{"version": 1, "weight": 101}]', "weight: expected an integer from 0 to 100"),
        (b'[{"version": true, "weight": 1}]', "version: expected an integer"),
        (b'[{"version": 1, "weight": 1}, {"version": 1, "weight": 2}]', "named twice"),
    ],
)
def test_bad_version_shares_are_refused(versions, message):
    with pytest.raises(FeedLineInvalid, match=re.escape(message)):
        parse_feed_line(b'{"type": "model", "name": "iris", "versions": ' + versions + b"}")
