"""Attack: StreamUsage.feed when a chunk holds no event end (a usage event split across reads)."""

from modelyard.protocols.openai import StreamUsage

USAGE_EVENT = (
    b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":900,"total_tokens":1000}}'
    b"\n\n"
)


def test_usage_event_split_across_two_reads_is_still_counted():
    usage = StreamUsage(strip=True)
    out = usage.feed(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    # the usage event arrives in two reads, the first without any event end
    cut = 40
    out += usage.feed(USAGE_EVENT[:cut])
    out += usage.feed(USAGE_EVENT[cut:] + b"data: [DONE]\n\n")
    out += usage.rest()
    assert usage.tokens == 1000, "the usage event's tokens were not read"
    assert b'"usage"' not in out, "the usage event the gateway asked for reached the client"


def test_a_read_without_event_end_is_not_cut_three_bytes_in():
    usage = StreamUsage(strip=False)
    first = usage.feed(b'data: {"choices":[{"delta":{"content":"h')
    assert first == b"", f"partial event relayed: {first!r}"
