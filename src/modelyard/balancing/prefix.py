"""`PrefixIndex`: what each endpoint of a model has likely cached, as chains of prompt chunks.

A prompt is cut into chunks of `chunk_chars` characters; chunk i is named by a hash of chunk i
and the name of chunk i-1, so a name stands for the whole prefix up to it (vLLM's block hashes,
over characters instead of tokens: the gateway has no tokenizer). The hash is a 64-bit BLAKE2b,
not Python's `hash()`, so that every process names a prompt alike and gateways can share what
they learnt (gateway/prefix_sharing.py). For each endpoint the index
keeps the names of the chunks it was sent, least recently used first, at most `capacity` of them
(size it like the servers' prefix cache). Matching a prompt against an endpoint counts its
leading chunks that endpoint holds: the length of the prefix it likely has cached.

Pure (DESIGN.md habit 1): no clock, no I/O; the gateway matches before a pick and records after.
Differs from SGLang's cache-aware router (a radix tree of characters shared by all workers,
evicted by time): one LRU per endpoint bounded by size, as the servers' caches are, so an
endpoint's entry goes when the server would have evicted it, not after a fixed age.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from hashlib import blake2b as _blake2b
from itertools import islice

_NEVER = float("inf")


class PrefixIndex:
    def __init__(self, chunk_chars: int, capacity: int) -> None:
        if chunk_chars < 1 or capacity < 0:
            raise ValueError("chunk_chars must be >= 1 and capacity >= 0")
        self.chunk_chars = chunk_chars
        self.capacity = capacity
        # endpoint -> chunk name -> when it was last recorded there (`_clock`: prompts recorded)
        self._held: dict[str, OrderedDict[int, int]] = {}
        self._clock = 0

    def chunks(self, prompt: str) -> list[int]:
        """The chain of chunk names for `prompt` (a trailing partial chunk counts too)."""
        names: list[int] = []
        previous = bytes(8)
        size = self.chunk_chars
        # An ASCII prompt is encoded once: its characters are its bytes.
        data = prompt.encode() if prompt.isascii() else None
        for start in range(0, len(prompt), size):
            chunk = data[start : start + size] if data is not None else prompt[start : start + size].encode()
            previous = _blake2b(previous + chunk, digest_size=8).digest()
            names.append(int.from_bytes(previous, "big"))
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
        self._clock += 1
        now = self._clock
        for name in reversed(chunks):
            held[name] = now
            held.move_to_end(name)
        while len(held) > self.capacity:  # bounded: one removal per round
            held.popitem(last=False)

    def age(self, name: int, endpoints: Iterable[str]) -> float:
        """Prompts recorded since the chunk `name` was last recorded on any of `endpoints`
        (infinite if none holds it): how often a prompt starting with it comes back."""
        last = max((held.get(name, -1) for e in endpoints if (held := self._held.get(e))), default=-1)
        return self._clock - last if last >= 0 else _NEVER

    def evicted_age(self, endpoint: str, chunks: Sequence[int], held: int) -> float:
        """Prompts recorded since the newest of the chunks that sending `chunks` (of which
        `endpoint` holds the first `held`) would push out of `endpoint` was last recorded
        (infinite if none would go): how little what goes is wanted. The held ones are touched,
        not pushed out, however old they are."""
        entries = self._held.get(endpoint)
        out = (len(entries) if entries else 0) + len(chunks) - held - self.capacity
        if out <= 0 or not entries:
            return _NEVER
        if not held:
            return self._clock - next(islice(entries.values(), min(out, len(entries)) - 1, None))
        kept = set(chunks[:held])
        newest = -1
        for name, stamp in entries.items():  # oldest first, to the `out`-th that goes
            if name not in kept:
                newest, out = stamp, out - 1
                if not out:
                    break
        # (a prompt longer than the capacity pushes out every other entry: the newest of them)
        return self._clock - newest if newest >= 0 else _NEVER

    def keep_only(self, endpoints: Iterable[str]) -> None:
        keep = set(endpoints)
        for endpoint in [e for e in self._held if e not in keep]:
            del self._held[endpoint]

    def sizes(self) -> Mapping[str, int]:
        """Chunks held per endpoint (for metrics and tests)."""
        return {endpoint: len(held) for endpoint, held in self._held.items()}


class RecentQuantile:
    """A quantile of the last `window` values, sorted afresh at the `first`-th value and then
    every `every` (a sort of `window` floats now and then, not one per request). `learnt` from
    the first sort on; `value` is 0.0 until then."""

    def __init__(self, quantile: float, window: int = 200, every: int = 16, first: int = 8) -> None:
        self.quantile, self.every, self.first = quantile, every, first
        self._recent: deque[float] = deque(maxlen=window)
        self.seen = 0
        self.value = 0.0
        self.learnt = False

    def add(self, value: float) -> None:
        self._recent.append(value)
        self.seen += 1
        if self.seen % self.every == 0 or self.seen == self.first:
            ordered = sorted(self._recent)
            self.value = ordered[int(self.quantile * (len(ordered) - 1))]
            self.learnt = True


class ServiceModel:
    """How long a request takes, learnt from the answers: seconds = `per_char` x uncached prompt
    characters + `base`, a least-squares line over recent requests that started on an idle endpoint
    (so the time is the server's, not a queue's), older ones weighing less (`decay` per sample);
    and the median of those times (`typical`: prefix_aware's tail guard)."""

    def __init__(self, decay: float = 0.98, min_samples: int = 8, window: int = 200) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._typical = RecentQuantile(0.5, window, first=min_samples)

    def observe(self, uncached_chars: int, seconds: float) -> None:
        d = self.decay
        x, y = float(uncached_chars), seconds
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.samples += 1
        self._typical.add(seconds)

    def line(self) -> tuple[float, float, float] | None:
        """(per_char, base, typical) in seconds, or None until `min_samples` answers were seen.
        `typical` is the median of the last `window` times themselves, not of the line."""
        if self.samples < self.min_samples:
            return None
        # The weighted variance of the uncached lengths: with (nearly) one length seen, no slope can
        # be told from rounding noise, so the line is flat at the mean time.
        variance = (self._xx - self._x * self._x / self._w) / self._w
        per_char = 0.0
        if variance > 1.0:  # characters squared
            spread = self._w * self._xx - self._x * self._x
            per_char = max(0.0, (self._w * self._xy - self._x * self._y) / spread)
        base = max(0.0, (self._y - per_char * self._x) / self._w)
        return per_char, base, self._typical.value


# The least wait of an endpoint with every slot taken, in seconds.
BUSY = 0.001


class Flights:
    """Requests this gateway has in flight per endpoint, each with when it was expected to start
    (when it was sent, plus the wait it was expected to queue behind the flights then: a flight
    sent into a queue starts when that queue has drained, not when it was sent, and the flights it
    queued behind may have ended since) and its uncached prompt characters, under the key of its
    exchange (so an answer ends exactly its own flight). `wait` is how long a new request would
    queue behind them on a server that serves `slots` at once (prefix_aware.slots), each flight
    taking what the service model's line says now: a flight sent before the line was learnt is
    timed like the others, not taken to be over. A server with more slots than that looks busier
    than it is, so prefix_aware then errs towards the less loaded endpoint."""

    def __init__(self) -> None:
        self._flights: dict[str, dict[int, tuple[float, int]]] = {}

    def __bool__(self) -> bool:
        """Whether any flight is kept (a strategy other than prefix_aware keeps none)."""
        return bool(self._flights)

    def start(self, endpoint: str, key: int, now: float, chars: int, queued: float = 0.0) -> None:
        """A flight of `chars` uncached prompt characters sent at `now`, expected to wait `queued`
        seconds (`wait` at `now`) before it starts. Callers pass a non-decreasing `now` (monotonic
        time), so each endpoint's flights stay in the order they start; a key started again moves
        to the end."""
        flights = self._flights.setdefault(endpoint, {})
        flights.pop(key, None)
        flights[key] = (now + queued, chars)

    def end(self, endpoint: str, key: int) -> None:
        flights = self._flights.get(endpoint)
        if flights is not None and flights.pop(key, None) is not None and not flights:
            del self._flights[endpoint]

    def count(self, endpoint: str) -> int:
        return len(self._flights.get(endpoint, ()))

    def waits(
        self, endpoints: Iterable[str], now: float, line: tuple[float, ...], slots: int, late: float
    ) -> dict[str, float]:
        """`wait` for each endpoint, plus `late` for those with every slot taken, and never
        below BUSY for those (a queue is a queue, however soon its flights look to end); 0.0 for
        the others: they start a request at once."""
        every = self._flights
        return {
            name: max(BUSY, self.wait(name, now, line, slots) + late)
            if len(every.get(name, ())) >= slots
            else 0.0
            for name in endpoints
        }

    def wait(self, endpoint: str, now: float, line: tuple[float, ...], slots: int = 1) -> float:
        """Seconds until the endpoint has a free slot, as expected with the service `line`
        (seconds per uncached character, base seconds): the flights, in the order they were sent,
        each take the slot that frees first, not before their expected start. That order is
        insertion order, since `start` is called with a non-decreasing `now`: no sort here, on
        the routing path."""
        flights = self._flights.get(endpoint)
        if not flights or len(flights) < slots:
            return 0.0
        per_char, base = line[0], line[1]
        lanes = [float("-inf")] * slots
        for start, chars in flights.values():
            # A flight still running past its expected end holds its slot until now at least.
            heapq.heapreplace(lanes, max(now, max(lanes[0], start) + per_char * chars + base))
        return max(0.0, lanes[0] - now)
