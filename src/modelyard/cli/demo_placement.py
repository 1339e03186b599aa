"""The embedded demo's placement part: a scheduler (state in memory), two sim-workers in repository
mode with different memory, and an agent beside each, all in this process.

Apply `examples/placement/models.yaml` to its scheduler and the demo gateway, which follows it,
routes every model it places.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.errors import ModelyardError
from modelyard.placement.manifest import parse_quantity
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from modelyard.simworker import SimWorker, SimWorkerConfig

DEMO_SERVER = "sim"
DEMO_CAPABILITIES = ("sim",)
# Memory per replica of the server `sim`: a model of 6Gi fits only replica 1.
DEMO_REPLICA_MEMORY = ("2Gi", "8Gi")
SCHEDULER_PORT = 9004
AGENT_PORT = 9005


@dataclass
class DemoPlacement:
    scheduler: RunningScheduler
    workers: list[SimWorker] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.scheduler.url

    async def stop(self) -> None:
        """Agents first (they stop talking to the scheduler), then the scheduler, then the servers."""
        for agent in self.agents:
            with contextlib.suppress(Exception):
                await agent.stop()
        with contextlib.suppress(Exception):
            await self.scheduler.stop()
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await worker.stop()


async def start_demo_placement(
    host: str = "127.0.0.1", port: int = SCHEDULER_PORT, agent_port: int = AGENT_PORT
) -> DemoPlacement:
    """Start it all; ports 0 pick free ones. A port in use is a ModelyardError naming it."""
    config = SchedulerConfig(host=host, port=port, agent_port=agent_port, db=":memory:", retry_interval=5.0)
    # Checked first too: gRPC logs its own bind failure to stderr before we can say it in one line.
    taken = _taken_port(host, port, agent_port)
    if taken:
        raise ModelyardError(taken)
    try:
        scheduler = await start_scheduler(config)
    except OSError as error:
        raise ModelyardError(_taken_port(host, port, agent_port) or _cannot_start(error)) from None
    demo = DemoPlacement(scheduler)
    try:
        for index, memory in enumerate(DEMO_REPLICA_MEMORY):
            worker = SimWorker(
                SimWorkerConfig(
                    host=host,
                    port=0,
                    models=(f"{DEMO_SERVER}-{index}",),
                    repository_api=True,  # any name loads; nothing answers until it is loaded
                    memory=parse_quantity(memory),
                    decode_ms_per_token=0.0,
                    prefill_ms_per_token=0.0,
                    seed=index,
                )
            )
            await worker.start()
            demo.workers.append(worker)
            assert worker.url is not None
            agent = await start_agent(
                AgentConfig(
                    scheduler=scheduler.agent_address,
                    server_name=DEMO_SERVER,
                    replica_idx=index,
                    inference_url=worker.url,
                    memory_bytes=parse_quantity(memory),  # as the worker's --memory
                    capabilities=DEMO_CAPABILITIES,
                    unload_grace=0.0,  # no traffic to drain on a laptop: a deleted model goes at once
                    server_live_timeout=10.0,
                )
            )
            demo.agents.append(agent)
        await _registered(scheduler, len(DEMO_REPLICA_MEMORY))
    except BaseException:
        await demo.stop()
        raise
    return demo


async def _registered(scheduler: RunningScheduler, replicas: int, within: float = 10.0) -> None:
    """Wait (bounded) until every agent has subscribed, so that `server list` shows them at once."""
    for _ in range(int(within / 0.01)):
        server = scheduler.state.servers.get(DEMO_SERVER)
        if server is not None and sum(r.connected for r in server.replicas.values()) == replicas:
            return
        await asyncio.sleep(0.01)


def _taken_port(host: str, port: int, agent_port: int) -> str:
    """The line that names the first of the ports already in use, or ""."""
    for taken, role in ((port, "REST API"), (agent_port, "agent port")):
        if taken and _in_use(host, taken):
            return (
                f"cannot start the demo's scheduler: {host}:{taken} (its {role}) is already in use; "
                f"stop what holds it (another `make demo` or `modelyard scheduler`? see `lsof -i :{taken}`)"
            )
    return ""


def _cannot_start(error: OSError) -> str:
    return f"cannot start the demo's scheduler: {error.strerror or error}"


def _in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def placement_banner(demo: DemoPlacement, gateway_url: str) -> list[str]:
    """The banner's placement lines: where the scheduler is, its replicas, what to paste."""
    scheduler = demo.url
    env = "" if demo.scheduler.port == SCHEDULER_PORT else f"MODELYARD_SCHEDULER={scheduler} "
    replicas = ", ".join(f"{DEMO_SERVER}-{i} {memory}" for i, memory in enumerate(DEMO_REPLICA_MEMORY))
    return [
        f"placement: scheduler {scheduler} (state in memory, not kept); server {DEMO_SERVER}: {replicas}",
        f"  {env}.venv/bin/modelyard model apply -f examples/placement/models.yaml",
        f"  {env}.venv/bin/modelyard model list; {env}.venv/bin/modelyard server list",
        f"  curl -s {gateway_url}/v1/chat/completions -D - \\",
        '    -d \'{"model": "chat-small", "messages": [{"role": "user", "content": "Hello!"}]}\'',
    ]
