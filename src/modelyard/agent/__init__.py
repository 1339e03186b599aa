"""The agent beside one inference-server replica: loads and unloads models as the scheduler says.

agent       Agent / start_agent: the subscription to the scheduler, re-sync and reconnect
operations  LOAD and UNLOAD: artefact fetch, repository load with retries, events
residency   Residency: room for loads (LRU eviction of idle models), lazy reload for requests
dataplane   DataPlane: requests forwarded to the server, counted per model; /metrics
metrics     AgentMetrics: the Prometheus registry of one agent
state       LocalState: models held, memory accounting with overcommit, LRU order (pure)
policy      CommandStamps (out-of-order protection), Backoff, retry_delays (pure)
artefacts   storageUri -> <repository>/<name>/
config      AgentConfig
"""

from modelyard.agent.agent import Agent, start_agent
from modelyard.agent.config import AgentConfig
from modelyard.agent.policy import Backoff, CommandStamps, retry_delays
from modelyard.agent.state import HeldModel, LocalState, ModelStatus

__all__ = [
    "Agent",
    "AgentConfig",
    "Backoff",
    "CommandStamps",
    "HeldModel",
    "LocalState",
    "ModelStatus",
    "retry_delays",
    "start_agent",
]
