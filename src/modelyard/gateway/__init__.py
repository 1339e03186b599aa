"""The gateway service: routes OpenAI, OIP v2 and KServe v1 requests to model endpoints."""

from modelyard.gateway.app import create_app
from modelyard.gateway.gateway import GATEWAY, Gateway
from modelyard.gateway.server import RunningGateway, start_gateway

__all__ = ["GATEWAY", "Gateway", "RunningGateway", "create_app", "start_gateway"]
