"""Fixtures shared by the agent's integration tests: `scheduler` (a fake AgentService on a free
port) and `setup` (a repository-mode sim-worker with an agent over it); see fake_agent_scheduler.py."""

from fake_agent_scheduler import scheduler, setup

__all__ = ["scheduler", "setup"]
