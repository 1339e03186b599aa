"""Shadow traffic: a share of a route's requests is copied to its mirror subset in the background.
The copy's answer never reaches the client; it is compared with the primary's (exact match,
ROUGE-L) and both latencies and outcomes feed the canary summary. A copy is never retried, so a
failing canary cannot add load beyond the copy itself."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping

from modelyard.balancing.routes import mirrors
from modelyard.cluster.canary import exact_match, rouge_l
from modelyard.config import RetryPolicy
from modelyard.errors import ModelyardError
from modelyard.gateway.attempts import AttemptLoop
from modelyard.gateway.capture import Capture
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.exchange import Exchange
from modelyard.gateway.ledger import CLIENT_CLOSED, Ledger
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.telemetry import Span

log = logging.getLogger("modelyard.gateway")

_NO_RETRIES = RetryPolicy(attempts=0)


class ShadowTraffic:
    """Mirrors requests and keeps each model's canary account. `share`, with workers, is handed each
    canary event for the other workers, which `apply_canary` it: ["outcome", model, route, subset,
    seconds, ok] or ["comparison", model, route, rouge_l, exact]."""

    def __init__(
        self,
        attempts: AttemptLoop,
        ledger: Ledger,
        metrics: GatewayMetrics,
        rng: random.Random,
        share: Callable[[list[object]], None] | None = None,
    ) -> None:
        self._attempts = attempts
        self._ledger = ledger
        self._metrics = metrics
        self._rng = rng
        self._share = share
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, ex: Exchange) -> Capture | None:
        """Mirror `ex` when its route says so; returns the capture the primary's answer goes into
        (the exchange's `capture`: told when `ex` closes), or None. A request already going to the
        mirror subset has nothing to be compared with."""
        mirror = ex.route.mirror
        if mirror is None or mirror.subset == ex.subset or not mirrors(ex.route, self._rng):
            return None
        primary = Capture(ex.subset, done=asyncio.get_running_loop().create_future())
        copy = ex.shadow(ex.route.model_copy(update={"retries": _NO_RETRIES}), mirror.subset)
        span = None
        if ex.span is not None:  # the copy's own span under the request's: the canary joins it, not a try
            span = ex.span.child(
                f"shadow {ex.cluster.name}",
                "client",
                {"modelyard.shadow": True, "modelyard.subset": mirror.subset},
            )
            copy.headers = span.inject(copy.headers)
        task = asyncio.create_task(self._shadow(copy, primary, span))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return primary

    async def close(self) -> None:
        """Cancel the shadow requests still running."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shadow(self, ex: Exchange, primary: Capture, span: Span | None) -> None:
        cluster, route = ex.cluster, ex.route
        mirrored = Capture(ex.subset)
        try:
            async with asyncio.timeout(route.timeout or None):
                attempt = await self._attempts.run(ex)
                try:
                    mirrored.add(await attempt.response.read())
                    mirrored.finish(attempt.response.status, attempt.response.header("Content-Type"))
                finally:
                    self._ledger.close(ex, attempt.response.status)
        except (ModelyardError, TimeoutError) as exc:
            log.debug("model %s: shadow request to %s failed: %s", cluster.name, ex.subset, exc)
            mirrored.status = exc.status if isinstance(exc, ModelyardError) else 504
        finally:
            if span is not None:
                span.answered(mirrored.status or CLIENT_CLOSED)
                span.end()
        mirrored.seconds = time.perf_counter() - ex.started
        assert primary.done is not None
        await primary.done
        stats = cluster.canary_stats(route.name)
        for capture in (primary, mirrored):
            stats.record_outcome(capture.subset, capture.seconds, capture.ok)
            if self._share is not None:
                self._share(
                    ["outcome", cluster.name, route.name, capture.subset, capture.seconds, capture.ok]
                )
            self._metrics.canary_requests.labels(
                cluster.name, route.name, capture.subset, "ok" if capture.ok else "error"
            ).inc()
            self._metrics.canary_duration.labels(cluster.name, route.name, capture.subset).observe(
                capture.seconds
            )
        if primary.ok and mirrored.ok:
            ours, theirs = primary.text(), mirrored.text()
            if ours is not None and theirs is not None:
                rouge, exact = rouge_l(ours, theirs), exact_match(ours, theirs)
                stats.record_comparison(rouge, exact)
                if self._share is not None:
                    self._share(["comparison", cluster.name, route.name, rouge, exact])
                mean = stats.summary()["mean_rouge_l"]
                if mean is not None:
                    self._metrics.canary_agreement.labels(cluster.name, route.name).set(mean)


def apply_canary(clusters: Mapping[str, Cluster], event: list[object]) -> None:
    """A canary event another worker shared (ShadowTraffic's `share`), added to this worker's
    account as if seen here; one of an unknown model, or not well formed, is skipped."""
    match event:
        case ["outcome", str(model), str(route), str(subset), int() | float() as seconds, bool(ok)]:
            cluster = clusters.get(model)
            if cluster is not None:
                cluster.canary_stats(route).record_outcome(subset, float(seconds), ok)
        case ["comparison", str(model), str(route), int() | float() as rouge, bool(exact)]:
            cluster = clusters.get(model)
            if cluster is not None:
                cluster.canary_stats(route).record_comparison(float(rouge), exact)
