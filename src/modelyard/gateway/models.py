"""A served model: its endpoints, routes and strategy, and the counters the request path keeps
(sequence, retries in flight, requests waiting for capacity)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from pydantic import ValidationError

from modelyard.balancing import Strategy, get_strategy
from modelyard.balancing.routes import ALL_SUBSETS, CompiledRoute, compile_routes, select_route
from modelyard.cluster import BackendLoad, Endpoint, HealthThresholds, observe
from modelyard.cluster.canary import CanaryStats
from modelyard.cluster.health import ejected
from modelyard.cluster.outlier import OutlierState, decide, routable
from modelyard.cluster.outlier import observe as observe_outcome
from modelyard.config import ModelConfig, RouteConfig
from modelyard.errors import NotFound, Overloaded, RoutesInvalid

log = logging.getLogger("modelyard.gateway")


def _unknown_subsets(raw: object, subsets: set[str]) -> list[str]:
    """Subsets named by raw routes that no endpoint has; checked beside pydantic's field checks so
    that an update with several problems reports all of them (the model validator would run only
    once every field is valid)."""
    problems = []
    for i, route in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(route, dict):
            continue
        named = [d.get("subset") for d in route.get("destinations") or [] if isinstance(d, dict)]
        mirror = route.get("mirror")
        if isinstance(mirror, dict):
            named.append(mirror.get("subset"))
        for subset in named:
            if isinstance(subset, str) and subset not in subsets:
                problems.append(
                    f"routes[{i}] ({route.get('name')}): no endpoint has subset {subset!r} "
                    f"(subsets: {', '.join(sorted(subsets))})"
                )
    return problems


def _path(loc: Sequence[int | str]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


class ServedModel:
    def __init__(
        self,
        config: ModelConfig,
        loads: dict[str, BackendLoad],
        on_health_change: Callable[[str, str, bool], None] = lambda model, endpoint, healthy: None,
        on_outlier: Callable[[str, str, str], None] = lambda model, endpoint, event: None,
    ) -> None:
        self.config = config
        self._on_health_change = on_health_change
        self._on_outlier = on_outlier
        self.name = config.name
        self.strategy: Strategy = get_strategy(config.strategy)
        self.seq = 0  # requests routed so far; kept across strategy switches
        self.endpoints = [
            Endpoint(
                name=e.name,
                url=e.url,
                load=loads.setdefault(e.url, BackendLoad(e.url, e.name)),
                weight=e.weight,
                cost_per_1k_tokens=e.cost_per_1k_tokens,
                subset=e.subset,
            )
            for e in config.endpoints
        ]
        self.set_routes(config.routes)
        self.active_requests = 0  # for the retry budget
        self.active_retries = 0
        self._waiters: deque[tuple[str, asyncio.Future[None]]] = deque()  # (subset, waiter) awaiting room
        self.outliers: dict[str, OutlierState] = {e.name: OutlierState() for e in self.endpoints}
        self._next_return = float("inf")  # the earliest ejected_until, so routing checks it cheaply
        self._outcomes = 0
        self._last_decide = 0.0
        self.panicking: set[str] = set()  # subsets in panic mode
        self._canary: dict[str, CanaryStats] = {}
        check = config.health_check
        self.health_checked = check.interval > 0
        self.thresholds = HealthThresholds(check.unhealthy_threshold, check.healthy_threshold)

    # --- routes ------------------------------------------------------------------------------

    def set_routes(self, routes: Sequence[RouteConfig]) -> None:
        """Swap the routes in one assignment: a request keeps the tuple it started with."""
        self.routes: tuple[CompiledRoute, ...] = compile_routes(routes)

    def replace_routes(self, raw: object) -> None:
        """Validate new routes against this model (subsets, matches, weights) and swap them in
        atomically; raises RoutesInvalid with every problem."""
        try:
            config = ModelConfig.model_validate({**self.config.model_dump(), "routes": raw})
        except ValidationError as exc:
            unknown = _unknown_subsets(raw, {e.subset for e in self.endpoints})
            problems = list(unknown)
            for err in exc.errors():
                loc, message = err["loc"], err["msg"].removeprefix("Value error, ")
                if loc[:1] == ("routes",):
                    problems.append(f"routes{_path(loc[1:])}: {message}")
                elif not unknown:  # the model-level check repeats what `unknown` already says
                    problems.append(message)
            raise RoutesInvalid(self.name, problems) from None
        self.config = config
        self.set_routes(config.routes)

    def route_for(
        self, headers: Mapping[str, str], body: Mapping[str, object] | None
    ) -> CompiledRoute | None:
        """The request's route; None means the implicit route of a model without routes."""
        routes = self.routes
        if not routes:
            return None
        route = select_route(routes, headers, self.name, body)
        if route is None:
            raise NotFound(
                f"no route of model {self.name!r} matches this request; routes: "
                + ", ".join(r.name for r in routes)
            )
        return route

    def subset(self, name: str) -> list[Endpoint]:
        if name == ALL_SUBSETS:
            return self.endpoints
        return [e for e in self.endpoints if e.subset == name]

    # --- capacity (circuit breakers) --------------------------------------------------------

    def has_room(self, endpoint: Endpoint) -> bool:
        limit = self.config.circuit_breakers.max_requests
        return limit == 0 or endpoint.in_flight < limit

    def refuse_if_full(self) -> None:
        """Answer 429 before reading a request's body when the model could not take it anyway:
        every endpoint at `max_requests` and the wait queue full."""
        breakers = self.config.circuit_breakers
        if (
            breakers.max_requests
            and len(self._waiters) >= breakers.max_pending_requests
            and not any(self.has_room(e) for e in self.endpoints)
        ):
            raise Overloaded(
                f"model {self.name!r} is at capacity: every endpoint has max_requests in flight and "
                f"{breakers.max_pending_requests} requests already wait"
            )

    async def wait_for_room(self, subset: str, until: float) -> None:
        """Wait until an endpoint of `subset` releases a request, or until `until` (monotonic
        time, one deadline across re-waits); raises Overloaded (429 with Retry-After) when the
        queue is full or time is up. The queue is bounded by `max_pending_requests`."""
        breakers = self.config.circuit_breakers
        if len(self._waiters) >= breakers.max_pending_requests:
            raise Overloaded(
                f"model {self.name!r} is at capacity: every endpoint has max_requests in flight and "
                f"{breakers.max_pending_requests} requests already wait"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (subset, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                await waiter
        except TimeoutError:
            self._pass_on(entry)
            raise Overloaded(
                f"model {self.name!r} is at capacity: no endpoint freed up within {breakers.queue_timeout:g}s"
            ) from None
        except asyncio.CancelledError:
            self._pass_on(entry)
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _pass_on(self, entry: tuple[str, asyncio.Future[None]]) -> None:
        subset, waiter = entry
        if waiter.done() and not waiter.cancelled():
            self._wake(subset)  # woken, but leaving anyway (timed out or cancelled): the next one goes

    def queued_for(self, subset: str) -> bool:
        """Requests wait for an endpoint that a request for `subset` could also take."""
        return any(
            not waiter.done() and (subset == ALL_SUBSETS or wanted in (subset, ALL_SUBSETS))
            for wanted, waiter in self._waiters
        )

    def acquire(self, endpoint: Endpoint, tokens: int) -> None:
        endpoint.load.acquire(tokens)

    def release(self, endpoint: Endpoint, tokens: int) -> None:
        endpoint.load.release(tokens)
        if self._waiters:
            self._wake(endpoint.subset)

    def _wake(self, subset: str) -> None:
        """Wake the first waiter that an endpoint of `subset` can serve (a waiter for every
        endpoint of the model is served by any)."""
        for entry in self._waiters:
            wanted, waiter = entry
            if not waiter.done() and wanted in (subset, ALL_SUBSETS):
                self._waiters.remove(entry)
                waiter.set_result(None)
                return

    # --- retry budget -------------------------------------------------------------------------

    def retry_allowed(self) -> bool:
        """Envoy's retry budget: retries in flight stay under budget_percent of active requests
        (at least min_retry_concurrency), so retries cannot multiply an outage."""
        budget = self.config.retry_budget
        allowed = max(budget.min_retry_concurrency, budget.budget_percent / 100.0 * self.active_requests)
        return self.active_retries < allowed

    def canary_stats(self, route: str) -> CanaryStats:
        stats = self._canary.get(route)
        if stats is None:
            stats = self._canary[route] = CanaryStats()
        return stats

    def canary_summary(self) -> dict[str, object]:
        return {route: stats.summary() for route, stats in self._canary.items()}

    # --- passive health: outlier detection and the panic threshold -------------------------------

    def routable(self, subset: str, pool: Sequence[Endpoint], now: float) -> list[Endpoint]:
        """The endpoints to route to: passing health checks and not ejected; below
        `healthy_panic_threshold` percent of the pool, all of it (Envoy's panic mode), unless
        none at all is available (then none: the request gets 503 at once)."""
        if now >= self._next_return:
            self._decide(now)
        available = [e for e in pool if e.health.healthy and not self.outliers[e.name].ejected]
        if not available:
            return []  # nothing passes: answer 503 at once rather than try endpoints known to be down
        chosen, panic = routable(available, pool, self.config.healthy_panic_threshold)
        if panic != (subset in self.panicking):
            log.warning(
                "model %s: subset %s %s panic mode", self.name, subset, "entering" if panic else "leaving"
            )
            if panic:
                self.panicking.add(subset)
                self._on_outlier(self.name, "", "panic")
            else:
                self.panicking.discard(subset)
        return chosen

    def record_outcome(self, endpoint: Endpoint, ok: bool, latency: float | None, now: float) -> None:
        """An answer (or a failure to get one) from `endpoint`; may eject it, or a slow peer."""
        detection = self.config.outlier_detection
        before = self.outliers[endpoint.name]
        state = observe_outcome(before, ok=ok, latency=latency, now=now, config=detection)
        self.outliers[endpoint.name] = state
        self._outcomes += 1
        # Errors are judged at once; latency every 64 answers or every second, whichever comes first.
        if not ok or self._outcomes % 64 == 0 or now - self._last_decide >= 1.0:
            self._decide(now)

    def _decide(self, now: float) -> None:
        self._last_decide = now
        decision = decide(self.outliers, now, self.config.outlier_detection)
        self.outliers = dict(decision.states)
        for ejection in decision.ejected:
            log.warning(
                "model %s: ejecting endpoint %s (%s) for %.1fs",
                self.name, ejection.name, ejection.reason, ejection.until - now,
            )  # fmt: skip
            self._on_outlier(self.name, ejection.name, ejection.reason)
        for name in decision.returned:
            log.info("model %s: endpoint %s returns from ejection", self.name, name)
            self._on_outlier(self.name, name, "returned")
        untils = [s.ejected_until for s in self.outliers.values() if s.ejected_until is not None]
        self._next_return = min(untils, default=float("inf"))

    # --- health -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(e.health.healthy for e in self.endpoints)

    def next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def record_probe(self, endpoint: Endpoint, error: str) -> None:
        """Apply one probe result ("" when it passed)."""
        before = endpoint.health.healthy
        endpoint.health = observe(endpoint.health, not error, self.thresholds, error)
        self._transition(endpoint, before)

    def record_unreachable(self, endpoint: Endpoint, error: str) -> None:
        """A refused connection takes the endpoint out until a probe brings it back. Without
        active checks nothing would bring it back, so then it only fails this one request."""
        if not self.health_checked:
            return
        before = endpoint.health.healthy
        endpoint.health = ejected(error)
        self._transition(endpoint, before)

    def _transition(self, endpoint: Endpoint, before: bool) -> None:
        after = endpoint.health.healthy
        if after == before:
            return
        self._on_health_change(self.name, endpoint.name, after)
        if after:
            log.info("model %s: endpoint %s is healthy again", self.name, endpoint.name)
        else:
            log.warning(
                "model %s: endpoint %s is unhealthy: %s", self.name, endpoint.name, endpoint.health.last_error
            )
