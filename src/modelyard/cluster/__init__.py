"""Pure domain: endpoints, their live load and their health state machine."""

from modelyard.cluster.endpoint import Abortable, BackendLoad, Endpoint, EndpointView, Load
from modelyard.cluster.health import HealthState, HealthThresholds, observe
from modelyard.cluster.resources import ResourceSnapshot

__all__ = [
    "Abortable",
    "BackendLoad",
    "Endpoint",
    "EndpointView",
    "HealthState",
    "HealthThresholds",
    "Load",
    "ResourceSnapshot",
    "observe",
]
