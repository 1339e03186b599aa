"""A cluster (Envoy's word): one model's endpoints and everything the request path keeps about them.

The cluster owns its counters and states; the request path asks and reports through its methods,
never writes them itself:
- endpoints, by subset; `replace_endpoints` swaps them in one assignment (a health check, and
  later the scheduler's feed, change the set while requests run on the old one);
- routes, replaced atomically at runtime, and the balancer (balancing/balancer.py: the strategy
  and what it learns), which the request path drives;
- load: `acquire`/`release` an endpoint slot, with the circuit breakers' queue (capacity.py);
- the retry budget: `request_started`/`ended`, `retry_started`/`ended` (cluster/budget.py);
- health: active probes, connection failures and outlier ejection (cluster/outlier.py) decide
  which endpoints are routable; an endpoint taken out has its tries that are still waiting for
  an answer aborted, so they can be retried elsewhere instead of stalling on a hung server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from modelyard.balancing.balancer import Balancer
from modelyard.balancing.routes import (
    ALL_SUBSETS,
    IMPLICIT_ROUTE,
    CompiledRoute,
    compile_routes,
    select_route,
    validate_routes,
)
from modelyard.balancing.tokens import PromptTokens, TokenizerError
from modelyard.cluster import Abortable, BackendLoad, Endpoint, HealthThresholds, Load, observe
from modelyard.cluster.budget import RetryBudget
from modelyard.cluster.canary import CanaryStats
from modelyard.cluster.health import ejected, passed
from modelyard.cluster.outlier import OutlierState, adopt, decide, routable
from modelyard.cluster.outlier import observe as observe_outcome
from modelyard.config import EndpointConfig, ModelConfig, RouteConfig, TlsClientConfig
from modelyard.errors import ConfigError, EndpointTakenOut, NotFound
from modelyard.gateway.capacity import CapacityQueue
from modelyard.upstream.pool import UpstreamTls

log = logging.getLogger("modelyard.gateway")

HealthListener = Callable[[str, str, bool], None]  # (model, endpoint, healthy)
OutlierListener = Callable[[str, str, str], None]  # (model, endpoint, event)
_NEVER_EJECTED = OutlierState()


def _prompt_tokens(config: ModelConfig) -> PromptTokens | None:
    """prefix_aware's precise mode: the model's tokenizer, read once here (ConfigError naming the
    model and the file when it cannot be)."""
    settings = config.prefix_aware
    if not settings.tokenizer:
        return None
    try:
        return PromptTokens.load(settings.tokenizer, settings.chat_template or None)
    except TokenizerError as exc:
        raise ConfigError(f"model {config.name!r}", [f"prefix_aware.{exc.field}: {exc}"]) from None


class Cluster:
    def __init__(
        self,
        config: ModelConfig,
        loads: dict[str, Load],
        on_health_change: HealthListener = lambda model, endpoint, healthy: None,
        on_outlier: OutlierListener = lambda model, endpoint, event: None,
        new_load: Callable[[str, str], Load] = BackendLoad,
        on_refused: Callable[[Cluster, Endpoint], None] | None = None,
        on_ejected: Callable[[Cluster, Endpoint], None] | None = None,
        tls_url: Callable[[str, TlsClientConfig | None], str] | None = None,
    ) -> None:
        self.config = config
        # The URL requests go to: an https:// or grpcs:// URL with TLS settings of its own (the
        # endpoint's, else the model's) carries them, so the gateway's clients keep its
        # connections apart; the others get upstream.tls. (Files checked here: a TlsError.)
        self._tls_url = tls_url if tls_url is not None else UpstreamTls(None).url
        self.name = config.name
        self._loads = loads  # shared by every cluster: a server's load is the sum over its models
        self._new_load = new_load  # (url, name) -> the load of a server no cluster used yet
        self._on_health_change = on_health_change
        self._on_outlier = on_outlier
        self._on_refused = on_refused  # after record_connection_failure: told to the other workers
        self._on_ejected = on_ejected  # after this worker's outlier detection ejects: told to the others
        # The strategy and what it learns (prefix_aware's index, flights and service time); kept
        # across strategy switches, so a switch back finds what it learnt.
        self.balancer = Balancer(config, tokens=_prompt_tokens(config))
        self.seq = 0  # requests routed so far; kept across strategy switches (round_robin's position)
        self.budget = RetryBudget(config.retry_budget)
        self.capacity = CapacityQueue(config.name, config.circuit_breakers)
        check = config.health_check
        self.health_checked = check.interval > 0
        self.thresholds = HealthThresholds(check.unhealthy_threshold, check.healthy_threshold)
        self.outliers: dict[str, OutlierState] = {}
        self._next_return = float("inf")  # the earliest ejected_until, so routing checks it cheaply
        self._outcomes = 0
        self._last_decide = 0.0
        self.panicking: set[str] = set()  # subsets in panic mode
        # `routable`'s answer per subset, until health, an ejection or the endpoints change
        # (`_reroute`): most requests find the same endpoints as the one before.
        self._routable: dict[str, tuple[Endpoint, ...]] = {}
        self._canary: dict[str, CanaryStats] = {}
        self._awaiting: dict[Endpoint, set[Abortable]] = {}  # tries sent, no answer byte yet
        self.endpoints: tuple[Endpoint, ...] = ()
        self.endpoint_names: tuple[str, ...] = ()  # (what the balancer looks up, made once per update)
        self.speaks_grpc = False  # an endpoint has a grpc_url: OIP gRPC calls may be relayed as gRPC
        self._subsets: dict[str, tuple[Endpoint, ...]] = {}
        self._vanished: set[str] = set()  # subsets an endpoint update removed (see vanished_subset)
        self.routes: tuple[CompiledRoute, ...] = compile_routes(config.routes)
        self.replace_endpoints(config.endpoints)

    # --- endpoints ------------------------------------------------------------------------------

    def replace_endpoints(
        self, configs: Sequence[EndpointConfig], routes: Sequence[RouteConfig] | None = None
    ) -> None:
        """Swap in a new set of endpoints. An endpoint that stays (same name and URL) keeps its
        health, outlier record and scraped load, and its settings are updated; requests already
        running finish on what they hold; requests waiting for room look again.

        `routes`, when given, replace the routes in the same step, unvalidated: the caller (the
        scheduler's feed, splitting a rollout between version subsets) builds them to match."""
        if routes is not None:
            self.config = self.config.model_copy(update={"routes": list(routes)})
            self.routes = compile_routes(self.config.routes)
        current = {(e.name, e.url): e for e in self.endpoints}
        endpoints = []
        for c in configs:
            tls = c.tls or self.config.tls
            url = self._tls_url(c.url, tls)
            kept = current.get((c.name, url))
            if kept is None:
                load = self._loads.get(c.url)  # a server's load, by its URL, whatever the TLS
                if load is None:
                    load = self._loads[c.url] = self._new_load(c.url, c.name)
                kept = Endpoint(c.name, url, load)
            kept.weight, kept.cost_per_1k_tokens, kept.subset = c.weight, c.cost_per_1k_tokens, c.subset
            kept.metrics_url, kept.gpu_metrics_url = c.metrics_url, c.gpu_metrics_url
            kept.grpc_url = self._tls_url(c.grpc_url, tls)
            endpoints.append(kept)
        stayed = {e.name for e in endpoints if (e.name, e.url) in current}
        subsets: dict[str, list[Endpoint]] = {}
        for endpoint in endpoints:
            subsets.setdefault(endpoint.subset, []).append(endpoint)
        self.config = self.config.model_copy(update={"endpoints": list(configs)})
        self.outliers = {
            e.name: self.outliers[e.name] if e.name in stayed else OutlierState() for e in endpoints
        }
        # Tries still running on a removed endpoint finish as they are; nobody aborts them now.
        self._awaiting = {e: f for e, f in self._awaiting.items() if e in endpoints}
        # A new endpoint, or the same name at another URL, starts with nothing cached.
        self.balancer.keep_only(stayed)
        self.endpoints = tuple(endpoints)
        self.endpoint_names = tuple(e.name for e in endpoints)
        self.speaks_grpc = any(e.grpc_url for e in endpoints)
        self._vanished = (self._vanished | set(self._subsets)) - set(subsets)
        self._subsets = {name: tuple(group) for name, group in subsets.items()}
        self._subsets[ALL_SUBSETS] = self.endpoints
        self._reroute()
        self.capacity.wake_all()
        for route in self.config.routes:
            named = [d.subset for d in route.destinations] + ([route.mirror.subset] if route.mirror else [])
            missing = sorted({s for s in named if s not in self._subsets})
            if missing:
                log.warning(
                    "model %s: route %s names subsets with no endpoint now: %s; its requests get 503",
                    self.name, route.name, ", ".join(missing),
                )  # fmt: skip

    def vanished_subset(self, name: str) -> bool:
        """Whether `name` had endpoints until an endpoint update took the subset away (a placed
        model's rollout split beginning or ending renames its subsets). A request routed to it,
        waiting for room or about to retry, goes to all the model's endpoints instead of failing;
        a subset that never had endpoints (a route naming a typo) still gets 503."""
        return name in self._vanished

    def subset(self, name: str) -> tuple[Endpoint, ...]:
        return self._subsets.get(name, ())

    @property
    def subset_names(self) -> list[str]:
        return sorted(name for name in self._subsets if name != ALL_SUBSETS)

    # --- routes and strategy --------------------------------------------------------------------

    def route_for(self, headers: Mapping[str, str], body: Mapping[str, object] | None) -> RouteConfig:
        """The request's route: the first that matches; the implicit route of a model without
        routes; NotFound when the model has routes and none matches."""
        routes = self.routes
        if not routes:
            return IMPLICIT_ROUTE
        route = select_route(routes, headers, self.name, body)
        if route is None:
            raise NotFound(
                f"no route of model {self.name!r} matches this request; routes: "
                + ", ".join(r.name for r in routes)
            )
        return route.config

    def replace_routes(self, raw: object) -> None:
        """Validate new routes against this model and swap them in atomically (a request keeps the
        routes it started with); raises RoutesInvalid with every problem."""
        self.config = validate_routes(self.config, raw)
        self.routes = compile_routes(self.config.routes)

    def set_strategy(self, name: object) -> None:
        """Switch to a new strategy built with this model's parameters (UnknownStrategy if none)."""
        self.balancer.switch(name)

    def next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    # --- load -----------------------------------------------------------------------------------

    def acquire(self, endpoint: Endpoint, tokens: int) -> None:
        """Count a try on `endpoint` (the balancer hears of it from the attempt loop)."""
        endpoint.load.acquire(tokens)
        endpoint.model_in_flight += 1

    def release(self, endpoint: Endpoint, tokens: int, key: int = 0) -> None:
        """The try under `key` (its exchange) on `endpoint` ended: its slot is free."""
        endpoint.load.release(tokens)
        endpoint.model_in_flight -= 1
        if self.balancer.flights:  # (prefix_aware's; none kept by the others)
            self.balancer.on_ended(endpoint.name, key)
        if len(self.capacity):
            self.capacity.wake(endpoint.subset)

    # --- tries waiting for an answer --------------------------------------------------------------

    def awaiting_answer(self, endpoint: Endpoint, flight: Abortable) -> None:
        self._awaiting.setdefault(endpoint, set()).add(flight)

    def answered(self, endpoint: Endpoint, flight: Abortable) -> None:
        waiting = self._awaiting.get(endpoint)
        if waiting is not None:
            waiting.discard(flight)

    def _abort_awaiting(self, endpoint: Endpoint, why: str) -> None:
        flights = self._awaiting.pop(endpoint, None)
        if flights:
            log.warning(
                "model %s: %d request(s) waiting on %s are retried elsewhere if their route allows: %s",
                self.name, len(flights), endpoint.name, why,
            )  # fmt: skip
            for flight in flights:  # an error each: tasks must not share one traceback
                flight.abort(EndpointTakenOut(f"{endpoint.name} was taken out before it answered: {why}"))

    # --- health: active probes, connection failures, outlier detection, panic -----------------------

    @property
    def ready(self) -> bool:
        return any(e.health.healthy for e in self.endpoints)

    def routable(self, subset: str, now: float) -> Sequence[Endpoint]:
        """The endpoints of `subset` to route to: passing health checks and not ejected; below
        `healthy_panic_threshold` percent of the subset, all of it (Envoy's panic mode), unless
        none at all is available (then none: the request gets 503 at once). Read-only: the same
        tuple for every request until something changes it."""
        if now >= self._next_return:
            self._decide(now)
        kept = self._routable.get(subset)
        if kept is not None:
            return kept
        pool = self.subset(subset)
        outliers = self.outliers
        available = [e for e in pool if e.health.healthy and not outliers[e.name].ejected]
        if not available:
            self._routable[subset] = ()
            return ()  # nothing passes: answer 503 at once rather than try endpoints known to be down
        chosen, panic = routable(available, pool, self.config.healthy_panic_threshold)
        kept = self._routable[subset] = tuple(chosen)
        if panic != (subset in self.panicking):
            log.warning(
                "model %s: subset %s %s panic mode", self.name, subset, "entering" if panic else "leaving"
            )
            if panic:
                self.panicking.add(subset)
                self._on_outlier(self.name, "", "panic")
            else:
                self.panicking.discard(subset)
        return kept

    def record_outcome(self, endpoint: Endpoint, ok: bool, latency: float | None, now: float) -> None:
        """An answer (or a failure to get one) from `endpoint`; may eject it, or a slow peer."""
        state = self.outliers.get(endpoint.name)
        if state is None:
            return  # replaced while the request ran
        detection = self.config.outlier_detection
        self.outliers[endpoint.name] = observe_outcome(
            state, ok=ok, latency=latency, now=now, config=detection
        )
        self._outcomes += 1
        # Errors are judged at once; latency every 64 answers or every second, whichever comes first.
        if not ok or self._outcomes % 64 == 0 or now - self._last_decide >= 1.0:
            self._decide(now)

    def _reroute(self) -> None:
        """What routes where has changed (health, an ejection or its end, the endpoints)."""
        self._routable.clear()

    def _decide(self, now: float) -> None:
        self._last_decide = now
        self._reroute()
        adopted = {name for name, state in self.outliers.items() if state.adopted}
        decision = decide(self.outliers, now, self.config.outlier_detection)
        self.outliers = dict(decision.states)
        by_name = {e.name: e for e in self.endpoints} if decision.ejected else {}
        for ejection in decision.ejected:
            log.warning(
                "model %s: ejecting endpoint %s (%s) for %.1fs",
                self.name, ejection.name, ejection.reason, ejection.until - now,
            )  # fmt: skip
            self._on_outlier(self.name, ejection.name, ejection.reason)
            self._abort_awaiting(by_name[ejection.name], f"ejected ({ejection.reason})")
            if self._on_ejected is not None:
                self._on_ejected(self, by_name[ejection.name])
        for name in decision.returned:
            if name in adopted:  # another worker's ejection: it logs and counts the return
                log.debug("model %s: endpoint %s returns from another worker's ejection", self.name, name)
                continue
            log.info("model %s: endpoint %s returns from ejection", self.name, name)
            self._on_outlier(self.name, name, "returned")
        untils = [s.ejected_until for s in self.outliers.values() if s.ejected_until is not None]
        self._next_return = min(untils, default=float("inf"))

    def adopt_ejection(self, name: str, until: float, ejections: int, now: float) -> bool:
        """Another worker of this gateway ejected endpoint `name` until `until` (monotonic time,
        which every process of the machine shares): out here too, unless the policy says no
        (`outlier.adopt`). Counted in metrics by the worker that decided, not here. False when
        only `max_ejection_percent` kept it in: worth asking again once an ejection here ends."""
        states = adopt(self.outliers, name, until, ejections, now, self.config.outlier_detection)
        if states is None:
            state = self.outliers.get(name)
            return (
                state is None
                or until <= now
                or not self.config.outlier_detection.enabled
                or (state.ejected_until is not None and state.ejected_until >= until)
            )
        self.outliers = states
        self._reroute()
        self._next_return = min(self._next_return, until)
        log.info("model %s: endpoint %s ejected by another worker for %.1fs", self.name, name, until - now)
        endpoint = next((e for e in self.endpoints if e.name == name), None)
        if endpoint is not None:
            self._abort_awaiting(endpoint, "ejected by another worker")
        return True

    def record_probe(self, endpoint: Endpoint, error: str) -> None:
        """Apply one active health check's result ("" when it passed)."""
        before = endpoint.health.healthy
        endpoint.health = observe(endpoint.health, not error, self.thresholds, error)
        self._reroute()
        self._transition(endpoint, before)

    def adopt_health(self, endpoint: Endpoint, healthy: bool, error: str) -> None:
        """Take the verdict another worker's probe reached (the leader probes for every worker of a
        gateway): routing and aborts follow it here; the leader logs and counts the transition."""
        before = endpoint.health.healthy
        if healthy == before and endpoint.health.checked:
            return
        endpoint.health = passed() if healthy else ejected(error)
        self._reroute()
        if before and not healthy:
            self._abort_awaiting(endpoint, error or "unhealthy")

    def record_connection_failure(self, endpoint: Endpoint, error: str) -> None:
        """A connection refused (nothing listens there): the endpoint is out until a probe brings
        it back. Without active checks nothing would bring it back, so then it only counts as a
        failure for outlier detection."""
        if not self.health_checked:
            return
        before = endpoint.health.healthy
        endpoint.health = ejected(error)
        self._reroute()
        self._transition(endpoint, before)
        if self._on_refused is not None:
            self._on_refused(self, endpoint)

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
            self._abort_awaiting(endpoint, endpoint.health.last_error or "unhealthy")

    # --- canary ---------------------------------------------------------------------------------

    def canary_stats(self, route: str) -> CanaryStats:
        stats = self._canary.get(route)
        if stats is None:
            stats = self._canary[route] = CanaryStats()
        return stats

    def canary_summary(self) -> dict[str, object]:
        return {route: stats.summary() for route, stats in self._canary.items()}

    # --- the overview ---------------------------------------------------------------------------

    def describe(self, now: float) -> dict[str, Any]:
        """This model as `/admin/overview` shows it: its strategy, routes and load, and per endpoint
        its health, in-flight, ejection and circuit state; read only, a fresh dict each call.
        `now` is monotonic time (ejections end at a monotonic instant)."""
        return {
            "name": self.name,
            "strategy": self.balancer.strategy.name,
            "ready": self.ready,
            "routes": [route.name for route in self.config.routes],
            "panic_subsets": sorted(self.panicking),
            "queued": len(self.capacity),
            "max_pending_requests": self.capacity.config.max_pending_requests,
            "active_requests": self.budget.active,
            "retries_in_flight": self.budget.retrying,
            "endpoints": [self._describe_endpoint(e, now) for e in self.endpoints],
        }

    def _describe_endpoint(self, endpoint: Endpoint, now: float) -> dict[str, Any]:
        health = endpoint.health
        outlier = self.outliers.get(endpoint.name, _NEVER_EJECTED)
        until = outlier.ejected_until
        return {
            "name": endpoint.name,
            "url": endpoint.url,
            "grpc_url": endpoint.grpc_url or None,
            "subset": endpoint.subset,
            "weight": endpoint.weight,
            "health": {
                "status": "healthy" if health.healthy else "unhealthy",
                "checked": health.checked,
                "last_error": health.last_error,
            },
            "in_flight": endpoint.in_flight,  # the server's, over every model it serves here
            "model_in_flight": endpoint.model_in_flight,
            "outstanding_tokens": endpoint.outstanding_tokens,
            "ejection": {
                "ejected": outlier.ejected,
                "seconds_left": None if until is None else round(max(0.0, until - now), 3),
                "ejections": outlier.ejections,
                "consecutive_failures": outlier.consecutive_failures,
            },
            # Envoy's circuit breaker: open while the endpoint has max_requests in flight (0: no limit).
            "circuit": {
                "state": "closed" if self.capacity.has_room(endpoint) else "open",
                "max_requests": self.capacity.config.max_requests,
            },
            "routable": health.healthy and not outlier.ejected,
            # prefix_aware's precise mode: what its KV events say (null: the endpoint has none)
            "kv_events": None if self.balancer.kv is None else self.balancer.kv.describe(endpoint.name, now),
        }
