"""Policy, pure: model specs, replica and model states, and where each model version goes.

Seldon Core v2's scheduler is the behaviour reference (shared compat/seldon-scheduler.md); each
module's docstring says where this differs and why. Nothing here does I/O or reads a clock: the
scheduler builds a snapshot (ServerView, ModelView) from its store, calls `plan`, applies the
returned changes and records `derive_status` or `schedule_failed` as the version's status.

    states   ReplicaState, ModelState (Seldon's names; proto numbers), the predicate sets of §2.1
    spec     ModelSpec and its validation, spec_change (new version or in-place scaling)
    manifest the plain shape and Seldon's Model resource read into ModelSpecs; quantities
    derive   derive_status (§4), schedule_failed (§5.4), should_retry (§5.5)
    planner  plan (§5.2) over ServerView/ReplicaView and ModelView/VersionView
    split    traffic_split: old and new version shares during a rollout (§6.2)
    scaling  decide: model autoscaling on lag and inactivity (§9)
"""

from modelyard.placement.derive import ModelStatus, derive_status, schedule_failed, should_retry
from modelyard.placement.planner import (
    NO_MATCHING_SERVERS,
    NOT_ENOUGH_REPLICAS,
    ModelView,
    Placement,
    PlacementFailure,
    ReplicaChange,
    ReplicaView,
    ServerView,
    VersionView,
    plan,
    required_memory,
)
from modelyard.placement.spec import SCALING_FIELDS, ModelSpec, SpecChange, parse_model_spec, spec_change
from modelyard.placement.split import traffic_split
from modelyard.placement.states import (
    ALREADY_LOADING_OR_LOADED,
    HOSTING,
    INACTIVE,
    LIVE,
    MODEL_STATE_PROTO,
    REPLICA_STATE_PROTO,
    ROUTABLE,
    UNLOADING_OR_UNLOADED,
    ModelState,
    ReplicaState,
    ReplicaStatus,
    model_state_from_proto,
    replica_state_from_proto,
    routable_assignment,
)

__all__ = [
    "ALREADY_LOADING_OR_LOADED",
    "HOSTING",
    "INACTIVE",
    "LIVE",
    "MODEL_STATE_PROTO",
    "NOT_ENOUGH_REPLICAS",
    "NO_MATCHING_SERVERS",
    "REPLICA_STATE_PROTO",
    "ROUTABLE",
    "SCALING_FIELDS",
    "UNLOADING_OR_UNLOADED",
    "ModelSpec",
    "ModelState",
    "ModelStatus",
    "ModelView",
    "Placement",
    "PlacementFailure",
    "ReplicaChange",
    "ReplicaState",
    "ReplicaStatus",
    "ReplicaView",
    "ServerView",
    "SpecChange",
    "VersionView",
    "derive_status",
    "model_state_from_proto",
    "parse_model_spec",
    "plan",
    "replica_state_from_proto",
    "required_memory",
    "routable_assignment",
    "schedule_failed",
    "should_retry",
    "spec_change",
    "traffic_split",
]
