"""MemoryState (TTL + LRU bound) and FallbackState (remote with local fallback), on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.errors import StateUnavailable
from modelyard.state import FallbackState, MemoryState


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FlakyRemote:
    """A shared store that raises StateUnavailable while `down` is set."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.down = False
        self.calls = 0
        self.closed = False

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise StateUnavailable("remote is down")

    async def get(self, key: str) -> str | None:
        self._check()
        return self.data.get(key)

    async def set(self, key: str, value: str, ttl: float) -> None:
        self._check()
        self.data[key] = value

    async def close(self) -> None:
        self.closed = True


# MemoryState


async def test_memory_get_returns_what_was_set() -> None:
    state = MemoryState(clock=FakeClock())
    assert await state.get("k") is None
    await state.set("k", "a", ttl=60)
    await state.set("k", "b", ttl=60)
    assert await state.get("k") == "b"


async def test_memory_entries_expire_after_ttl() -> None:
    clock = FakeClock()
    state = MemoryState(clock=clock)
    await state.set("k", "v", ttl=10)
    clock.advance(9.9)
    assert await state.get("k") == "v"
    clock.advance(0.2)
    assert await state.get("k") is None
    assert len(state) == 0


async def test_memory_set_again_renews_ttl() -> None:
    clock = FakeClock()
    state = MemoryState(clock=clock)
    await state.set("k", "v", ttl=10)
    clock.advance(8)
    await state.set("k", "v", ttl=10)
    clock.advance(8)
    assert await state.get("k") == "v"


async def test_memory_get_does_not_extend_ttl() -> None:
    clock = FakeClock()
    state = MemoryState(clock=clock)
    await state.set("k", "v", ttl=10)
    clock.advance(8)
    assert await state.get("k") == "v"
    clock.advance(3)
    assert await state.get("k") is None


@pytest.mark.parametrize("extra", [1, 5, 50])
async def test_memory_is_bounded_and_evicts_least_recently_used(extra: int) -> None:
    state = MemoryState(max_entries=10, clock=FakeClock())
    keys = [f"k{i}" for i in range(10 + extra)]
    for key in keys:
        await state.set(key, key.upper(), ttl=60)
    assert len(state) == 10
    for key in keys[:extra]:
        assert await state.get(key) is None
    for key in keys[extra:]:
        assert await state.get(key) == key.upper()


async def test_memory_get_refreshes_recency() -> None:
    state = MemoryState(max_entries=3, clock=FakeClock())
    for key in "abc":
        await state.set(key, key, ttl=60)
    assert await state.get("a") == "a"
    await state.set("d", "d", ttl=60)
    assert await state.get("b") is None
    assert [await state.get(k) for k in "acd"] == ["a", "c", "d"]


async def test_memory_set_on_existing_key_refreshes_recency() -> None:
    state = MemoryState(max_entries=3, clock=FakeClock())
    for key in "abc":
        await state.set(key, key, ttl=60)
    await state.set("a", "A", ttl=60)
    await state.set("d", "d", ttl=60)
    assert await state.get("b") is None
    assert await state.get("a") == "A"


async def test_memory_close_drops_everything() -> None:
    state = MemoryState(clock=FakeClock())
    await state.set("k", "v", ttl=60)
    await state.close()
    assert await state.get("k") is None


# FallbackState


def fallback_state() -> tuple[FallbackState, FlakyRemote, MemoryState, FakeClock, list[Exception]]:
    clock = FakeClock()
    remote = FlakyRemote()
    local = MemoryState(clock=clock)
    reported: list[Exception] = []
    state = FallbackState(remote, local, on_fallback=reported.append, clock=clock)
    return state, remote, local, clock, reported


async def test_fallback_uses_remote_while_it_answers() -> None:
    state, remote, local, _, reported = fallback_state()
    await state.set("k", "v", ttl=60)
    assert remote.data == {"k": "v"}
    assert await local.get("k") == "v"

    remote.data["k"] = "from-another-gateway"
    assert await state.get("k") == "from-another-gateway"
    assert not state.degraded
    assert reported == []


async def test_fallback_get_falls_back_to_local_and_reports_once() -> None:
    state, remote, local, _, reported = fallback_state()
    await local.set("k", "local-value", ttl=60)
    remote.down = True

    assert await state.get("k") == "local-value"
    assert len(reported) == 1
    assert isinstance(reported[0], StateUnavailable)
    assert state.degraded


async def test_fallback_skips_remote_during_backoff_then_retries() -> None:
    state, remote, local, clock, reported = fallback_state()
    await local.set("k", "v", ttl=600)
    remote.down = True
    await state.get("k")
    calls = remote.calls

    clock.advance(0.4)
    assert await state.get("k") == "v"
    await state.set("k2", "v2", ttl=600)
    assert remote.calls == calls
    assert len(reported) == 1

    clock.advance(0.2)  # past the first 0.5 s window
    assert await state.get("k") == "v"
    assert remote.calls == calls + 1
    assert len(reported) == 2


async def test_fallback_backoff_doubles_while_remote_stays_down() -> None:
    state, remote, _, clock, reported = fallback_state()
    remote.down = True
    await state.get("k")
    clock.advance(0.5)
    await state.get("k")  # second failure: next window is 1 s
    calls = remote.calls
    clock.advance(0.9)
    await state.get("k")
    assert remote.calls == calls
    clock.advance(0.1)
    await state.get("k")
    assert remote.calls == calls + 1
    assert len(reported) == 3


async def test_fallback_uses_remote_again_after_window_and_resets_backoff() -> None:
    state, remote, _, clock, reported = fallback_state()
    remote.down = True
    await state.get("k")
    clock.advance(0.5)
    await state.get("k")  # backoff now 1 s
    clock.advance(1.0)

    remote.down = False
    remote.data["k"] = "remote"
    assert await state.get("k") == "remote"
    assert not state.degraded
    assert len(reported) == 2

    remote.down = True  # a new outage starts over at the shortest window
    await state.get("k")
    calls = remote.calls
    clock.advance(0.5)
    await state.get("k")
    assert remote.calls == calls + 1


async def test_values_set_during_outage_are_served_locally() -> None:
    state, remote, _, clock, reported = fallback_state()
    remote.down = True
    await state.set("k", "v", ttl=60)
    assert len(reported) == 1  # the failed set was one attempt
    assert remote.data == {}
    assert await state.get("k") == "v"

    clock.advance(0.5)  # window over, remote still down: get retries, fails, answers locally
    assert await state.get("k") == "v"
    assert len(reported) == 2


async def test_fallback_without_callback_still_falls_back() -> None:
    clock = FakeClock()
    remote = FlakyRemote()
    remote.down = True
    state = FallbackState(remote, MemoryState(clock=clock), clock=clock)
    await state.set("k", "v", ttl=60)
    assert await state.get("k") == "v"


async def test_fallback_close_closes_both_stores() -> None:
    state, remote, local, _, _ = fallback_state()
    await local.set("k", "v", ttl=60)
    await state.close()
    assert remote.closed
    assert len(local) == 0


async def test_requests_in_flight_when_the_remote_fails_count_as_one_outage() -> None:
    # Ten lookups that were already waiting on the remote all fail together: one fallback,
    # one log line, one backoff step (not ten doublings of the backoff).
    clock = FakeClock()
    reported: list[Exception] = []
    gate = asyncio.Event()

    class SlowFlaky(FlakyRemote):
        async def get(self, key: str) -> str | None:
            await gate.wait()
            return await super().get(key)

    remote = SlowFlaky()
    state = FallbackState(remote, MemoryState(clock=clock), on_fallback=reported.append, clock=clock)
    lookups = [asyncio.create_task(state.get(f"k{i}")) for i in range(10)]
    await asyncio.sleep(0)  # let every lookup reach the remote
    remote.down = True
    gate.set()
    assert await asyncio.gather(*lookups) == [None] * 10
    assert len(reported) == 1
    clock.advance(0.6)  # past the first backoff step (0.5 s): the remote is asked again
    assert not state.degraded
