"""A stream's usage read as its events pass (StreamUsage) and an answer's (usage_tokens): whole
events relayed, however the server's chunks cut them; the usage event kept from a client that
did not ask for it; the tokens it reports counted."""

from __future__ import annotations

import orjson
import pytest

from modelyard.protocols.openai import StreamUsage, usage_tokens

CHOICE = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}'
DONE = b"data: [DONE]"


def stream(separator: bytes) -> bytes:
    return separator.join([CHOICE, CHOICE, USAGE, DONE]) + separator


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("strip", [True, False])
def test_every_cut_of_the_stream_relays_whole_events_and_reads_the_usage(
    separator: bytes, strip: bool
) -> None:
    whole = stream(separator)
    expected = whole.replace(USAGE + separator, b"") if strip else whole
    for cut in range(1, len(whole)):
        usage = StreamUsage(strip)
        relayed = [usage.feed(whole[:cut]), usage.feed(whole[cut:]), usage.rest()]
        assert b"".join(relayed) == expected, cut
        assert usage.tokens == 12, cut
        for part in relayed:  # nothing relayed ends inside an event
            assert not part or part.endswith(separator), (cut, part)


def test_byte_by_byte() -> None:
    whole = stream(b"\n\n")
    usage = StreamUsage(True)
    out = b"".join(usage.feed(whole[i : i + 1]) for i in range(len(whole))) + usage.rest()
    assert out == whole.replace(USAGE + b"\n\n", b"") and usage.tokens == 12
    assert usage.events == 3  # (the usage event is not relayed; [DONE] is an event)


def test_a_usage_the_client_asked_for_is_relayed_and_counted() -> None:
    usage = StreamUsage(False)
    assert usage.feed(stream(b"\n\n")) == stream(b"\n\n") and usage.tokens == 12


def test_a_stream_that_never_ends_an_event_is_relayed_past_a_bound() -> None:
    usage = StreamUsage(True)
    blob = b"x" * (1 << 20)
    assert usage.feed(blob[:1000]) == b""  # (waiting for the event's end)
    assert usage.feed(blob[1000:]) == blob  # over 1 MiB without one: relayed as it is


@pytest.mark.parametrize(
    ("answer", "tokens"),
    [
        ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}, 7),
        ({"usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"cached": 1}}}, 7),
        ({"usage": None}, 0),
        ({"usage": {"total_tokens": -5}}, 0),
        ({"usage": {"total_tokens": 18446744073709551615}}, 1 << 32),  # a server's word, bounded
        ({"choices": [{"message": {"content": '"usage": {"total_tokens": 999}'}}]}, 0),
        ({}, 0),
    ],
)
def test_usage_tokens_reads_the_answers_usage(answer: dict[str, object], tokens: int) -> None:
    assert usage_tokens(orjson.dumps(answer)) == tokens
