"""Canary comparison: the comparable text of each protocol's answer, ROUGE-L, and the summary."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from modelyard.cluster.canary import CanaryStats, answer_text, exact_match, rouge_l
from modelyard.cluster.canary import _lcs_length as lcs_length


def body(data: Any) -> bytes:
    return orjson.dumps(data)


def sse(*chunks: Any) -> bytes:
    events = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


# ROUGE-L


def test_rouge_identical_is_one_and_disjoint_is_zero() -> None:
    assert rouge_l("the cat sat", "the cat sat") == 1.0
    assert rouge_l("the cat sat", "a dog ran") == 0.0


def test_rouge_worked_example() -> None:
    # LCS of "the quick brown fox jumps" (5) and "the brown dog jumps high today" (6) is
    # "the brown jumps" (3): P = 3/6, R = 3/5, F1 = 2PR / (P + R) = 0.6 / 1.1 = 6/11.
    score = rouge_l("the quick brown fox jumps", "the brown dog jumps high today")
    assert score == pytest.approx(6 / 11)


def test_rouge_is_symmetric_with_beta_one() -> None:
    a, b = "the quick brown fox jumps", "the brown dog jumps high today"
    assert rouge_l(a, b) == pytest.approx(rouge_l(b, a))


def test_rouge_ignores_case_and_whitespace_runs() -> None:
    assert rouge_l("The  Cat\nSAT", "the cat\tsat ") == 1.0


@pytest.mark.parametrize(
    ("reference", "candidate", "expected"),
    [("", "", 1.0), ("  \n", "", 1.0), ("", "words", 0.0), ("words", "   ", 0.0)],
)
def test_rouge_empty_cases(reference: str, candidate: str, expected: float) -> None:
    assert rouge_l(reference, candidate) == expected


def test_rouge_counts_only_the_first_2048_tokens() -> None:
    shared = " ".join(f"w{i}" for i in range(2048))
    assert rouge_l(shared + " tail" * 5000, shared + " other" * 3) == 1.0


def reference_lcs(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def test_bit_parallel_lcs_agrees_with_the_textbook_dp() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = [rng.choice("abcd") for _ in range(rng.randint(1, 40))]
        b = [rng.choice("abcde") for _ in range(rng.randint(1, 40))]
        assert lcs_length(a, b) == reference_lcs(a, b)


# exact match


def test_exact_match_strips_surrounding_whitespace_only() -> None:
    assert exact_match("  Paris\n", "Paris")
    assert not exact_match("Paris", "paris")
    assert not exact_match("New York", "New  York")


# answer_text


def test_chat_completion_joins_choices_in_index_order() -> None:
    answer = {
        "id": "chatcmpl-1",
        "choices": [
            {"index": 1, "message": {"role": "assistant", "content": "second"}},
            {"index": 0, "message": {"role": "assistant", "content": "first"}},
            {"index": 2, "message": {"role": "assistant", "content": None, "tool_calls": []}},
        ],
    }
    assert answer_text(body(answer), "application/json") == "first\nsecond\n"


def test_text_completion() -> None:
    answer = {"object": "text_completion", "choices": [{"index": 0, "text": "hello world"}]}
    assert answer_text(body(answer), "application/json; charset=utf-8") == "hello world"


def test_chat_stream_concatenates_deltas_and_equals_the_whole_answer() -> None:
    stream = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo \u2028there"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"total_tokens": 3}},
    )
    whole = body({"choices": [{"index": 0, "message": {"content": "Hello \u2028there"}}]})
    assert answer_text(stream, "text/event-stream") == "Hello \u2028there"
    assert answer_text(stream, "text/event-stream") == answer_text(whole, "application/json")


def test_completion_stream_with_crlf_and_comments() -> None:
    stream = (
        b": keep-alive\r\n\r\n"
        b'data: {"choices":[{"text":"a"}]}\r\n\r\n'
        b'data: {"choices":[{"text":"b"}]}\r\n\r\n'
    )
    assert answer_text(stream + b"data: [DONE]\r\n\r\n", "text/event-stream") == "ab"


def test_stream_is_sniffed_without_a_content_type() -> None:
    assert answer_text(sse({"choices": [{"delta": {"content": "x"}}]}), None) == "x"


def test_cut_off_stream_is_not_comparable() -> None:
    cut = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: {"choi'
    assert answer_text(cut, "text/event-stream") is None
    assert answer_text(b"", "text/event-stream") is None


def test_oip_outputs_compare_equal_whatever_the_envelope_and_order() -> None:
    logits = {"name": "logits", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.5]}
    label = {"name": "label", "shape": [1], "datatype": "BYTES", "data": ["cat"]}
    a = {"model_name": "m", "model_version": "1", "id": "a", "outputs": [logits, label]}
    b = {"outputs": [dict(reversed(label.items())), logits], "id": "b", "model_name": "m"}
    text = answer_text(body(a), "application/json")
    assert text == answer_text(body(b), "application/json")
    assert text is not None
    assert orjson.loads(text) == [label, logits]
    assert " " not in text


def test_kserve_v1_predictions() -> None:
    answer = {"predictions": [{"score": 0.9, "label": "cat"}, [1, 2]]}
    assert answer_text(body(answer), "application/json") == '[{"label":"cat","score":0.9},[1,2]]'


def test_other_json_is_canonical() -> None:
    assert answer_text(b'{ "b": 1, "a": {"d": 2, "c": 3} }', None) == '{"a":{"c":3,"d":2},"b":1}'
    assert answer_text(b'{"choices": [{"label": "x"}]}', None) == '{"choices":[{"label":"x"}]}'


@pytest.mark.parametrize("raw", [b"plain text", b"<html></html>", b"\xff\xfe", b""])
def test_non_json_is_none(raw: bytes) -> None:
    assert answer_text(raw, "text/plain") is None


# CanaryStats


def test_empty_summary() -> None:
    assert CanaryStats().summary() == {
        "compared": 0,
        "mean_rouge_l": None,
        "exact_match_rate": None,
        "subsets": {},
    }


def test_summary_means_rates_and_percentiles() -> None:
    stats = CanaryStats()
    for rouge, exact in [(1.0, True), (0.5, False), (0.0, False), (0.5, True)]:
        stats.record_comparison(rouge, exact)
    for ms in range(1, 21):
        stats.record_outcome("primary", ms / 1000, ok=True)
    stats.record_outcome("canary", 0.2, ok=True)
    stats.record_outcome("canary", 0.001, ok=False)

    summary = stats.summary()
    assert summary["compared"] == 4
    assert summary["mean_rouge_l"] == pytest.approx(0.5)
    assert summary["exact_match_rate"] == pytest.approx(0.5)
    primary = summary["subsets"]["primary"]
    assert (primary["requests"], primary["errors"], primary["error_rate"]) == (20, 0, 0.0)
    # nearest rank over 1..20 ms: p50 is the 10th value, p95 the 19th
    assert primary["p50_ms"] == pytest.approx(10.0)
    assert primary["p95_ms"] == pytest.approx(19.0)
    canary = summary["subsets"]["canary"]
    assert (canary["requests"], canary["errors"], canary["error_rate"]) == (2, 1, 0.5)
    # the fast failure does not count as a latency
    assert canary["p50_ms"] == canary["p95_ms"] == pytest.approx(200.0)


def test_subset_with_only_errors_has_no_percentiles() -> None:
    stats = CanaryStats()
    stats.record_outcome("canary", 0.5, ok=False)
    assert stats.summary()["subsets"]["canary"] == {
        "requests": 1,
        "errors": 1,
        "error_rate": 1.0,
        "p50_ms": None,
        "p95_ms": None,
    }


def test_ring_is_bounded_and_percentiles_follow_recent_latencies() -> None:
    stats = CanaryStats(window=1024)
    for i in range(10_000):
        stats.record_outcome("canary", 10.0 if i < 9_000 else 0.001 * (i % 100 + 1), ok=True)
    assert len(stats._subsets["canary"].latencies) == 1024
    subset = stats.summary()["subsets"]["canary"]
    assert subset["requests"] == 10_000
    # the last 1000 are 1..100 ms; 24 older 10 s values remain in the ring
    assert subset["p50_ms"] is not None and subset["p50_ms"] <= 100.0
    assert subset["p95_ms"] is not None and subset["p95_ms"] <= 100.0


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CanaryStats(window=0)
