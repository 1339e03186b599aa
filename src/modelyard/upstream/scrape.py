"""Scrape each endpoint's Prometheus `/metrics` into a `ResourceSnapshot` (resource_aware).

A control loop (DESIGN.md habit 2): every `scrape_interval` it fetches every endpoint's metrics
concurrently, builds a new frozen snapshot and swaps `endpoint.resources` in one assignment; the
request path only reads that reference. A failed scrape leaves the old snapshot in place: its
`taken_at` ages and the strategy drops it once it is older than `stale_after`, so one slow scrape
does not blind the router, while a dead exporter does not steer it for long.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from modelyard.cluster import Endpoint, ResourceSnapshot
from modelyard.config import ResourceAwareConfig, ResourceMetricNames
from modelyard.errors import ModelyardError
from modelyard.upstream.http1 import Http1Client, TlsUrl

log = logging.getLogger("modelyard.upstream")

Families = dict[str, list[tuple[dict[str, str], float]]]

# Ask for the classic text format: prometheus_client servers (vLLM, the sim worker) would
# otherwise be free to negotiate OpenMetrics; no Accept-Encoding, so the answer is not gzipped.
_HEADERS = (("Accept", "text/plain; version=0.0.4"),)

# Names known to be 0..100 percent whatever their value: the "values > 1 are percent" rule alone
# would read an idle GPU at 1% as fully busy.
_PERCENT_NAMES = frozenset({"DCGM_FI_DEV_GPU_UTIL"})

_NAME = re.compile(r"[ \t]*([a-zA-Z_:][a-zA-Z0-9_:]*)")  # a sample line's metric name; never a comment


def parse_prometheus(text: str, only: Collection[str] | None = None) -> Families:
    """Sample name -> [(labels, value)] from the Prometheus text format.

    Keyed by *sample* name, as exported (`req_total`, `h_bucket`), not by family name. The
    library handles comments, escaped label values, NaN/±Inf and trailing timestamps (dropped).
    Malformed text raises ValueError: a half-read exposition is worse than none.

    `only` keeps just those sample names, filtered line by line before the library parses: vLLM's
    exposition is mostly histogram buckets, and parsing all of it (~16 ms per 80 KB) would block
    the event loop the proxy runs on.
    """
    if only is not None:
        wanted = frozenset(only)
        text = "\n".join(
            line for line in text.splitlines() if (m := _NAME.match(line)) and m.group(1) in wanted
        )
    families: Families = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                families.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except Exception as exc:  # the library also raises IndexError on some malformed lines
        raise ValueError(f"malformed Prometheus text: {exc}") from exc
    return families


def _values(families: Mapping[str, Sequence[tuple[Mapping[str, str], float]]], name: str) -> list[float]:
    # NaN (an exporter's "no reading") and ±Inf would poison a sum or a score: drop them.
    return [value for _, value in families.get(name, ()) if math.isfinite(value)]


def _fraction(value: float) -> float:
    return min(1.0, max(0.0, value))


def _sm_utilization(
    families: Mapping[str, Sequence[tuple[Mapping[str, str], float]]], names: Iterable[str]
) -> float | None:
    for name in names:
        values = _values(families, name)
        if values:
            percent = name in _PERCENT_NAMES or any(v > 1.0 for v in values)
            return _fraction(sum(values) / len(values) / (100.0 if percent else 1.0))
    return None


def snapshot_from_metrics(
    families: Mapping[str, Sequence[tuple[Mapping[str, str], float]]],
    names: ResourceMetricNames,
    now: float,
    in_flight: int,
) -> ResourceSnapshot:
    """Queue and running are summed over series (vLLM exports one per model), KV cache usage is the
    fullest series of the first name present (vLLM V1's `vllm:kv_cache_usage_perc`, then V0's),
    SM use the mean over GPUs of the first name present, memory the frame buffer used over its
    total, summed over GPUs. A signal with no finite sample is None."""
    queue = _values(families, names.queue_depth)
    running = _values(families, names.running)
    kv = next((found for name in names.kv_cache_usage if (found := _values(families, name))), [])
    used, free = _values(families, names.memory_used), _values(families, names.memory_free)
    total = sum(used) + sum(free)
    return ResourceSnapshot(
        taken_at=now,
        queue_depth=sum(queue) if queue else None,
        running=sum(running) if running else None,
        kv_cache_usage=_fraction(max(kv)) if kv else None,
        sm_utilization=_sm_utilization(families, names.sm_utilization),
        memory_used=_fraction(sum(used) / total) if used and free and total > 0 else None,
        in_flight_at_scrape=in_flight,
    )


def _split_url(url: str, server: str = "") -> tuple[str, str]:
    """`http://h:p/a/b?q` -> (`http://h:p`, `/a/b?q`): Http1Client pools by origin, paths vary.
    An https:// URL on the host of `server`, an endpoint's URL with TLS settings of its own (a
    TlsUrl), is scraped with those settings (its client certificate, its CA, its server name)."""
    parts = urlsplit(url)
    path = parts.path or "/"
    origin = f"{parts.scheme}://{parts.netloc}"
    if isinstance(server, TlsUrl) and parts.scheme == "https" and parts.hostname == urlsplit(server).hostname:
        origin = TlsUrl(origin, server.tls)
    return origin, path + (f"?{parts.query}" if parts.query else "")


class ResourceScraper:
    """Scrapes `endpoints` every `config.scrape_interval` and publishes `endpoint.resources`.

    Give it its own `Http1Client`: sharing the proxy's would make a scrape wait for a connection
    slot exactly when the endpoint is saturated, turning its snapshot stale when it matters most.
    """

    def __init__(
        self,
        endpoints: Callable[[], Sequence[Endpoint]],
        client: Http1Client,
        config: ResourceAwareConfig,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[Endpoint, str], None] | None = None,
        on_snapshot: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self._endpoints = endpoints  # read at every scrape: the cluster may replace its endpoints
        self._client = client
        self._config = config
        self._clock = clock
        self._on_error = on_error or self._log_error
        self._on_snapshot = on_snapshot  # after each new `endpoint.resources` (workers: publish it)
        names = config.metrics
        self._wanted = (
            frozenset((names.queue_depth, names.running, names.memory_used, names.memory_free))
            | frozenset(names.sm_utilization)
            | frozenset(names.kv_cache_usage)
        )
        self._failing: set[str] = set()  # endpoints whose last scrape failed (default logging only)
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(e) for e in self._endpoints()))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="resource-scrape")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        # Fixed rate: the next scrape is due one interval after the last one started. Each scrape
        # is bounded by the interval, so scrapes never overlap.
        loop = asyncio.get_running_loop()
        interval = self._config.scrape_interval
        while True:
            started = loop.time()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, started + interval - loop.time()))

    async def _scrape(self, endpoint: Endpoint) -> None:
        base_url, path = _split_url(
            endpoint.metrics_url or endpoint.url.rstrip("/") + "/metrics", endpoint.url
        )
        try:
            families = await self._fetch(base_url, path)
        except ModelyardError as exc:
            self._on_error(endpoint, f"scraping {base_url}{path} failed: {exc.message}")
            return
        except TimeoutError:
            interval = self._config.scrape_interval
            self._on_error(endpoint, f"scraping {base_url}{path} failed: no answer within {interval:g}s")
            return
        except ValueError as exc:  # includes UnicodeDecodeError and the parser's errors
            self._on_error(endpoint, f"scraping {base_url}{path} failed: {exc}")
            return
        self._failing.discard(endpoint.name)
        # A DCGM exporter runs beside the server, at its own address: scraped too, merged in; when
        # it fails the server's own signals still count (the GPU ones drop out of the score).
        if endpoint.gpu_metrics_url:
            gpu = _split_url(endpoint.gpu_metrics_url, endpoint.url)
            try:
                families = {**families, **await self._fetch(*gpu)}
            except (ModelyardError, TimeoutError, ValueError) as exc:
                log.debug("%s: GPU metrics from %s%s unavailable: %r", endpoint.name, *gpu, exc)
        # The reading and the gateway's own in-flight count are taken at the same moment, so the
        # strategy can add what was sent since to the scraped queue.
        endpoint.resources = snapshot_from_metrics(
            families, self._config.metrics, self._clock(), endpoint.in_flight
        )
        if self._on_snapshot is not None:
            self._on_snapshot(endpoint)

    async def _fetch(self, base_url: str, path: str) -> dict[str, list[tuple[dict[str, str], float]]]:
        """One scrape, bounded by the interval (Http1Client's deadline starts after connecting; the
        outer timeout bounds it all). Raises ModelyardError, TimeoutError or ValueError."""
        deadline = self._config.scrape_interval
        async with asyncio.timeout(deadline):
            response = await self._client.request(base_url, "GET", path, _HEADERS, None, deadline)
            body = await response.read()
        if response.status != 200:
            raise ValueError(f"answered {response.status}")
        return parse_prometheus(body.decode("utf-8"), self._wanted)

    def _log_error(self, endpoint: Endpoint, message: str) -> None:
        # Once per outage, not every interval.
        if endpoint.name not in self._failing:
            self._failing.add(endpoint.name)
            log.warning("%s: %s; its last snapshot goes stale", endpoint.name, message)
