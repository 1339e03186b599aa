"""The AgentDrain call (`Agents.drain`) over a SchedulerState driven step by step."""

from __future__ import annotations

import asyncio

from scheduler_harness import Harness, spec

from modelyard.rpc.agent_v1 import agent_pb2
from modelyard.scheduler import AgentEventKind, LoadedVersion
from modelyard.scheduler.agents import Agents
from modelyard.scheduler.changes import Changes


def _agents(h: Harness, changes: Changes, timeout: float = 5.0) -> Agents:
    agents = Agents(changes, lambda: 3.0, queue_size=16, drain_timeout=timeout)
    agents.state = h.state
    return agents


async def _until(condition: object) -> None:
    for _ in range(200):  # the drain task runs on this loop: let it
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


async def test_the_call_answers_once_the_model_serves_elsewhere() -> None:
    h, changes = Harness(), Changes()
    h.connect(index=0)
    h.state.apply(spec(), 1.0)
    h.answer()
    h.connect(index=1)
    call = asyncio.create_task(_agents(h, changes).drain(agent_pb2.AgentDrainRequest(server_name="mlserver")))
    await _until(lambda: h.replicas("iris") == {0: "Draining", 1: "Loading"})
    assert not call.done()
    h.answer()
    changes.pulse()
    assert await asyncio.wait_for(call, 5) is True


async def test_a_re_subscribe_during_the_call_drains_the_replica_again() -> None:
    h, changes = Harness(), Changes()
    h.connect(index=0)
    h.state.apply(spec(), 1.0)
    h.answer()
    h.connect(index=1)
    call = asyncio.create_task(_agents(h, changes).drain(agent_pb2.AgentDrainRequest(server_name="mlserver")))
    await _until(lambda: h.replicas("iris") == {0: "Draining", 1: "Loading"})
    # The agent's stream broke and it subscribed again, reporting the model: the replica is
    # registered afresh (not draining) and the model Available there again.
    h.connect(index=0, loaded=(LoadedVersion("iris", 1),))
    assert h.replicas("iris")[0] == "Available"
    changes.pulse()
    await _until(lambda: h.replicas("iris")[0] == "Draining")
    assert not call.done()  # not fooled by the Available replica that is going
    # Placement had meanwhile kept replica 0 and unloaded 1; it is placed on 1 again.
    assert ("load", "mlserver", 1, "iris", 1) in h.take()
    assert h.replicas("iris")[1] == "Loading"
    h.state.event("mlserver", 1, "iris", 1, AgentEventKind.LOADED, now=4.0)
    changes.pulse()
    assert await asyncio.wait_for(call, 5) is True


async def test_the_call_gives_up_after_the_timeout() -> None:
    h, changes = Harness(), Changes()
    h.connect(index=0)
    h.state.apply(spec(), 1.0)
    h.answer()
    h.connect(index=1)
    agents = _agents(h, changes, timeout=0.05)
    assert await agents.drain(agent_pb2.AgentDrainRequest(server_name="mlserver")) is False
