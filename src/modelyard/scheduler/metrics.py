"""The scheduler's Prometheus metrics (`GET /metrics` on its REST port), in a registry of its own.

modelyard_model_replicas{model, kind}        desired (the spec), available (Available replicas
                                             of the latest version), read at scrape time
modelyard_model_loads_total{result}          agents' load reports: loaded, failed
modelyard_model_unloads_total{result}        agents' unload reports: unloaded, failed
modelyard_scaling_events_total{direction}    autoscaling decisions applied: up, down
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelyard.placement.scaling import Decision
from modelyard.scheduler.state import SchedulerState


class _ReplicasCollector(Collector):
    def __init__(self, state: SchedulerState) -> None:
        self._state = state

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "modelyard_model_replicas",
            "Replicas of each model's latest version: desired (its spec) and available",
            labels=["model", "kind"],
        )
        for name, model in sorted(self._state.models.items()):
            if model.deleted:
                continue
            family.add_metric([name, "desired"], model.latest.spec.replicas)
            family.add_metric([name, "available"], model.latest.status.available)
        yield family


class SchedulerMetrics:
    def __init__(self, state: SchedulerState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicasCollector(state))
        self.loads = Counter(
            "modelyard_model_loads",
            "Model loads agents reported, by result",
            ["result"],
            registry=self.registry,
        )
        self.unloads = Counter(
            "modelyard_model_unloads",
            "Model unloads agents reported, by result",
            ["result"],
            registry=self.registry,
        )
        self.scaling = Counter(
            "modelyard_scaling_events",
            "Autoscaling decisions applied, by direction",
            ["direction"],
            registry=self.registry,
        )

    def scaled(self, decision: Decision) -> None:
        self.scaling.labels(decision.direction.value).inc()
