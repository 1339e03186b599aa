import asyncio

import pytest

from modelyard.simworker import SimWorkerConfig
from modelyard.simworker.engine import SimEngine

FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0}


def engine(**overrides) -> SimEngine:
    return SimEngine(SimWorkerConfig(**{**FAST, **overrides}))


async def test_zero_costs_never_sleep(monkeypatch):
    async def no_sleep(delay, result=None):
        raise AssertionError("slept with zero costs")

    sim = engine(block_tokens=2)
    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    async with sim.admit([["a", "b", "c"]], 4) as run:
        for _ in range(4):
            await run.step()
        await run.steps(3)
    assert sim.stats.completion_tokens_total == 7
    assert sim.stats.prompt_tokens_total == 3


async def test_counts_prefix_cache_queries_and_hits():
    sim = engine(block_tokens=2)
    for _ in range(2):
        async with sim.admit([["a", "b", "c", "d", "e"]], 1) as run:
            pass
    assert run.cached_tokens == 4
    assert sim.stats.prefix_cache_queries_tokens == 10
    assert sim.stats.prefix_cache_hits_tokens == 4


async def test_use_cache_false_skips_the_cache():
    sim = engine(block_tokens=2)
    for _ in range(2):
        async with sim.admit([["a", "b"]], 0, use_cache=False) as run:
            pass
    assert run.cached_tokens == 0
    assert sim.stats.prefix_cache_queries_tokens == 0
    assert len(sim.cache) == 0


async def test_kv_blocks_are_held_while_running():
    sim = engine(block_tokens=4, cache_blocks=10)
    async with sim.admit([["w"] * 6], 6):
        assert sim.stats.kv_blocks_in_use == 3
        assert sim.cache_usage == pytest.approx(0.3)
    assert sim.stats.kv_blocks_in_use == 0


async def test_excess_requests_wait_for_a_slot_in_order():
    sim = engine(max_concurrency=1)
    order: list[str] = []

    async def request(name: str, release: asyncio.Event | None = None) -> None:
        async with sim.admit([[name]], 0):
            order.append(name)
            if release is not None:
                await release.wait()

    release = asyncio.Event()
    first = asyncio.create_task(request("first", release))
    await asyncio.sleep(0)  # let it take the slot
    second = asyncio.create_task(request("second"))
    third = asyncio.create_task(request("third"))
    await asyncio.sleep(0)
    assert (sim.stats.running, sim.stats.waiting) == (1, 2)
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second, third), timeout=5)
    assert order == ["first", "second", "third"]
    assert (sim.stats.running, sim.stats.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue():
    sim = engine(max_concurrency=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with sim.admit([], 0):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert sim.stats.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert sim.stats.waiting == 0
    release.set()
    await asyncio.wait_for(holder, timeout=5)
    assert sim.stats.running == 0


async def test_raising_max_concurrency_admits_waiters():
    sim = engine(max_concurrency=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with sim.admit([], 0):
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(3)]
    await asyncio.sleep(0)
    assert (sim.stats.running, sim.stats.waiting) == (1, 2)
    sim.update_config({"max_concurrency": 3})
    assert (sim.stats.running, sim.stats.waiting) == (3, 0)
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert sim.stats.running == 0


def test_runtime_config_changes_are_validated():
    sim = engine()
    assert sim.update_config({"slowdown": 5}).slowdown == 5
    assert sim.config.costs.decode_ms() == 0.0
    with pytest.raises(ValueError, match="port"):
        sim.update_config({"port": 1})
    with pytest.raises(ValueError, match="fail_rate"):
        sim.update_config({"fail_rate": 2})
    assert sim.config.slowdown == 5


def test_fail_rate_uses_the_seeded_generator():
    def outcomes(seed: int) -> list[bool]:
        sim = engine(fail_rate=0.5, seed=seed)
        return [sim.should_fail() for _ in range(50)]

    assert outcomes(1) == outcomes(1)
    assert 0 < sum(outcomes(1)) < 50
    assert not any(engine(fail_rate=0.0).should_fail() for _ in range(50))
    assert all(engine(fail_rate=1.0).should_fail() for _ in range(50))


async def test_a_batching_server_decodes_slower_as_its_batch_grows():
    engine = SimEngine(SimWorkerConfig(decode_ms_per_token=10.0, batch_slowdown=0.5, max_concurrency=4))
    assert engine.decode_ms(2) == 20.0  # alone
    async with engine.admit([["a"]], 1), engine.admit([["b"]], 1), engine.admit([["c"]], 1):
        assert engine.decode_ms(2) == 20.0 * (1 + 0.5 * 2)  # two others running beside it
    assert engine.decode_ms(1) == 10.0
    flat = SimEngine(SimWorkerConfig(decode_ms_per_token=10.0, max_concurrency=4))
    async with flat.admit([["a"]], 1), flat.admit([["b"]], 1):
        assert flat.decode_ms(1) == 10.0  # batch_slowdown 0: slots run as if alone
