"""Judging a canary by its answers: compare a mirrored answer with the primary's, and summarise.

The gateway mirrors a share of a route's requests to a canary subset; the client gets the primary's
answer and the canary's is only compared. An error rate alone misses a canary that answers fast and
wrong, so a person also needs to see how alike the answers are (ROUGE-L, exact match).
Everything here is pure and synchronous; the gateway feeds it bodies and outcomes.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Any, TypedDict

import orjson

# Scoring runs on the event loop, and an answer can be arbitrarily long: only the first tokens of
# each side count. With the bit-parallel LCS below, 2048 x 2048 tokens costs about a millisecond.
_MAX_TOKENS = 2048
_TOKEN = re.compile(r"\S+")
# SSE's own line breaks only: str.splitlines() would also split on U+2028 inside a JSON string.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def answer_text(body: bytes, content_type: str | None) -> str | None:
    """The comparable text of an answer, or None when the body is not JSON (nor an SSE stream).

    OpenAI choices are joined with a newline in `index` order, streamed or not, so a streamed answer
    compares equal to the same answer sent whole. Tensor outputs (OIP v2 `outputs`, KServe v1
    `predictions`) and any other JSON become compact JSON with sorted keys, so that ids, model
    versions and key order do not make equal answers differ.
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "text/event-stream" or (content_type is None and body.lstrip().startswith(b"data:")):
        return _stream_text(body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(doc, dict):
        choices = doc.get("choices")
        if (
            isinstance(choices, list)
            and choices
            and all(isinstance(c, dict) and ("message" in c or "text" in c) for c in choices)
        ):
            texts: dict[int, list[str]] = {}
            for position, choice in enumerate(choices):
                texts.setdefault(_index(choice, position), []).append(_choice_text(choice, "message"))
            return _join(texts)
        if isinstance(doc.get("outputs"), list):
            return _canonical(_by_name(doc["outputs"]))
        if "predictions" in doc:
            return _canonical(doc["predictions"])
    return _canonical(doc)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (the first 2048 of each side).

    With beta = 1, F = 2PR / (P + R) where P = lcs/len(candidate), R = lcs/len(reference), which
    reduces to 2 * lcs / (len(reference) + len(candidate)).
    """
    ref, cand = _tokens(reference), _tokens(candidate)
    if not ref or not cand:
        return 1.0 if not ref and not cand else 0.0
    return 2 * _lcs_length(ref, cand) / (len(ref) + len(cand))


def exact_match(a: str, b: str) -> bool:
    return a.strip() == b.strip()


class SubsetSummary(TypedDict):
    requests: int
    errors: int
    error_rate: float
    p50_ms: float | None
    p95_ms: float | None


class CanarySummary(TypedDict):
    compared: int
    mean_rouge_l: float | None
    exact_match_rate: float | None
    subsets: dict[str, SubsetSummary]


class _Subset:
    __slots__ = ("errors", "latencies", "requests")

    def __init__(self, window: int) -> None:
        self.requests = 0
        self.errors = 0
        self.latencies: deque[float] = deque(maxlen=window)


class CanaryStats:
    """A running account of one canary: comparison scores, and per subset (primary, canary, ...)
    request and error counts with the latencies of the last `window` successful requests.

    Memory is bounded: sums and counts, plus one ring per subset (subsets come from the route's
    config, so there are few). Percentiles come from the ring, so they describe recent traffic.
    """

    __slots__ = ("_compared", "_exact", "_rouge_sum", "_subsets", "_window")

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._window = window
        self._compared = 0
        self._exact = 0
        self._rouge_sum = 0.0
        self._subsets: dict[str, _Subset] = {}

    def record_comparison(self, rouge: float, exact: bool) -> None:
        self._compared += 1
        self._rouge_sum += rouge
        self._exact += exact

    def record_outcome(self, subset: str, latency_s: float, ok: bool) -> None:
        stats = self._subsets.get(subset)
        if stats is None:
            stats = self._subsets[subset] = _Subset(self._window)
        stats.requests += 1
        if ok:
            stats.latencies.append(latency_s)
        else:
            # A failure's latency is left out: a canary refusing connections in 1 ms would
            # otherwise look fast. Failures show in the error rate instead.
            stats.errors += 1

    def summary(self) -> CanarySummary:
        compared = self._compared
        return {
            "compared": compared,
            "mean_rouge_l": self._rouge_sum / compared if compared else None,
            "exact_match_rate": self._exact / compared if compared else None,
            "subsets": {name: _subset_summary(self._subsets[name]) for name in sorted(self._subsets)},
        }


def _subset_summary(stats: _Subset) -> SubsetSummary:
    ordered = sorted(stats.latencies)
    return {
        "requests": stats.requests,
        "errors": stats.errors,
        "error_rate": stats.errors / stats.requests,
        "p50_ms": _nearest_rank(ordered, 50),
        "p95_ms": _nearest_rank(ordered, 95),
    }


def _nearest_rank(ordered: list[float], percent: int) -> float | None:
    if not ordered:
        return None
    rank = max(1, -(-percent * len(ordered) // 100))  # ceil in integers: 0.95 * 20 is not 19.0
    return ordered[rank - 1] * 1000.0


def _tokens(text: str) -> list[str]:
    # finditer + islice, not split(): a huge answer is never tokenised past the cap.
    return [match.group().lower() for match in islice(_TOKEN.finditer(text), _MAX_TOKENS)]


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Bit-parallel LCS length (Hyyro 2004): one row of the DP table lives in the bits of `row`.

    The classic two-row DP costs about a second for 2048 x 2048 tokens in CPython; this does the
    same n*m cell updates as big-integer operations, n word-wide steps. Memory: `row` has one bit
    per token of the shorter side, plus one match mask per distinct token of that side.
    """
    if len(a) > len(b):
        a, b = b, a
    masks: dict[str, int] = {}
    for position, token in enumerate(a):
        masks[token] = masks.get(token, 0) | (1 << position)
    full = (1 << len(a)) - 1
    row = full  # a zero bit marks a column where the LCS grew
    for token in b:
        matches = row & masks.get(token, 0)
        if matches:
            row = ((row + matches) | (row - matches)) & full
    return len(a) - row.bit_count()


def _stream_text(body: bytes) -> str | None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    texts: dict[int, list[str]] = {}
    seen = False
    for data in _sse_data(text):
        if data == "[DONE]":
            break
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None  # a cut-off or corrupt stream is not an answer to score
        seen = True
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for position, choice in enumerate(choices if isinstance(choices, list) else []):
            if isinstance(choice, dict):
                texts.setdefault(_index(choice, position), []).append(_choice_text(choice, "delta"))
    return _join(texts) if seen else None


def _sse_data(text: str) -> Iterator[str]:
    """The data of each SSE event: its `data:` lines joined by newlines, events ended by a blank line."""
    lines: list[str] = []
    for line in _LINE_BREAK.split(text):
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    if lines:
        yield "\n".join(lines)


def _choice_text(choice: dict[str, Any], part: str) -> str:
    # Chat carries text in message/delta.content (None for tool calls); completions in `text`.
    message = choice.get(part)
    value = message.get("content") if isinstance(message, dict) else choice.get("text")
    return value if isinstance(value, str) else ""


def _index(choice: dict[str, Any], position: int) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else position


def _join(texts: dict[int, list[str]]) -> str:
    return "\n".join("".join(texts[index]) for index in sorted(texts))


def _by_name(outputs: list[Any]) -> list[Any]:
    # Servers may list OIP outputs in any order; the name identifies each one.
    if all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        return sorted(outputs, key=lambda o: str(o["name"]))
    return outputs


def _canonical(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
