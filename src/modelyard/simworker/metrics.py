"""Prometheus exposition with vLLM's metric names, read from the live counters at scrape time.

Each app owns its `CollectorRegistry`, so several workers can share one process. As vLLM does
with several served names, the `model_name` label is the first configured model.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelyard.simworker.engine import SimEngine
from modelyard.simworker.repository import SimRepository

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SimCollector(Collector):
    def __init__(self, engine: SimEngine, repository: SimRepository | None) -> None:
        self._engine = engine
        self._repository = repository

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        stats = engine.stats
        labels = [engine.config.models[0]]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests holding a slot.", stats.running)
        yield gauge("vllm:num_requests_waiting", "Requests queued for a slot.", stats.waiting)
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "Fraction of cache blocks held by running requests (1 = 100%).",
            engine.cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits_tokens,
        )
        requests = CounterMetricFamily(
            "modelyard_sim_requests", "Inference requests received, by endpoint.", labels=["endpoint"]
        )
        for endpoint, count in sorted(stats.requests_by_endpoint.items()):
            requests.add_metric([endpoint], count)
        yield requests
        if self._repository is not None:
            yield from _repository_metrics(self._repository)


def _repository_metrics(repository: SimRepository) -> Iterator[Metric]:
    loaded = GaugeMetricFamily(
        "modelyard_sim_model_memory_bytes", "Memory each loaded model takes.", labels=["model"]
    )
    for name, memory in sorted(repository.loaded.items()):
        loaded.add_metric([name], memory)
    yield loaded
    yield GaugeMetricFamily("modelyard_sim_models_loaded", "Models loaded.", value=len(repository.loaded))
    for metric, doc, counts in (
        ("modelyard_sim_model_loads", "Successful loads per model.", repository.loads),
        ("modelyard_sim_model_unloads", "Successful unloads per model.", repository.unloads),
    ):
        family = CounterMetricFamily(metric, doc, labels=["model"])
        for name, count in sorted(counts.items()):
            family.add_metric([name], count)
        yield family
    yield GaugeMetricFamily(
        "modelyard_sim_memory_used_bytes", "Memory taken by loaded and loading models.", value=repository.used
    )
    yield GaugeMetricFamily(
        "modelyard_sim_memory_capacity_bytes", "Memory for models (0 = unlimited).", value=repository.capacity
    )


def create_registry(engine: SimEngine, repository: SimRepository | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SimCollector(engine, repository))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
