"""An answer kept for the shadow comparison (shadow.py): the primary's, filled by the relay, and
the mirror's; bounded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from modelyard.cluster.canary import answer_text

_CAPTURE_LIMIT = 1024 * 1024  # bytes of an answer kept for comparing with its shadow


@dataclass(slots=True)
class Capture:
    """An answer kept for the comparison (bounded), with how it went."""

    subset: str
    status: int = 0
    content_type: str | None = None
    seconds: float = 0.0
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    done: asyncio.Future[None] | None = None  # set when the primary exchange has ended

    def add(self, data: bytes) -> None:
        if self.size < _CAPTURE_LIMIT:
            self.parts.append(data[: _CAPTURE_LIMIT - self.size])
            self.size += len(self.parts[-1])

    def finish(self, status: int, content_type: str | None) -> None:
        self.status = status
        self.content_type = content_type

    def ended(self, seconds: float) -> None:
        self.seconds = seconds
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400

    def text(self) -> str | None:
        return answer_text(b"".join(self.parts), self.content_type)
