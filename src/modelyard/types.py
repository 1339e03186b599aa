"""The shared vocabulary: wire protocols and the routing view of one request."""

from __future__ import annotations

import enum
import re
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple


class Protocol(enum.StrEnum):
    """The wire protocol a request arrived in; it decides the error envelope."""

    OPENAI = "openai"
    OIP = "oip"  # Open Inference Protocol v2 (KServe v2, Triton, MLServer)
    KSERVE_V1 = "kserve_v1"
    PLAIN = "plain"  # gateway's own endpoints (/admin, /healthz)


class RoutingRequest(NamedTuple):
    """What a routing policy may know about a request, parsed once from its body.

    `prompt` is the text used for prefix affinity; `prompt_tokens` and `max_tokens`
    estimate its cost (tokens approximated as whitespace-separated words). Immutable; a tuple
    rather than a frozen dataclass, which costs several times as much to make (one per request).
    """

    model: str
    prompt: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    stream: bool = False
    fields: dict[str, Any] | None = None  # the parsed body, for route matches

    def __repr__(self) -> str:  # without the body (`fields`): a repr may end up in a log
        return (
            f"RoutingRequest(model={self.model!r}, prompt={self.prompt[:80]!r}, "
            f"prompt_tokens={self.prompt_tokens}, max_tokens={self.max_tokens}, stream={self.stream})"
        )


# Kubernetes quantities: memory ("100Ki", "1.5Gi", "2G"), CPU ("500m", "2"), any resource count.
_QUANTITY = re.compile(r"([+]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?")
_SUFFIX = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity in its base unit ("500m" -> 0.5, "1Gi" -> 1073741824); ValueError
    for anything else."""
    match = _QUANTITY.fullmatch(text.strip())
    if match:
        try:
            number = Decimal(match.group(1)) * _SUFFIX[match.group(2)]
        except InvalidOperation:
            number = None
        if number is not None and number.is_finite():
            return number
    raise ValueError(f"{text!r} is not a quantity")
