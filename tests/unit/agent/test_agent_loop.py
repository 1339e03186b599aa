"""The agent's subscribe loop with a fake scheduler client: the reconnect backoff grows while the
scheduler is unreachable, resets after a stream that really opened, and an unexpected error does
not end the loop."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from modelyard.agent import Agent, AgentConfig
from modelyard.agent import agent as agent_module
from modelyard.agent.policy import Backoff
from modelyard.errors import SchedulerUnavailable
from modelyard.rpc import agent_pb2


class FakeClient:
    """`subscribe` waits `connect` seconds (the channel's connect wait), then per `plan` entry:
    "down" raises SchedulerUnavailable, "up" opens and ends the stream after `lives` seconds,
    "bug" raises RuntimeError. The last entry repeats."""

    def __init__(self, plan: list[str], *, connect: float, lives: float = 0.0) -> None:
        self.plan = plan
        self.connect = connect
        self.lives = lives
        self.calls = 0

    async def subscribe(self, request, on_open=None) -> AsyncIterator[agent_pb2.ModelOperation]:
        step = self.plan[min(self.calls, len(self.plan) - 1)]
        self.calls += 1
        await asyncio.sleep(self.connect)
        if step == "down":
            raise SchedulerUnavailable("subscribe: scheduler not reachable")
        if step == "bug":
            raise RuntimeError("a surprise")
        on_open()
        await asyncio.sleep(self.lives)
        return
        yield  # an async generator, as the real client's

    async def close(self) -> None:
        pass


@pytest.fixture
def attempts(monkeypatch) -> list[int]:
    """The attempt number of every reconnect delay the loop draws."""
    seen: list[int] = []

    class Recording(Backoff):
        def next_delay(self) -> float:
            delay = super().next_delay()
            seen.append(self.attempt)
            return delay

    monkeypatch.setattr(agent_module, "Backoff", Recording)
    monkeypatch.setattr(agent_module, "_STABLE_AFTER", 0.02)
    return seen


async def _run(client: FakeClient, calls: int) -> Agent:
    config = AgentConfig(
        scheduler="127.0.0.1:1",
        server_name="s",
        inference_url="http://127.0.0.1:1",
        reconnect_backoff=0.001,
        reconnect_backoff_max=0.004,
    )
    agent = Agent(config)
    agent._client = client  # type: ignore[assignment]
    loop = asyncio.create_task(agent._run())
    for _ in range(500):
        if client.calls >= calls or loop.done():
            break
        await asyncio.sleep(0.01)
    assert not loop.done(), loop.exception()
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    await agent.stop()
    return agent


async def test_the_backoff_grows_while_the_scheduler_is_unreachable(attempts):
    # The connect wait (0.03 s) is longer than what counts as a stable stream (0.02 s): before
    # the fix the loop timed the stream from before that wait, so it reset every time (all 1s).
    await _run(FakeClient(["down"], connect=0.03), calls=5)
    assert attempts[:4] == [1, 2, 3, 4]


async def test_a_stream_that_stayed_open_resets_the_backoff(attempts):
    agent = await _run(FakeClient(["down", "down", "up"], connect=0.0, lives=0.03), calls=5)
    assert attempts[:4] == [1, 2, 1, 1]
    assert agent.subscriptions >= 2


async def test_an_unexpected_error_is_logged_and_the_agent_subscribes_again(attempts, caplog):
    client = FakeClient(["bug", "bug", "up"], connect=0.0, lives=0.0)
    agent = await _run(client, calls=4)
    assert agent.subscriptions >= 1  # it went on to subscribe after the errors
    assert "failed unexpectedly" in caplog.text


async def test_a_connect_wait_counts_towards_the_backoff(monkeypatch):
    """While the scheduler is down each attempt waits for the channel (connect_timeout): the next
    starts at most the backoff after the last one started, not the backoff after it gave up, so the
    agent is back within about reconnect_backoff_max of the scheduler's return."""
    starts: list[float] = []

    class Timed(FakeClient):
        async def subscribe(self, request, on_open=None):
            starts.append(asyncio.get_running_loop().time())
            async for operation in super().subscribe(request, on_open):
                yield operation

    class Fixed(Backoff):
        def next_delay(self) -> float:
            super().next_delay()
            return 0.25

    monkeypatch.setattr(agent_module, "Backoff", Fixed)
    await _run(Timed(["down"], connect=0.3), calls=4)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert gaps and all(0.28 <= gap < 0.5 for gap in gaps), gaps  # 0.3 each, not 0.3 + 0.25


async def test_a_failure_that_repeats_is_logged_once_and_the_return_once(attempts, caplog):
    caplog.set_level("INFO", "modelyard.agent")
    client = FakeClient(["down"] * 6 + ["up"], connect=0.0, lives=0.05)
    await _run(client, calls=8)
    failures = [r for r in caplog.records if "not reachable" in r.getMessage()]
    assert [r.levelname for r in failures] == ["WARNING"]  # one warning for six failures
    (back,) = [r.getMessage() for r in caplog.records if "again after" in r.getMessage()]
    assert "after 6 failed attempt(s)" in back
