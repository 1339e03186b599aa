"""What a model server says about its load, scraped from its Prometheus `/metrics`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResourceSnapshot:
    """One scrape. Fractions are 0..1; a signal the server does not export is None.

    `in_flight_at_scrape` is this gateway's own in-flight count to the endpoint when the scrape
    was taken, so the requests it sent since can be added to the scraped queue depth.
    """

    taken_at: float
    queue_depth: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    sm_utilization: float | None = None
    memory_used: float | None = None
    in_flight_at_scrape: int = 0
