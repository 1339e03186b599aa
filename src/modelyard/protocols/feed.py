"""The scheduler's gateway feed (`GET /v1/feed`, docs/placement.md): one JSON object per line.

    {"type": "snapshot", "models": [entry, ...]}   first line: every model the scheduler knows
    {"type": "model", ...entry}                     a model's entry changed
    {"type": "removed", "name": "iris"}             the model is gone
    {"type": "ping"}                                keep-alive

An entry is `{"name", "version", "state", "reason", "endpoints": [{"name", "url"}]}`. Parsing is
strict about what the gateway routes on (names, endpoint URLs) and lenient about the rest: a line
of an unknown type is ignored (a newer scheduler may add some), and a snapshot entry that is bad is
reported beside the good ones rather than costing the gateway every model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


class FeedLineInvalid(ValueError):
    """A line the gateway cannot use; the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class FeedEndpoint:
    name: str
    url: str


@dataclass(frozen=True, slots=True)
class PlacedModel:
    name: str
    version: int
    state: str
    reason: str
    endpoints: tuple[FeedEndpoint, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    models: tuple[PlacedModel, ...]
    problems: tuple[str, ...] = field(default=())  # entries left out, one line each


@dataclass(frozen=True, slots=True)
class ModelChanged:
    model: PlacedModel


@dataclass(frozen=True, slots=True)
class ModelRemoved:
    name: str


@dataclass(frozen=True, slots=True)
class Ping:
    pass


FeedEvent = Snapshot | ModelChanged | ModelRemoved | Ping


def parse_feed_line(line: bytes | str) -> FeedEvent | None:
    """One line of the feed; None for a blank line or an unknown type; FeedLineInvalid otherwise."""
    if not line.strip():
        return None
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise FeedLineInvalid(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FeedLineInvalid(f"expected a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if kind == "ping":
        return Ping()
    if kind == "model":
        return ModelChanged(parse_entry(data))
    if kind == "removed":
        return ModelRemoved(_string(data, "name", "removed"))
    if kind == "snapshot":
        entries = data.get("models")
        if not isinstance(entries, list):
            raise FeedLineInvalid("snapshot.models: expected a list")
        models, problems = [], []
        for i, entry in enumerate(entries):
            try:
                models.append(parse_entry(entry, f"snapshot.models[{i}]"))
            except FeedLineInvalid as exc:
                problems.append(str(exc))
        return Snapshot(tuple(models), tuple(problems))
    return None


def parse_entry(data: Any, where: str = "model") -> PlacedModel:
    if not isinstance(data, dict):
        raise FeedLineInvalid(f"{where}: expected an object")
    name = _string(data, "name", where)
    where = f"{where} ({name})"
    version = data.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise FeedLineInvalid(f"{where}.version: expected an integer")
    raw = data.get("endpoints") or []
    if not isinstance(raw, list):
        raise FeedLineInvalid(f"{where}.endpoints: expected a list")
    endpoints = []
    for i, endpoint in enumerate(raw):
        if not isinstance(endpoint, dict):
            raise FeedLineInvalid(f"{where}.endpoints[{i}]: expected an object")
        url = _string(endpoint, "url", f"{where}.endpoints[{i}]")
        endpoints.append(FeedEndpoint(str(endpoint.get("name") or ""), url))
    state = data.get("state")
    reason = data.get("reason")
    return PlacedModel(
        name,
        version,
        state if isinstance(state, str) and state else "Unknown",
        reason if isinstance(reason, str) else "",
        tuple(endpoints),
    )


def _string(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise FeedLineInvalid(f"{where}.{key}: expected a non-empty string")
    return value
