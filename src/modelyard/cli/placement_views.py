"""Tables for people from the scheduler's JSON (docs/placement.md): pure functions of that JSON, so
they are tested without a scheduler. `-o json` bypasses them and prints the API's JSON as it is."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

TERMINATED = "ModelTerminated"
_CHANGES = {"created": "created", "new_version": "new version", "scaling": "scaled", "unchanged": "unchanged"}
_UNITS = ("Ki", "Mi", "Gi", "Ti", "Pi")


def applied_line(model: Mapping[str, Any]) -> str:
    """`iris: created (version 1)` for the answer to a PUT."""
    change = str(model.get("change", "applied"))
    return f"{model.get('name')}: {_CHANGES.get(change, change)} (version {model.get('version')})"


def models_table(models: Iterable[Mapping[str, Any]], *, show_all: bool = False) -> Table:
    table = Table(box=None, pad_edge=False)
    # READY is available/desired replicas, as kubectl shows it. Only the reason wraps: the other
    # columns are what a reader scans down, and a wrapped name or state reads as two rows.
    for column in ("NAME", "VERSION", "STATE", "READY", "SERVER"):
        table.add_column(column, no_wrap=True)
    table.add_column("REASON", overflow="fold")
    for model in sorted(models, key=lambda m: str(m.get("name"))):
        if model.get("state") == TERMINATED and not show_all:
            continue
        state = str(model.get("state", ""))
        if model.get("deleted") and state != TERMINATED:
            state += " (deleted)"
        table.add_row(
            str(model.get("name", "")),
            str(model.get("version", "")),
            state,
            f"{model.get('available_replicas', 0)}/{_desired_replicas(model)}",
            str(model.get("server") or "-"),
            str(model.get("reason") or ""),
        )
    return table


def model_status(model: Mapping[str, Any]) -> Group:
    """A heading with the model's state, then one row per replica of each version, newest first."""
    why = f": {model['reason']}" if model.get("reason") else ""
    deleted = ", deleted" if model.get("deleted") else ""
    heading = Text(
        f"{model.get('name')}: {model.get('state')}{why} (version {model.get('version')}, "
        f"{model.get('available_replicas', 0)}/{_desired_replicas(model)} available{deleted})"
    )
    table = Table(box=None, pad_edge=False)
    for column in ("VERSION", "VERSION STATE", "SERVER", "REPLICA", "REPLICA STATE"):
        table.add_column(column, no_wrap=True)
    table.add_column("REASON", overflow="fold")
    versions = sorted(model.get("versions") or [], key=lambda v: -int(v.get("version", 0)))
    for version in versions:
        replicas = version.get("replicas") or {}
        rows = sorted(replicas.items(), key=lambda item: _index(item[0])) or [("-", {})]
        for index, replica in rows:
            table.add_row(
                str(version.get("version", "")),
                str(version.get("state", "")),
                str(version.get("server") or "-"),
                str(index),
                str(replica.get("state", "-")),
                str(replica.get("reason") or version.get("reason") or ""),
            )
    return Group(heading, table)


def servers_table(servers: Iterable[Mapping[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("SERVER", "REPLICA", "URL", "MEMORY tot/avail/resv", "CAPABILITIES"):
        table.add_column(column, no_wrap=True)
    table.add_column("MODELS")  # wraps between names, never inside one
    for server in sorted(servers, key=lambda s: str(s.get("name"))):
        for replica in sorted(server.get("replicas") or [], key=lambda r: int(r.get("index", 0))):
            flags = [f for f in ("draining",) if replica.get(f)] + (
                [] if replica.get("connected", True) else ["disconnected"]
            )
            memory = "/".join(
                format_bytes(replica.get(k)) for k in ("total_memory", "available_memory", "reserved_memory")
            )
            table.add_row(
                str(server.get("name", "")),
                str(replica.get("index", "")) + (f" ({', '.join(flags)})" if flags else ""),
                str(replica.get("inference_url") or "-"),
                memory,
                ", ".join(replica.get("capabilities") or []) or "-",
                ", ".join(replica.get("loaded_models") or []) or "-",
            )
    return table


def format_bytes(value: object) -> str:
    """Binary units with one decimal where it matters: 2000000 -> 1.9Mi; 512 -> 512."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    number, unit = float(value), ""
    for next_unit in _UNITS:
        if abs(number) < 1024:
            break
        number, unit = number / 1024, next_unit
    return (
        f"{number:.0f}{unit}" if not unit or number >= 100 or number.is_integer() else f"{number:.1f}{unit}"
    )


def _desired_replicas(model: Mapping[str, Any]) -> object:
    spec = model.get("spec")
    if isinstance(spec, Mapping) and spec.get("replicas") is not None:
        return spec["replicas"]
    return int(model.get("available_replicas") or 0) + int(model.get("unavailable_replicas") or 0)


def _index(key: object) -> tuple[int, str]:
    text = str(key)
    return (int(text), "") if text.isdigit() else (1 << 30, text)
