"""The scheduler: desired and actual placement state, the agents' gRPC service, the user API.

state         SchedulerState: Seldon's store + scheduler + agent-server logic, synchronous
connections   agents connecting/disconnecting, the restart resync, the retry pass (its base class)
reconcile     placing from a snapshot, settling after each mutation, persisting, then sending
reservations  memory reserved per replica by loads in flight, kept up to date per model
operations    Operation (load/unload for an agent) and the send/publish callables
records       the in-memory models, versions, servers, and their store records
feed          feed entries and FeedHub (the NDJSON feed's readers)
agents        Agents: the AgentHandler (streams, events, drain)
api           the REST API (aiohttp)
access        who may call: REST tokens and client certificates, agent credentials, the exposure check
service       start_scheduler(config) -> RunningScheduler
"""

from modelyard.scheduler.config import SchedulerConfig
from modelyard.scheduler.operations import Operation, OperationKind
from modelyard.scheduler.service import RunningScheduler, SchedulerService, start_scheduler
from modelyard.scheduler.state import AgentEventKind, LoadedVersion, ReplicaConfig, SchedulerState

__all__ = [
    "AgentEventKind",
    "LoadedVersion",
    "Operation",
    "OperationKind",
    "ReplicaConfig",
    "RunningScheduler",
    "SchedulerConfig",
    "SchedulerService",
    "SchedulerState",
    "start_scheduler",
]
