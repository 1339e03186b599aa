"""The shared vocabulary: wire protocols and the routing view of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Protocol(enum.StrEnum):
    """The wire protocol a request arrived in; it decides the error envelope."""

    OPENAI = "openai"
    OIP = "oip"  # Open Inference Protocol v2 (KServe v2, Triton, MLServer)
    KSERVE_V1 = "kserve_v1"
    PLAIN = "plain"  # gateway's own endpoints (/admin, /healthz)


@dataclass(slots=True, frozen=True)
class RoutingRequest:
    """What a routing policy may know about a request, parsed once from its body.

    `prompt` is the text used for prefix affinity; `prompt_tokens` and `max_tokens`
    estimate its cost (tokens approximated as whitespace-separated words).
    """

    model: str
    prompt: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    stream: bool = False
    fields: dict[str, Any] | None = field(
        default=None, compare=False, repr=False
    )  # the parsed body, for route matches
