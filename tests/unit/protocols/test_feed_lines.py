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
