"""Fixtures shared by the agent's integration tests: `scheduler` (a fake AgentService on a free
port) and `setup` (a repository-mode sim-worker with an agent over it); see fake_agent_scheduler.py;
`serve_workers` (a `modelyard serve --workers 2` process; worker_gateways.py)."""

from fake_agent_scheduler import scheduler, setup
from worker_gateways import serve_workers

__all__ = ["scheduler", "serve_workers", "setup"]
