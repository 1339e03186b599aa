"""What the scheduler hands to the agent side: load or unload one model version on one replica,
and the callables it sends operations and feed lines through."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from modelyard.placement import ModelSpec, ReplicaState
from modelyard.scheduler.feed import FeedLine


class OperationKind(enum.StrEnum):
    LOAD = "load"
    UNLOAD = "unload"


@dataclass(slots=True, frozen=True)
class Operation:
    """Load or unload one model version on one server replica."""

    kind: OperationKind
    server: str
    index: int
    model: str
    version: int
    spec: ModelSpec


Sender = Callable[[Operation], "str | None"]
"""Queues an operation on the replica's agent stream; returns why it could not, or None."""
Publisher = Callable[[FeedLine], None]


@dataclass(slots=True, frozen=True)
class Queued:
    """An operation waiting for its state to be written: `sent` is the state its replica was set to
    (Loading/Unloading), `failed` the state a send failure sets."""

    operation: Operation
    sent: ReplicaState
    failed: ReplicaState
