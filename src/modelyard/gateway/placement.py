"""Models placed by the scheduler: the gateway follows its feed (docs/placement.md).

`PlacedModels.apply` turns each feed event into cluster changes, in one step with no await between
(a request sees the placed set before an event or after it, never half of a snapshot):
- a model with endpoints is a cluster built from `placement.models` with the gateway's default
  strategy (a new one; `Gateway.default_strategy`) or the same cluster
  with its endpoints replaced (`Cluster.replace_endpoints`: endpoints that stay keep their health,
  outlier record and load; queued requests look again);
- a model with none leaves `gateway.clusters` (requests get ModelNotPlaced: 503, Retry-After, its
  state and reason); its cluster is parked, so it comes back with its counters and any strategy
  or routes an admin set;
- `removed`, or absence from a snapshot, forgets it (404 again); requests in flight finish.
A model the gateway's own config names keeps its config; the scheduler's entry is ignored.

During a rollout the entry names two versions with their shares: each version's endpoints become a
subset `v<N>` and a route `rollout` (no match, weighted destinations, the canary machinery) splits
the requests between them, so answers say `X-Modelyard-Route: rollout` and `X-Modelyard-Subset: v<N>`.
The routes an admin had set are put aside meanwhile and come back, with the endpoints back in
subset `default`, once the entry names one version again; routes set during the split (they can
only name `v<N>` subsets) last until the next entry. The strategy is kept throughout: it picks
within the subset a request was sent to.

`FeedFollower` keeps the feed connected: on a break the last endpoints keep serving, and it
reconnects with exponential backoff and jitter; the snapshot that starts every connection resyncs.
It sends `placement.token_file`'s token (role read) and verifies an https scheduler with
`placement.tls`; files that cannot be used stop the gateway's start (ConfigError naming the file).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from modelyard.config import (
    Destination,
    EndpointConfig,
    ModelConfig,
    PlacementConfig,
    RouteConfig,
    TlsClientConfig,
)
from modelyard.errors import ModelNotPlaced, SchedulerUnavailable
from modelyard.gateway.cluster import Cluster
from modelyard.protocols.feed import FeedEvent, ModelChanged, ModelRemoved, PlacedModel, Snapshot
from modelyard.security.tls import ClientTls
from modelyard.upstream.feed import FeedClient

if TYPE_CHECKING:
    from modelyard.gateway.gateway import Gateway

log = logging.getLogger("modelyard.gateway.placement")


class PlacedModels:
    def __init__(self, gateway: Gateway, config: PlacementConfig) -> None:
        self._gateway = gateway
        self._config = config
        self._configured = {m.name for m in gateway.config.models}
        self._shadowed: set[str] = set()  # configured names the scheduler also places (logged once)
        self.models: dict[str, PlacedModel] = {}  # the scheduler's latest entry for each placed model
        self._parked: dict[str, Cluster] = {}  # placed models with no endpoint now
        self._set_aside: dict[str, list[RouteConfig]] = {}  # admin routes, while a rollout splits

    def not_placed(self, name: str) -> ModelNotPlaced | None:
        """The error for a model the scheduler knows but that has no endpoint to route to."""
        model = self.models.get(name)
        if model is None or name in self._gateway.clusters:
            return None
        return ModelNotPlaced(name, model.state, model.reason, self._config.retry_after)

    def apply(self, event: FeedEvent) -> None:
        if isinstance(event, Snapshot):
            for problem in event.problems:
                log.warning("scheduler feed: snapshot entry left out: %s", problem)
            present = {m.name for m in event.models}
            for name in [n for n in self.models if n not in present]:
                self._forget(name)
            for model in event.models:
                self._update(model)
        elif isinstance(event, ModelChanged):
            self._update(event.model)
        elif isinstance(event, ModelRemoved):
            self._forget(event.name)
        else:
            return
        self._gateway.forget_unused_loads()

    def parked(self) -> list[Cluster]:
        """The clusters of placed models with no endpoint now, kept for when they come back."""
        return list(self._parked.values())

    def view(self) -> dict[str, Any]:
        routable = sorted(n for n in self.models if n in self._gateway.clusters)
        waiting = {n: m.state for n, m in sorted(self.models.items()) if n not in self._gateway.clusters}
        return {"routable": routable, "not_available": waiting}

    def _update(self, model: PlacedModel) -> None:
        name = model.name
        if name in self._configured:
            if name not in self._shadowed:
                self._shadowed.add(name)
                log.warning(
                    "model %s is in the gateway's config and placed by the scheduler: the config wins", name
                )
            return
        self.models[name] = model
        endpoints, split = self._endpoints(model)
        gateway = self._gateway
        installed = gateway.clusters.get(name)
        if not endpoints:
            if installed is not None:
                log.info("model %s has no endpoint now (%s): requests get 503", name, model.state)
                gateway.withdraw(name)
                installed.replace_endpoints([])  # queued requests look again, and find none
                self._parked[name] = installed
            return
        cluster = installed or self._parked.pop(name, None)
        where = ", ".join(f"{e.name} {e.url}" for e in endpoints)
        if cluster is None:
            routes = [split] if split is not None else []
            if split is not None:
                self._set_aside[name] = []  # no admin routes to restore: the split's route just ends
            cluster = gateway.new_cluster(self._model_config(name, endpoints, routes))
            log.info("model %s placed: %s", name, where)
        else:
            before = {(e.name, e.url, e.subset) for e in cluster.endpoints}
            cluster.replace_endpoints(endpoints, self._routes(name, cluster, split))
            if before != {(e.name, e.url, e.subset) for e in endpoints}:
                log.info("model %s %s: %s", name, "placed again" if installed is None else "now at", where)
        if split is not None:
            shares = ", ".join(f"{d.subset} {d.weight}%" for d in split.destinations)
            log.info("model %s is rolling out: traffic split %s", name, shares)
        if installed is None:
            gateway.install(cluster)

    def _routes(self, name: str, cluster: Cluster, split: RouteConfig | None) -> list[RouteConfig] | None:
        """The routes the cluster takes with this entry (None: keep its own): the rollout route
        while versions are split, the admin's (set aside when the split began) once it ends."""
        if split is not None:
            if name not in self._set_aside:
                self._set_aside[name] = list(cluster.config.routes)
            return [split]
        if name in self._set_aside:
            log.info("model %s serves one version again: the split ends", name)
            return self._set_aside.pop(name)
        return None

    def _forget(self, name: str) -> None:
        if self.models.pop(name, None) is None:
            return
        parked = self._parked.pop(name, None)
        self._set_aside.pop(name, None)
        cluster = self._gateway.clusters.get(name)
        if name in self._configured:
            return
        if cluster is not None or parked is not None:
            log.info("model %s was removed by the scheduler: requests get 404", name)
        if cluster is not None:
            self._gateway.withdraw(name)
            cluster.replace_endpoints([])

    def _endpoints(self, model: PlacedModel) -> tuple[list[EndpointConfig], RouteConfig | None]:
        """The model's endpoints, and while a rollout splits its traffic, the route that does it
        (each version's endpoints in subset `v<N>`); endpoints the gateway cannot use are left out."""
        split = model.split
        endpoints: dict[str, EndpointConfig] = {}
        for endpoint in model.endpoints:
            subset = f"v{endpoint.version}" if split else "default"
            try:
                config = EndpointConfig(url=endpoint.url, name=endpoint.name, subset=subset)
            except ValidationError as exc:
                log.warning("model %s: endpoint %s left out: %s", model.name, endpoint.url, _first(exc))
                continue
            endpoints.setdefault(config.name, config)  # names key health and outlier state
        if not split:
            return list(endpoints.values()), None
        served = {e.subset for e in endpoints.values()}
        destinations = [
            Destination(subset=f"v{v.version}", weight=v.weight)
            for v in model.versions
            if f"v{v.version}" in served
        ]
        if len(destinations) < 2:  # one version left with usable endpoints: no split
            only = [e.model_copy(update={"subset": "default"}) for e in endpoints.values()]
            return only, None
        return list(endpoints.values()), RouteConfig(name="rollout", destinations=destinations)

    def _model_config(
        self, name: str, endpoints: list[EndpointConfig], routes: list[RouteConfig]
    ) -> ModelConfig:
        # placement.models, but the strategy is the gateway's default (a switch for every model sets it).
        settings = {**dict(self._config.models), "strategy": self._gateway.default_strategy}
        return ModelConfig(name=name, endpoints=endpoints, routes=routes, **settings)


class FeedFollower:
    """The task that reads the feed and applies it; `synced` once a snapshot has been applied."""

    def __init__(self, placed: PlacedModels, config: PlacementConfig, rng: random.Random) -> None:
        assert config.scheduler is not None
        self._placed = placed
        self._config = config
        self._rng = rng
        self._client = FeedClient(
            config.scheduler,
            connect_timeout=config.connect_timeout,
            ping_timeout=config.ping_timeout,
            token_file=config.token_file or "",
            tls=ClientTls(config.tls or TlsClientConfig()) if config.scheduler.startswith("https:") else None,
            allow_plain_token=config.allow_plain_token,
        )
        self._task: asyncio.Task[None] | None = None
        self._first_snapshot = asyncio.Event()
        self.connected = False
        self.reconnects = 0
        self.last_error = ""

    @property
    def synced(self) -> bool:
        return self._first_snapshot.is_set()

    async def start(self) -> None:
        """Start following; wait up to `startup_wait` for the first snapshot, so that a gateway
        starting beside a running scheduler serves its models from the first request."""
        self._task = asyncio.create_task(self._follow(), name="placement-feed")
        try:
            async with asyncio.timeout(self._config.startup_wait):
                await self._first_snapshot.wait()
        except TimeoutError:
            config = self._config
            log.warning(
                "no snapshot from the scheduler at %s within %gs; serving without placed models "
                "until it comes (%s)", config.scheduler, config.startup_wait, self.last_error or "no answer",
            )  # fmt: skip

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.close()

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                async for event in self._client.events():
                    if isinstance(event, Snapshot):
                        if not self.connected:
                            log.info(
                                "following the scheduler at %s (%d models)",
                                self._config.scheduler,
                                len(event.models),
                            )
                        self.connected, failures = True, 0
                        self._placed.apply(event)
                        self._first_snapshot.set()
                    elif self.connected:  # only after a snapshot: an update to nothing is meaningless
                        self._placed.apply(event)
            except SchedulerUnavailable as exc:
                self.last_error = exc.message
            except Exception as exc:  # a bug here must not stop the gateway following for good
                log.exception("scheduler feed: unexpected error")
                self.last_error = f"unexpected error: {exc!r}"
            if self.connected:
                log.warning(
                    "scheduler feed lost (%s); keeping the last endpoints and reconnecting", self.last_error
                )
                self.connected = False
            failures += 1
            self.reconnects += 1
            await asyncio.sleep(reconnect_delay(failures, self._config, self._rng))


def reconnect_delay(failures: int, config: PlacementConfig, rng: random.Random) -> float:
    """Exponential backoff with equal jitter: half the capped delay, plus up to as much again. Never
    zero (a scheduler that drops every connection at once must not be hammered), and gateways that
    lost the same scheduler spread their reconnects."""
    cap = min(config.reconnect_max_interval, config.reconnect_base_interval * 2.0 ** min(failures - 1, 30))
    return cap / 2 + rng.uniform(0, cap / 2)


def _first(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return str(error["msg"]).removeprefix("Value error, ")
