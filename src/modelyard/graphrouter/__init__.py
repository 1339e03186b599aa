"""The stand-alone graph router: a drop-in for KServe's InferenceGraph router container."""

from modelyard.graphrouter.app import GraphResponder, create_router_app
from modelyard.graphrouter.server import RunningRouter, start_router

__all__ = ["GraphResponder", "RunningRouter", "create_router_app", "start_router"]
