"""Residency: room for loads and reloads, shared reloads, per-name request counts (issue 9 item 1).

A fake server stands in for the repository API: its loads and unloads take a little while, so
the concurrent cases (two loads while an eviction runs, many requests waiting for one reload)
interleave as they do for real."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.agent.residency import NoRoom, Residency
from modelyard.agent.state import LocalState, ModelStatus
from modelyard.errors import ModelNotResident, ModelServerRefused


class FakeServer:
    def __init__(self, *, delay: float = 0.02, fail_load: frozenset[str] = frozenset()) -> None:
        self.delay = delay
        self.fail_load = fail_load
        self.loads: list[str] = []
        self.unloads: list[str] = []

    async def load(self, name: str) -> None:
        await asyncio.sleep(self.delay)  # the server's load time
        if name in self.fail_load:
            raise ModelServerRefused(f"load {name}: failed", server_status=500, server_text="failed")
        self.loads.append(name)

    async def unload(self, name: str) -> bool:
        await asyncio.sleep(self.delay)  # the server's unload time
        self.unloads.append(name)
        return True

    async def model_ready(self, name: str) -> bool:
        return False


def setup(
    memory: int = 1000, room_timeout: float = 1.0, **server: object
) -> tuple[LocalState, Residency, FakeServer]:
    state = LocalState(memory, 100)
    fake = FakeServer(**server)  # type: ignore[arg-type]
    outcomes: list[tuple[str, str, bool]] = []
    residency = Residency(
        state,
        fake,  # type: ignore[arg-type]
        room_timeout=room_timeout,
        on_load=lambda name, why, ok: outcomes.append((name, why, ok)),
    )
    residency.outcomes = outcomes  # type: ignore[attr-defined]
    return state, residency, fake


async def scheduler_load(
    state: LocalState, residency: Residency, server: FakeServer, name: str, size: int
) -> None:
    """What Operations.load does around the residency: register, make room, load, loaded."""
    async with residency.hold(name):
        state.begin_load(name, 1, size, asyncio.get_running_loop().time(), stamp=1)
        await residency.make_room(name)
        await server.load(name)
        state.loaded_ok(name, 1, asyncio.get_running_loop().time())


async def test_two_loads_at_once_while_an_eviction_runs_both_load():
    state, residency, server = setup()
    await scheduler_load(state, residency, server, "c", 600)
    await asyncio.gather(
        scheduler_load(state, residency, server, "a", 600),
        scheduler_load(state, residency, server, "b", 600),
    )
    assert state.get("a").status in (ModelStatus.LOADED, ModelStatus.EVICTED)
    assert sorted(m.name for m in state.loaded()) == ["a", "b", "c"]
    assert state.resident_bytes <= 1000
    assert server.unloads[0] == "c"  # the least recently used went first


async def test_requests_waiting_for_one_reload_share_it_and_fail_together():
    state, residency, server = setup(room_timeout=0.2)
    await scheduler_load(state, residency, server, "a", 600)
    await scheduler_load(state, residency, server, "b", 600)  # evicts a
    assert await residency.acquire("b")  # b serves a long request: a cannot get room
    results = await asyncio.gather(*(residency.acquire("a") for _ in range(4)), return_exceptions=True)
    assert all(isinstance(r, ModelNotResident) for r in results), results
    assert residency.outcomes == [("a", "reload", False)]  # type: ignore[attr-defined]  # one attempt
    assert state.queued("a") == 0 and state.get("a").status is ModelStatus.EVICTED
    residency.release("b")
    assert await residency.acquire("a")  # b is idle now: a reloads, evicting it
    assert state.get("b").status is ModelStatus.EVICTED
    residency.release("a")


async def test_a_request_cancelled_during_a_reload_leaves_the_reload_to_finish():
    state, residency, server = setup(delay=0.05)
    await scheduler_load(state, residency, server, "a", 600)
    await scheduler_load(state, residency, server, "b", 600)
    waiting = asyncio.ensure_future(residency.acquire("a"))
    await asyncio.sleep(0.01)  # the reload has started
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert state.queued("a") == 0
    assert await residency.acquire("a")  # finds the reload under way or done
    assert state.get("a").status is ModelStatus.LOADED
    assert server.loads.count("a") == 2  # the first load, and one reload
    residency.release("a")


async def test_requests_are_counted_per_name_across_a_version_replace():
    state, residency, server = setup()
    await scheduler_load(state, residency, server, "a", 300)
    assert await residency.acquire("a")
    state.begin_load("a", 2, 300, 5.0, stamp=2)  # a new version replaces the record
    state.loaded_ok("a", 2, 5.0)
    assert state.in_flight("a") == 1 and state.busy("a")
    assert state.victims(needed=900) is None  # a is still serving: not a victim
    residency.release("a")
    assert state.victims(needed=900) == ["a"]


async def test_a_load_that_cannot_get_room_in_time_says_who_was_busy():
    state, residency, server = setup(room_timeout=0.05)
    await scheduler_load(state, residency, server, "a", 600)
    assert await residency.acquire("a")
    with pytest.raises(NoRoom, match="serving requests: a"):
        await scheduler_load(state, residency, server, "b", 600)
    residency.release("a")
