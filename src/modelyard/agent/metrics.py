"""The agent's Prometheus metrics (`GET /metrics` on its data plane), in a registry of its own so
that several agents can share a process (tests, the demo).

Per model, read from `LocalState` at scrape time (the request path only moves plain ints):

    modelyard_agent_requests_in_flight{model}        requests sent to the server, not answered yet
    modelyard_agent_requests_queued{model}           requests waiting for the model to be loaded
    modelyard_agent_model_last_used_timestamp_seconds{model}
    modelyard_agent_model_resident{model}            1 in the server's memory, 0 evicted
    modelyard_agent_model_memory_bytes{model}
    modelyard_agent_memory_bytes{kind}               total, resident, registered, available

Counted as it happens:

    modelyard_agent_requests_total{model, code}      answers the data plane gave (model "" when it
                                                     names none the agent holds)
    modelyard_agent_loads_total{result}              server loads: the scheduler's and reloads
    modelyard_evictions_total{model}                 models unloaded to make room (LRU)
    modelyard_agent_reloads_total{model, reason}     evicted (lazy reload) or not_found (the server
                                                     answered 404 for a model the agent held)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelyard.agent.state import LocalState, ModelStatus

_NOT_RESIDENT = frozenset({ModelStatus.EVICTED, ModelStatus.WAITING})


class _StateCollector(Collector):
    def __init__(self, state: LocalState, loop_time: Callable[[], float]) -> None:
        self._state = state
        self._loop_time = loop_time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "modelyard_agent_requests_in_flight",
            "Requests sent to the server, not answered yet",
            labels=["model"],
        )
        queued = GaugeMetricFamily(
            "modelyard_agent_requests_queued",
            "Requests waiting for the model to be loaded (a lazy reload, or room for it)",
            labels=["model"],
        )
        last_used = GaugeMetricFamily(
            "modelyard_agent_model_last_used_timestamp_seconds",
            "When a request last used the model (or it was loaded), Unix time",
            labels=["model"],
        )
        resident = GaugeMetricFamily(
            "modelyard_agent_model_resident",
            "1 when the model is in the server's memory (or being loaded), 0 when evicted",
            labels=["model"],
        )
        memory = GaugeMetricFamily(
            "modelyard_agent_model_memory_bytes", "Memory the model takes when resident", labels=["model"]
        )
        # Loop time -> Unix time, once per scrape.
        offset = time.time() - self._loop_time()
        for held in self._state:
            labels = [held.name]
            in_flight.add_metric(labels, self._state.in_flight(held.name))
            queued.add_metric(labels, self._state.queued(held.name))
            last_used.add_metric(labels, held.last_used + offset)
            resident.add_metric(labels, 0 if held.status in _NOT_RESIDENT else 1)
            memory.add_metric(labels, held.memory_bytes)
        yield from (in_flight, queued, last_used, resident, memory)
        replica = GaugeMetricFamily(
            "modelyard_agent_memory_bytes",
            "This replica's memory: total offered, resident models, registered models (evicted "
            "ones included), available (what the scheduler may still place, overcommit included)",
            labels=["kind"],
        )
        state = self._state
        replica.add_metric(["total"], state.memory_bytes)
        replica.add_metric(["resident"], state.resident_bytes)
        replica.add_metric(["registered"], state.registered_bytes)
        replica.add_metric(["available"], state.available_bytes)
        yield replica


class AgentMetrics:
    def __init__(self, state: LocalState, loop_time: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state, loop_time))
        self.requests = Counter(
            "modelyard_agent_requests",
            "Answers the agent's data plane gave, by model and status code",
            ["model", "code"],
            registry=self.registry,
        )
        self.loads = Counter(
            "modelyard_agent_loads",
            "Loads of a model on the server, the scheduler's and lazy reloads, by result",
            ["result"],
            registry=self.registry,
        )
        self.evictions = Counter(
            "modelyard_evictions",
            "Models unloaded from the server to make room (least recently used first)",
            ["model"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "modelyard_agent_reloads",
            "Models loaded again for a request: evicted (lazy reload) or not_found (the server "
            "answered 404 for a model the agent held)",
            ["model", "reason"],
            registry=self.registry,
        )

    def loaded(self, ok: bool) -> None:
        self.loads.labels("loaded" if ok else "failed").inc()

    def evicted(self, name: str) -> None:
        self.evictions.labels(name).inc()

    def reloaded(self, name: str, why: str, ok: bool) -> None:
        self.loaded(ok)
        if ok:
            self.reloads.labels(name, "evicted" if why == "reload" else why).inc()
