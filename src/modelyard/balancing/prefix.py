"""`PrefixIndex`: what each endpoint of a model has likely cached, as chains of prompt chunks.

A prompt is cut into chunks of `chunk_chars` characters; chunk i is named by a hash of chunk i
and the name of chunk i-1, so a name stands for the whole prefix up to it (vLLM's block hashes,
over characters instead of tokens: the gateway has no tokenizer). For each endpoint the index
keeps the names of the chunks it was sent, least recently used first, at most `capacity` of them
(size it like the servers' prefix cache). Matching a prompt against an endpoint counts its
leading chunks that endpoint holds: the length of the prefix it likely has cached.

Pure (DESIGN.md habit 1): no clock, no I/O; the gateway matches before a pick and records after.
Differs from SGLang's cache-aware router (a radix tree of characters shared by all workers,
evicted by time): one LRU per endpoint bounded by size, as the servers' caches are, so an
endpoint's entry goes when the server would have evicted it, not after a fixed age.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence


class PrefixIndex:
    def __init__(self, chunk_chars: int, capacity: int) -> None:
        if chunk_chars < 1 or capacity < 0:
            raise ValueError("chunk_chars must be >= 1 and capacity >= 0")
        self.chunk_chars = chunk_chars
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, None]] = {}

    def chunks(self, prompt: str) -> list[int]:
        """The chain of chunk names for `prompt` (a trailing partial chunk counts too)."""
        names: list[int] = []
        previous = 0
        size = self.chunk_chars
        for start in range(0, len(prompt), size):
            previous = hash((previous, prompt[start : start + size]))
            names.append(previous)
        return names

    def match(self, chunks: Sequence[int], endpoint: str) -> int:
        """How many leading chunks `endpoint` holds."""
        held = self._held.get(endpoint)
        if not held:
            return 0
        count = 0
        for name in chunks:
            if name not in held:
                break
            count += 1
        return count

    def matches(self, chunks: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        return {endpoint: self.match(chunks, endpoint) for endpoint in endpoints}

    def record(self, chunks: Sequence[int], endpoint: str) -> None:
        """`endpoint` was sent this prompt: it now holds its chunks, most recently used. Touched
        last to first, as vLLM frees blocks, so a shared head outlives the tails built on it."""
        if self.capacity == 0 or not chunks:
            return
        held = self._held.setdefault(endpoint, OrderedDict())
        for name in reversed(chunks):
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.capacity:  # bounded: one removal per round
            held.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """The endpoint went away (or restarted): nothing of it is known."""
        self._held.pop(endpoint, None)

    def keep_only(self, endpoints: Iterable[str]) -> None:
        keep = set(endpoints)
        for endpoint in [e for e in self._held if e not in keep]:
            del self._held[endpoint]

    def sizes(self) -> Mapping[str, int]:
        """Chunks held per endpoint (for metrics and tests)."""
        return {endpoint: len(held) for endpoint, held in self._held.items()}
