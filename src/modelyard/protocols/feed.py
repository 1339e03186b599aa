"""The scheduler's gateway feed (`GET /v1/feed`, docs/placement.md): one JSON object per line.

    {"type": "snapshot", "models": [entry, ...]}   first line: every model the scheduler knows
    {"type": "model", ...entry}                     a model's entry changed
    {"type": "removed", "name": "iris"}             the model is gone
    {"type": "ping"}                                keep-alive

An entry is `{"name", "version", "state", "reason", "available_replicas", "unavailable_replicas",
"endpoints": [{"name", "url", "version"}], "versions": [{"version", "weight"}]}`; `versions` (each
version's share of the traffic, two of them during a rollout), each endpoint's `version` and the
replica counts are absent from older schedulers. Parsing is
strict about what the gateway routes on (names, endpoint URLs) and lenient about the rest: a line
of an unknown type is ignored (a newer scheduler may add some), and a snapshot entry that is bad is
reported beside the good ones rather than costing the gateway every model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeGuard

import orjson


class FeedLineInvalid(ValueError):
    """A line the gateway cannot use; the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class FeedEndpoint:
    name: str
    url: str
    version: int | None = None  # the model version it serves (None from an older scheduler)


@dataclass(frozen=True, slots=True)
class VersionShare:
    version: int
    weight: int  # percent of the model's traffic


@dataclass(frozen=True, slots=True)
class PlacedModel:
    name: str
    version: int
    state: str
    reason: str
    endpoints: tuple[FeedEndpoint, ...]
    versions: tuple[VersionShare, ...] = ()  # empty from an older scheduler
    # The latest version's replicas that traffic may go to, and the rest of those desired (loading,
    # failed or not placed); None from an older scheduler.
    available_replicas: int | None = None
    unavailable_replicas: int | None = None

    @property
    def split(self) -> bool:
        """Traffic is split between versions (a rollout): two or more shares, each with endpoints."""
        served = {e.version for e in self.endpoints}
        return len(self.versions) > 1 and all(v.version in served for v in self.versions)


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
    if not _integer(version):
        raise FeedLineInvalid(f"{where}.version: expected an integer")
    raw = data.get("endpoints") or []
    if not isinstance(raw, list):
        raise FeedLineInvalid(f"{where}.endpoints: expected a list")
    endpoints = []
    for i, endpoint in enumerate(raw):
        if not isinstance(endpoint, dict):
            raise FeedLineInvalid(f"{where}.endpoints[{i}]: expected an object")
        url = _string(endpoint, "url", f"{where}.endpoints[{i}]")
        served = endpoint.get("version")
        if served is not None and not _integer(served):
            raise FeedLineInvalid(f"{where}.endpoints[{i}].version: expected an integer")
        endpoints.append(FeedEndpoint(str(endpoint.get("name") or ""), url, served))
    versions = _versions(data.get("versions"), where)
    state = data.get("state")
    reason = data.get("reason")
    return PlacedModel(
        name,
        version,
        state if isinstance(state, str) and state else "Unknown",
        reason if isinstance(reason, str) else "",
        tuple(endpoints),
        versions,
        _count(data.get("available_replicas")),
        _count(data.get("unavailable_replicas")),
    )


def _count(value: Any) -> int | None:
    """A replica count, shown but never routed on: anything but a count reads as unknown."""
    return value if _integer(value) and value >= 0 else None


def _versions(raw: Any, where: str) -> tuple[VersionShare, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise FeedLineInvalid(f"{where}.versions: expected a list")
    shares = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise FeedLineInvalid(f"{where}.versions[{i}]: expected an object")
        version, weight = item.get("version"), item.get("weight")
        if not _integer(version):
            raise FeedLineInvalid(f"{where}.versions[{i}].version: expected an integer")
        if not _integer(weight) or not 0 <= weight <= 100:
            raise FeedLineInvalid(f"{where}.versions[{i}].weight: expected an integer from 0 to 100")
        shares.append(VersionShare(version, weight))
    if len({s.version for s in shares}) != len(shares):
        raise FeedLineInvalid(f"{where}.versions: a version is named twice")
    return tuple(shares)


def _integer(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise FeedLineInvalid(f"{where}.{key}: expected a non-empty string")
    return value
