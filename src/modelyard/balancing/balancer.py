"""`Balancer`: one model's routing decisions and what they learn, in one owner.

It holds the model's strategy and, for prefix_aware, what that strategy learns from the traffic:
the prefix index (what each endpoint was sent), the flights (what each endpoint has running, and
for how long), and the service model (seconds per uncached prompt character). The gateway drives
it around each request, and `benchmarks/routing_sim.py` drives the same object in virtual time,
so what the simulator argues about routing is what the gateway does:

    view = balancer.look(prompt, endpoint_names, now, body) # before a pick (prefix_aware only)
    pick = balancer.pick(endpoints, ctx, rng)
    sample = balancer.on_sent(endpoint, key, ctx, now)      # a try is sent
    balancer.on_ended(endpoint, key)                         # that try ended, however
    balancer.on_cached(endpoint, view.chunks)                # a 2xx answer: the server holds it now
    balancer.on_served(sample, now)                          # the answer was whole (learns its time)

Precise mode: given the model's tokenizer (`tokens`), the balancer also keeps `kv`, the blocks each
endpoint says it holds (balancing/kv_events.py); where an endpoint's index is usable, `look` takes
what it holds from there instead of from the approximate index (which goes on learning, for the
endpoints and the moments it is not usable).

Pure (DESIGN.md habit 1): time and randomness are arguments; the I/O of sharing what it learns
(Redis, the workers' rings, the KV-event subscriptions) is the gateway's
(gateway/prefix_sharing.py, gateway/kv_subscriber.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from modelyard.balancing.kv_events import REBUILDING, KvIndex, block_keys
from modelyard.balancing.prefix import Flights, PrefixIndex, RecentQuantile, ServiceModel
from modelyard.balancing.strategies import Need, Pick, PromptBlocks, RoutingContext, Strategy, build_strategy
from modelyard.cluster import EndpointView
from modelyard.config import ModelConfig

if TYPE_CHECKING:
    from modelyard.balancing.tokens import PromptTokens


# Precise mode tokenizes prompts up to this many characters (about 0.1 s of a tokenizer's time on
# the event loop); longer ones are routed approximately.
PRECISE_MAX_CHARS = 200_000


class PrefixView(NamedTuple):
    """What prefix_aware is given for one prompt: its chunk names, how many leading chunks each
    endpoint holds, and, once the service time is learnt, each endpoint's queue, the line
    (seconds per uncached character, base seconds, the median time of a request that started at
    once) and, when some endpoint has a queue, the free endpoints a cold start of this prompt
    would not hurt (`roomy`: the tail guard's, see `look`)."""

    chunks: list[int]
    held: dict[str, int]
    waits: dict[str, float] | None
    line: tuple[float, float, float] | None
    roomy: frozenset[str] | None
    tokens: PromptBlocks | None  # precise mode: the prompt's token ids and block keys (on_sent's)


# A sent try's sample for the service model: (uncached prompt characters, when it was sent,
# whether the endpoint was idle then: only those time the server and not a queue; when it was
# expected to end, -1.0 if the line was not learnt yet).
Sample = tuple[int, float, bool, float]


class Balancer:
    def __init__(
        self, model: ModelConfig, strategy: object | None = None, tokens: PromptTokens | None = None
    ) -> None:
        self.model = model
        settings = model.prefix_aware
        self._chunk_chars = settings.chunk_chars
        self._slots = settings.slots
        # Kept across strategy switches, so a switch back finds what it learnt.
        self.prefixes = PrefixIndex(settings.chunk_chars, settings.max_chunks_per_endpoint)
        self.service = ServiceModel()
        self.flights = Flights()
        # How much later than expected tries end (over tries sent once the line was learnt): the
        # line gives mean times, an answer's length is not known, and what the index says an
        # endpoint holds is a guess. A full endpoint's wait adds it, so a queue whose flights look
        # over is not taken to be free. The 65th percentile: a little above the median, as the
        # queue that looks shortest among guesses is more often a guess too short (at the median,
        # 200-token answers of +-80% had a mean 1.03x least_pending's on routing_sim.py's grid);
        # not a high one, which a few evicted prompts make large and which then kept requests
        # from short queues that paid (at the 90th, 46% of prompt tokens cached fell to 33%).
        self.lateness = RecentQuantile(0.65)
        # Precise mode: the tokenizer and what the endpoints' KV events say they hold.
        self.tokens = tokens
        self.kv = KvIndex(settings.kv_max_blocks, settings.kv_stale_after) if tokens is not None else None
        self._use(build_strategy(model.strategy if strategy is None else strategy, model))

    def switch(self, name: object) -> None:
        """Use another strategy, built with this model's parameters (UnknownStrategy if none)."""
        self._use(build_strategy(name, self.model))

    def _use(self, strategy: Strategy) -> None:
        self.strategy = strategy
        # `pick(endpoints, ctx, rng) -> Pick`: the strategy's own, so that the request path pays
        # no call of ours for it.
        self.pick: Callable[[Sequence[EndpointView], RoutingContext, random.Random], Pick] = strategy.pick
        self.tracks = Need.PREFIX in strategy.needs  # only what needs the bookkeeping pays for it

    def look(
        self, prompt: str, names: Sequence[str], now: float, body: Mapping[str, Any] | None = None
    ) -> PrefixView:
        """What prefix_aware needs to pick for `prompt` among the endpoints `names` at `now`;
        `body`, the request's parsed body, for precise mode (the server's tokens of it)."""
        chunks = self.prefixes.chunks(prompt)
        held = self.prefixes.matches(chunks, names)
        kv = self.kv
        tokens = None
        if kv is not None and kv.endpoints and body is not None:
            tokens = self._held_precisely(held, names, now, body, len(prompt), len(chunks))
        line = self.service.line()
        waits = roomy = None
        if line is not None:
            slots = self._slots
            # A full endpoint's wait is its flights' plus how late tries end; until that is learnt
            # (8 answers after the line), a typical time: its flights are not over, which would
            # make it look free.
            late = self.lateness.value if self.lateness.learnt else line[2]
            waits = self.flights.waits(names, now, line, slots, late)
            deepest = max(held.values(), default=0)
            if deepest and any(waits.values()):
                # For the tail guard (PrefixAware): the free endpoints where a cold start of this
                # prompt would evict only chunks wanted less than what a queue would save (the
                # longest prefix held anywhere, by when it was last sent): its prefill there is
                # then paid once, as least_pending pays it. Where a cold start would push out
                # something wanted more (caches that hold one long system prompt each, or a
                # repeated question among one-off ones), a queue is weighed by its own cost.
                index = self.prefixes
                wanted = index.age(chunks[deepest - 1], names)
                roomy = frozenset(
                    n for n, w in waits.items() if not w and index.evicted_age(n, chunks, held[n]) > wanted
                )
        # (a NamedTuple's __new__ is Python)
        return tuple.__new__(PrefixView, (chunks, held, waits, line, roomy, tokens))

    def _held_precisely(
        self,
        held: dict[str, int],
        names: Sequence[str],
        now: float,
        body: Mapping[str, Any],
        chars: int,
        most: int,
    ) -> PromptBlocks | None:
        """Replace, in `held`, the approximate index's guess by what the KV events say, for each
        endpoint whose event index is usable now; where it is rebuilding (events were lost, and
        keep coming), what they say still counts where it says more than the guess (it misses
        what was lost, the guess misses what others sent). A quiet endpoint's events stopped: what
        they said may be long gone, and the guess alone counts. The blocks held, in tokens, are
        turned into the prompt's chunks pro rata (the strategy weighs uncached characters).
        Returns the prompt's token ids and block keys when there was an index to match them with
        (None: approximate), for `on_sent`."""
        kv, tokens = self.kv, self.tokens
        assert kv is not None and tokens is not None
        known = []
        for name in names:
            blocks = kv.usable(name, now)
            if blocks is not None:
                known.append((name, blocks, True))
            elif (blocks := kv.endpoints.get(name)) and blocks.state == REBUILDING and blocks.block_size:
                known.append((name, blocks, False))
        if not known or chars > PRECISE_MAX_CHARS:  # (a longer prompt would hold the event loop)
            return None
        try:
            ids = tokens.ids(body)
        except Exception:  # (precise routing never fails a request: approximate instead)
            return None
        if not ids:
            return None  # a request the gateway cannot tokenize as the server does: approximate
        keys: dict[int, list[int]] = {}
        per_chunk = len(ids) * self._chunk_chars
        for name, blocks, live in known:
            size = blocks.block_size
            assert size is not None
            named = keys.get(size)
            if named is None:
                named = keys[size] = block_keys(ids, size)
            count = min(most, blocks.match(named) * size * chars // per_chunk)
            held[name] = count if live else max(held[name], count)
        return ids, keys

    def on_sent(self, endpoint: str, key: int, ctx: RoutingContext | None, now: float) -> Sample | None:
        """A try of the request `ctx` (under `key`, its exchange) was sent to `endpoint` at `now`:
        prefix_aware keeps it among the endpoint's flights, with how long it should take there,
        and returns its sample for the service model; None for the other strategies."""
        if not self.tracks or ctx is None or ctx.prefix is None:
            return None
        if ctx.tokens is not None:  # precise mode: an endpoint rebuilding its index learns from it
            self.kv.sent(endpoint, *ctx.tokens)  # type: ignore[union-attr]
        held = ctx.prefix.get(endpoint, 0) * self._chunk_chars
        uncached = max(0, len(ctx.request.prompt) - held)
        flights, line = self.flights, ctx.service
        idle = flights.count(endpoint) < self._slots  # it starts at once
        if line is None:
            flights.start(endpoint, key, now, uncached)
            return uncached, now, idle, -1.0
        # When it should start by the flights alone: the lateness `look` adds is a margin for the
        # pick, not a time to build the next flights' starts on (they would add up).
        queued = 0.0 if idle else flights.wait(endpoint, now, line, self._slots)
        flights.start(endpoint, key, now, uncached, queued)
        return uncached, now, idle, now + queued + line[0] * uncached + line[1]

    def on_ended(self, endpoint: str, key: int) -> None:
        """The try under `key` on `endpoint` ended (answered, failed or cancelled)."""
        self.flights.end(endpoint, key)  # (kept also past a switch away, until they end)

    def on_cached(self, endpoint: str, chunks: Sequence[int]) -> None:
        """`endpoint` answered a prompt of these chunks with a 2xx: it caches them now."""
        self.prefixes.record(chunks, endpoint)
        if self.kv is not None:
            self.kv.answered(endpoint)  # (events that stop while answers go on: `KvIndex.usable`)

    def on_served(self, sample: Sample | None, now: float) -> None:
        """The answer to the try that made `sample` was relayed whole, a 200, at `now`: one that
        started on an idle endpoint times the server and teaches the service model, and one sent
        once the line was learnt teaches how late answers end (`lateness`)."""
        if sample is None:
            return
        if sample[2]:
            self.service.observe(sample[0], now - sample[1])
        if sample[3] >= 0.0:
            self.lateness.add(max(0.0, now - sample[3]))

    def keep_only(self, endpoints: Iterable[str]) -> None:
        """Only these endpoints stayed (same name and URL): a new one starts with nothing cached."""
        self.prefixes.keep_only(endpoints)
