"""MemoryState (TTL + LRU bound) and FallbackState (remote with local fallback, write-back when
the remote returns), on a fake clock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import pytest

from modelyard.errors import StateUnavailable
from modelyard.state import Entry, FallbackState, MemoryState
from support import wait_until


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FlakyRemote:
    """A shared store that raises StateUnavailable while `down` is set (or goes down after
    `batches_until_down` write-back batches)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.ttls: dict[str, float] = {}
        self.batches: list[list[Entry]] = []
        self.epoch: str | None = "run-1"
        self.down = False
        self.batches_until_down: int | None = None
        self.calls = 0
        self.closed = False
        self.published: list[tuple[str, bytes]] = []

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
        self.ttls[key] = ttl

    async def set_many_if_absent(self, entries: Sequence[Entry]) -> int:
        if self.batches_until_down is not None:
            self.down = self.down or self.batches_until_down == 0
            self.batches_until_down -= 1
        self._check()
        self.batches.append(list(entries))
        absent = [entry for entry in entries if entry.key not in self.data]
        for key, value, ttl in absent:
            self.data[key] = value
            self.ttls[key] = ttl
        return len(absent)

    async def publish(self, channel: str, payload: bytes) -> bool:
        self._check()
        self.published.append((channel, payload))
        return True

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        for published, payload in self.published:
            if published == channel:
                yield payload

    async def close(self) -> None:
        self.closed = True


class GatedRemote(FlakyRemote):
    """Write-back batches wait at `gate` (after `entered` is set) until the test opens it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.cancelled = False

    async def set_many_if_absent(self, entries: Sequence[Entry]) -> int:
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return await super().set_many_if_absent(entries)


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


async def test_memory_set_many_if_absent_keeps_live_values() -> None:
    clock = FakeClock()
    state = MemoryState(clock=clock)
    await state.set("live", "old", ttl=60)
    await state.set("expired", "old", ttl=1)
    clock.advance(2)
    entries = [Entry("live", "new", 30), Entry("expired", "new", 30), Entry("absent", "new", 30)]
    assert await state.set_many_if_absent(entries) == 2
    assert [await state.get(k) for k in ("live", "expired", "absent")] == ["old", "new", "new"]
    clock.advance(30)
    assert await state.get("absent") is None


async def test_memory_entries_are_the_live_ones_with_their_remaining_ttl() -> None:
    clock = FakeClock()
    state = MemoryState(max_entries=3, clock=clock)
    await state.set("a", "A", ttl=60)
    await state.set("b", "B", ttl=5)
    await state.set("c", "C", ttl=60)
    clock.advance(10)
    assert state.entries(["a", "b", "missing"]) == [Entry("a", "A", 50)]
    await state.set("d", "D", ttl=60)  # reading entries did not make "a" recently used
    assert await state.get("a") is None


async def test_memory_close_drops_everything() -> None:
    state = MemoryState(clock=FakeClock())
    await state.set("k", "v", ttl=60)
    await state.close()
    assert await state.get("k") is None


async def test_memory_channels_deliver_to_every_subscriber_of_the_channel_in_the_process() -> None:
    state = MemoryState()
    received: dict[str, list[bytes]] = {"a": [], "b": [], "other": []}

    async def listen(name: str, channel: str) -> None:
        async for payload in state.subscribe(channel):
            received[name].append(payload)

    tasks = [asyncio.create_task(listen(n, "other" if n == "other" else "c")) for n in received]
    try:

        async def both_listening() -> bool:  # a subscription starts with its iteration
            await state.publish("c", b"probe")
            return bool(received["a"]) and bool(received["b"])

        await wait_until(both_listening)
        assert await state.publish("c", b"hello")

        async def delivered() -> bool:
            return all(received[name][-1:] == [b"hello"] for name in ("a", "b"))

        await wait_until(delivered)
        assert received["a"].count(b"hello") == received["b"].count(b"hello") == 1
        assert received["other"] == []
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await state.publish("c", b"nobody listens")  # and nothing is kept for later


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


async def test_fallback_publishes_to_the_remote_and_drops_while_it_is_away() -> None:
    state, remote, _, clock, _ = fallback_state()
    assert await state.publish("c", b"one")
    assert remote.published == [("c", b"one")]

    remote.down = True
    assert not await state.publish("c", b"two")  # dropped at once
    assert state.publish_degraded
    calls = remote.calls
    assert not await state.publish("c", b"three")  # during the backoff the remote is not asked
    assert remote.calls == calls

    remote.down = False
    clock.advance(0.6)
    assert await state.publish("c", b"four")
    assert not state.publish_degraded
    assert [payload for _, payload in remote.published] == [b"one", b"four"]


async def test_publish_backoff_doubles_while_publishes_fail_and_resets_once_one_goes() -> None:
    state, remote, _, clock, _ = fallback_state()
    remote.down = True
    for window in (0.5, 1.0, 2.0):
        assert not await state.publish("c", b"x")
        clock.advance(window - 0.01)
        assert state.publish_degraded
        clock.advance(0.01)
        assert not state.publish_degraded
    remote.down = False
    assert await state.publish("c", b"y")
    remote.down = True
    assert not await state.publish("c", b"z")
    clock.advance(0.5)
    assert not state.publish_degraded  # back to the first window


async def test_a_failed_publish_leaves_get_and_set_on_the_remote_and_is_no_state_fallback(caplog) -> None:
    caplog.set_level(logging.WARNING, "modelyard.state")
    state, remote, _, _, reported = fallback_state()
    remote.down = True
    assert not await state.publish("c", b"a large batch that timed out")
    remote.down = False

    assert reported == []  # modelyard_state_fallback_total counts routing state only
    assert not state.degraded
    remote.data["k"] = "from-another-gateway"
    assert await state.get("k") == "from-another-gateway"  # kv_aware still follows the others
    await state.set("k2", "v", ttl=60)
    assert remote.data["k2"] == "v" and state.unsynced == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not any("shared state unavailable" in m for m in messages)
    assert sum("channels unavailable" in m for m in messages) == 1


async def test_a_failed_get_does_not_stop_publishing() -> None:
    state, remote, _, _, reported = fallback_state()
    remote.down = True
    await state.get("k")
    remote.down = False
    assert state.degraded and len(reported) == 1

    assert await state.publish("c", b"records")  # prefix records still go during kv's backoff
    assert remote.published == [("c", b"records")]


async def test_fallback_subscribes_on_the_remote() -> None:
    state, remote, _, _, _ = fallback_state()
    remote.published = [("c", b"one"), ("d", b"other"), ("c", b"two")]
    assert [payload async for payload in state.subscribe("c")] == [b"one", b"two"]


# FallbackState: write-back when the remote returns


class Writebacks:
    """The on_writeback callback: records each count; `next()` waits (bounded) for the next one."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._reported = asyncio.Event()

    def __call__(self, written: int) -> None:
        self.counts.append(written)
        self._reported.set()

    async def next(self) -> int:
        await asyncio.wait_for(self._reported.wait(), timeout=5)
        self._reported.clear()
        return self.counts[-1]


class Gateway:
    """One gateway's FallbackState over a remote the test controls, on a fake clock."""

    def __init__(
        self, remote: FlakyRemote | None = None, clock: FakeClock | None = None, max_entries: int = 1000
    ) -> None:
        self.clock = clock or FakeClock()
        self.remote = remote or FlakyRemote()
        self.local = MemoryState(max_entries=max_entries, clock=self.clock)
        self.fallbacks: list[Exception] = []
        self.writebacks = Writebacks()
        self.state = FallbackState(
            self.remote,
            self.local,
            on_fallback=self.fallbacks.append,
            on_writeback=self.writebacks,
            clock=self.clock,
        )

    async def remote_returns(self) -> None:
        """The remote answers again; past any backoff, the next lookup notices."""
        self.remote.down = False
        self.clock.advance(31)
        await self.state.get("lookup")


async def test_keys_set_during_an_outage_are_written_back_when_the_remote_returns() -> None:
    gw = Gateway()
    gw.remote.down = True
    for i in range(3):
        await gw.state.set(f"k{i}", f"w{i}", ttl=600)
    assert gw.remote.data == {}
    assert gw.state.unsynced == 3

    await gw.remote_returns()
    assert await gw.writebacks.next() == 3
    assert gw.remote.data == {"k0": "w0", "k1": "w1", "k2": "w2"}
    assert len(gw.remote.batches) == 1  # one pipelined round trip
    assert gw.state.unsynced == 0
    assert len(gw.fallbacks) == 1


async def test_writeback_carries_the_remaining_ttl_and_skips_expired_keys() -> None:
    gw = Gateway()
    gw.remote.down = True
    await gw.state.set("long", "w0", ttl=60)
    await gw.state.set("short", "w1", ttl=20)
    gw.remote.down = False
    gw.clock.advance(25)  # the outage lasted longer than "short" lives
    await gw.state.get("lookup")
    assert await gw.writebacks.next() == 1
    assert gw.remote.data == {"long": "w0"}
    assert gw.remote.ttls == {"long": 35}


async def test_writeback_never_overwrites_a_value_the_remote_holds() -> None:
    gw = Gateway()
    gw.remote.down = True
    await gw.state.set("k", "mine", ttl=600)
    gw.remote.data["k"] = "theirs"  # another gateway wrote its value back first
    await gw.remote_returns()
    assert await gw.writebacks.next() == 0
    assert gw.remote.data["k"] == "theirs"
    assert await gw.state.get("k") == "theirs"  # and this gateway follows it


async def test_gateways_that_learnt_different_values_agree_after_writing_back() -> None:
    clock = FakeClock()
    remote = FlakyRemote()
    a, b = Gateway(remote, clock), Gateway(remote, clock)
    remote.down = True
    await a.state.set("shared", "w-a", ttl=600)
    await b.state.set("shared", "w-b", ttl=600)
    await b.state.set("only-b", "w-b", ttl=600)

    await a.remote_returns()
    assert await a.writebacks.next() == 1
    await b.remote_returns()
    assert await b.writebacks.next() == 1  # "only-b"; "shared" was already there
    for gw in (a, b):
        assert await gw.state.get("shared") == "w-a"
        assert await gw.state.get("only-b") == "w-b"


async def test_only_what_the_remote_missed_is_written_back() -> None:
    gw = Gateway()
    await gw.state.set("synced", "w0", ttl=600)
    gw.remote.down = True
    await gw.state.set("missed", "w1", ttl=600)
    await gw.remote_returns()
    assert await gw.writebacks.next() == 1
    assert [entry.key for batch in gw.remote.batches for entry in batch] == ["missed"]


async def test_a_key_set_again_once_the_remote_answers_is_not_written_back() -> None:
    gw = Gateway()
    gw.remote.down = True
    await gw.state.set("k", "old", ttl=600)
    await gw.state.set("other", "w", ttl=600)
    gw.remote.down = False
    gw.clock.advance(1)
    await gw.state.set("k", "new", ttl=600)  # reaches the remote, which then holds the newest value
    assert await gw.writebacks.next() == 1
    assert [entry.key for batch in gw.remote.batches for entry in batch] == ["other"]
    assert gw.remote.data == {"k": "new", "other": "w"}


async def test_a_restarted_remote_gets_every_live_local_key_back_without_a_failure_seen() -> None:
    gw = Gateway()
    await gw.state.set("a", "w0", ttl=600)
    await gw.state.set("b", "w1", ttl=60)
    gw.clock.advance(20)
    gw.remote.data.clear()  # restarted empty between two requests, reconnected transparently
    gw.remote.epoch = "run-2"

    assert await gw.state.get("a") == "w0"  # answered locally while the write-back starts
    assert await gw.writebacks.next() == 2
    assert gw.remote.data == {"a": "w0", "b": "w1"}
    assert gw.remote.ttls == {"a": 580, "b": 40}
    assert gw.fallbacks == []


async def test_routing_does_not_wait_for_the_writeback() -> None:
    gw = Gateway(GatedRemote())
    remote = gw.remote
    assert isinstance(remote, GatedRemote)
    remote.down = True
    await gw.state.set("k", "old", ttl=600)
    await gw.remote_returns()
    await asyncio.wait_for(remote.entered.wait(), timeout=5)

    # The write-back is stuck on the remote; requests are still answered.
    await gw.state.set("other", "w1", ttl=600)
    assert await gw.state.get("other") == "w1"
    assert await gw.state.get("k") == "old"
    remote.gate.set()
    assert await gw.writebacks.next() == 1


async def test_a_key_set_after_the_remote_returned_is_not_overwritten_by_the_writeback() -> None:
    gw = Gateway(GatedRemote())
    remote = gw.remote
    assert isinstance(remote, GatedRemote)
    remote.down = True
    await gw.state.set("k", "old", ttl=600)
    await gw.remote_returns()
    await asyncio.wait_for(remote.entered.wait(), timeout=5)  # the batch holds k=old

    await gw.state.set("k", "new", ttl=600)
    remote.gate.set()
    assert await gw.writebacks.next() == 0
    assert remote.data["k"] == "new"
    assert await gw.state.get("k") == "new"
    assert gw.state.unsynced == 0


async def test_a_writeback_that_fails_part_way_resumes_when_the_remote_returns_again() -> None:
    gw = Gateway()
    gw.remote.down = True
    keys = [f"k{i}" for i in range(600)]
    for key in keys:
        await gw.state.set(key, "w", ttl=600)
    gw.remote.batches_until_down = 1  # gone again during the write-back's second batch

    await gw.remote_returns()
    first = await gw.writebacks.next()
    assert 0 < first < 600
    assert gw.state.degraded
    assert len(gw.fallbacks) == 2
    assert gw.state.unsynced == 600 - first

    gw.remote.batches_until_down = None
    await gw.remote_returns()
    assert await gw.writebacks.next() == 600 - first
    assert sorted(gw.remote.data) == sorted(keys)
    assert gw.state.unsynced == 0
    assert max(len(batch) for batch in gw.remote.batches) < 600  # batched, not one huge pipeline


async def test_a_writeback_stops_asking_once_a_request_found_the_remote_gone_again() -> None:
    gw = Gateway()
    gw.remote.down = True
    for i in range(600):
        await gw.state.set(f"k{i}", "w", ttl=600)
    remote = gw.remote
    write_batch = remote.set_many_if_absent
    calls_when_gone = 0

    async def first_batch_then_gone(entries: Sequence[Entry]) -> int:
        nonlocal calls_when_gone
        written = await write_batch(entries)
        remote.down = True
        await gw.state.get("lookup")  # a request meanwhile finds it gone: back off
        calls_when_gone = remote.calls
        return written

    remote.set_many_if_absent = first_batch_then_gone
    await gw.remote_returns()
    written = await gw.writebacks.next()
    assert remote.calls == calls_when_gone  # the rest waits for the remote's next return
    assert gw.state.unsynced == 600 - written


async def test_a_second_outage_during_the_writeback_keeps_the_newest_value_for_the_next() -> None:
    gw = Gateway(GatedRemote())
    remote = gw.remote
    assert isinstance(remote, GatedRemote)
    remote.down = True
    await gw.state.set("k", "old", ttl=600)
    await gw.remote_returns()
    await asyncio.wait_for(remote.entered.wait(), timeout=5)

    remote.down = True
    await gw.state.set("k", "new", ttl=600)  # fails: the remote is away again
    remote.gate.set()
    assert await gw.writebacks.next() == 0  # the write-back failed too, and did not crash
    assert gw.state.unsynced == 1

    await gw.remote_returns()
    assert await gw.writebacks.next() == 1
    assert remote.data == {"k": "new"}


@pytest.mark.parametrize("outage_keys", [10, 50])
async def test_what_waits_for_writeback_is_bounded_by_the_local_store(outage_keys: int) -> None:
    gw = Gateway(max_entries=10)
    gw.remote.down = True
    for i in range(outage_keys):
        await gw.state.set(f"k{i}", "w", ttl=600)
        gw.clock.advance(1)  # a long outage: the window passes, the remote is tried again
    assert gw.state.unsynced == 10

    await gw.remote_returns()
    assert await gw.writebacks.next() == 10
    assert sorted(gw.remote.data) == sorted(f"k{i}" for i in range(outage_keys - 10, outage_keys))


async def test_close_cancels_a_writeback_in_flight() -> None:
    gw = Gateway(GatedRemote())
    remote = gw.remote
    assert isinstance(remote, GatedRemote)
    remote.down = True
    await gw.state.set("k", "w", ttl=600)
    await gw.remote_returns()
    await asyncio.wait_for(remote.entered.wait(), timeout=5)

    await asyncio.wait_for(gw.state.close(), timeout=5)
    assert remote.cancelled
    assert remote.closed
    assert remote.data == {}
