"""The InferenceGraph spec as KServe's API defines it (JSON field names), read leniently as the
router does: unknown fields (resources, affinity, scaling...) are ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

ROOT = "root"


class _KServe(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class InferenceStep(_KServe):
    """One step of a node. Exactly one target: `node_name`, `service_name` or `service_url`."""

    name: str = ""
    node_name: str = ""
    service_name: str = ""
    service_url: str = ""
    data: str = ""  # only "$response" means anything (Sequence, steps after the first)
    map_predictions_to_instances: bool = False
    weight: int | None = None  # Splitter only
    condition: str = ""  # gjson path: Switch (on the node input), Sequence (on the previous response)
    dependency: Literal["Soft", "Hard", ""] = ""  # "" means Soft

    @property
    def hard(self) -> bool:
        return self.dependency == "Hard"

    @property
    def target(self) -> str:
        return self.node_name or self.service_name or self.service_url


class InferenceRouter(_KServe):
    """A node. `router_type` is required by KServe's CRD schema (not its webhook); "" only survives
    so that validation can name the node that lacks it."""

    router_type: Literal["Sequence", "Splitter", "Ensemble", "Switch", ""] = ""
    steps: list[InferenceStep] = Field(default_factory=list)


class RouterTimeouts(_KServe):
    """Seconds. KServe's router reads these as its HTTP server and per-call client timeouts."""

    server_read: int | None = None
    server_write: int | None = None
    server_idle: int | None = None
    service_client: int | None = None


class GraphSpec(_KServe):
    nodes: dict[str, InferenceRouter]
    timeout: int | None = (
        None  # seconds for the whole graph; KServe's router ignores it, modelyard enforces it
    )
    router_timeouts: RouterTimeouts | None = None
