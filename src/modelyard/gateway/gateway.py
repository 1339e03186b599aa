"""`Gateway`: everything one gateway instance owns, built from its config (no globals), started
and stopped with the aiohttp application."""

from __future__ import annotations

import random
import time

from aiohttp import web

from modelyard.balancing import Need
from modelyard.cluster import BackendLoad
from modelyard.config import GatewayConfig
from modelyard.errors import ModelNotFound
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.graphs import GatewayInvoker, GraphService
from modelyard.gateway.health import HealthChecker
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Proxy
from modelyard.graph import Graph, load_config_graphs
from modelyard.state import SharedState, open_state
from modelyard.upstream import UpstreamPool
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client
from modelyard.upstream.scrape import ResourceScraper


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        state: SharedState | None = None,
        seed: int | None = None,
        graphs: dict[str, Graph] | None = None,
    ) -> None:
        self.config = config
        self.loads: dict[str, BackendLoad] = {}
        self.metrics = GatewayMetrics(lambda: self.loads.values())
        self.clusters = {
            m.name: Cluster(m, self.loads, self.metrics.health_changed, self.metrics.outlier_event)
            for m in config.models
        }
        self.state = (
            state
            if state is not None
            else open_state(
                config.state,
                on_fallback=lambda _exc: self.metrics.state_fallbacks.inc(),
                on_writeback=self.metrics.state_writebacks.inc,
            )
        )
        self.pool = UpstreamPool(config.upstream)
        self.proxy = Proxy(self.pool, self.state, self.metrics, random.Random(seed))
        self.health = HealthChecker(self.clusters.values(), self.pool)
        self.scrapers: dict[str, tuple[ResourceScraper, Http1Client]] = {}
        invoker = GatewayInvoker(self.clusters, self.proxy, UrlInvoker(self.pool.client))
        self.graphs = GraphService(
            load_config_graphs(config, "config") if graphs is None else graphs,
            invoker,
            config.graph_propagate_headers,
            self.metrics.graph_step,
        )
        self.created = int(time.time())

    def cluster(self, name: str | None) -> Cluster:
        cluster = self.clusters.get(name or "")
        if cluster is None:
            raise ModelNotFound(name, self.clusters)
        return cluster

    def set_strategy(self, cluster: Cluster, name: object) -> None:
        """Switch a model's strategy at runtime, starting what the new one needs."""
        cluster.set_strategy(name)
        self._serve_needs(cluster)

    async def start(self) -> None:
        await self.health.check_once()  # serve with real health from the first request
        self.health.start()
        for cluster in self.clusters.values():
            self._serve_needs(cluster)

    async def stop(self) -> None:
        await self.health.stop()
        await self.proxy.close()
        for scraper, client in self.scrapers.values():
            await scraper.stop()
            client.close()
        await self.pool.close()
        await self.state.close()

    def _serve_needs(self, cluster: Cluster) -> None:
        """Scrape the model's endpoints' /metrics while its strategy reads their load. The scraper
        has its own small client: through the proxy's pool a scrape would queue exactly when the
        server is saturated, and its snapshot would go stale when it matters most."""
        if Need.RESOURCES not in cluster.strategy.needs or cluster.name in self.scrapers:
            return
        client = Http1Client(max_connections=2, connect_timeout=self.config.upstream.connect_timeout)
        scraper = ResourceScraper(lambda: cluster.endpoints, client, cluster.config.resource_aware)
        # Started before anything awaits, and recorded with it: a cancelled admin call can no
        # longer leave a scraper recorded but never running. Its loop scrapes at once.
        scraper.start()
        self.scrapers[cluster.name] = (scraper, client)


GATEWAY = web.AppKey("gateway", Gateway)
