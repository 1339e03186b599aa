"""`Residency`: which models are in the server's memory, eviction to make room, and lazy reload.

The scheduler may place more models on a replica than fit in its memory (overcommit, compat §7.5);
the agent keeps the excess registered but evicted. Room is made the same way for a load from the
scheduler and for a request that needs an evicted model back: the caller counts the model as
resident first (a reservation, so two loads never count the same free bytes), then `make_room`
evicts idle models, least recently used first, until the resident models fit. A model with
requests in flight or queued is never evicted; when the idle ones are not enough, `make_room`
waits for requests to finish (bounded by `room_timeout`) rather than evict a busy one.

Work on one model is serialised by its lock (also used by LOAD and UNLOAD); evictions are
serialised by one room lock, and skip models whose lock is held (a load or reload under way), so
no two locks are ever waited for in opposite orders.

Differs from Seldon (compat §7.7): Seldon's agent evicts a model that requests are using (the
request then fails and is retried by the client); here it waits for them. A reload that cannot
get room within `room_timeout` answers 503 (`ModelNotResident`), never a half-served request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from modelyard.agent.state import HeldModel, LocalState, ModelStatus
from modelyard.errors import ModelNotResident, ModelyardError
from modelyard.upstream.repository import RepositoryClient

log = logging.getLogger("modelyard.agent")


class NoRoom(ModelyardError):
    """The resident models cannot be made to fit: too many are serving requests."""


class Residency:
    def __init__(
        self,
        state: LocalState,
        server: RepositoryClient,
        *,
        room_timeout: float,
        on_evicted: Callable[[str], None] = lambda name: None,
        on_load: Callable[[str, str, bool], None] = lambda name, why, ok: None,
    ) -> None:
        self._state = state
        self._server = server
        self._room_timeout = room_timeout
        self._on_evicted = on_evicted  # (model)
        self._on_load = on_load  # (model, "reload" | "not_found", ok)
        self._locks: dict[str, asyncio.Lock] = {}
        self._room = asyncio.Lock()
        self._changed = asyncio.Event()  # set when memory may have been freed; waiters clear it

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """The model's lock. Its release wakes whoever waits for room: a model whose lock was held
        could not be evicted, and may be now (or its load failed and freed memory)."""
        async with self._lock(name):
            yield
        self.freed()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def freed(self) -> None:
        """Memory may be free now, or a model may have become evictable (a request ended, a model
        was unloaded or evicted): wake whoever waits for room."""
        self._changed.set()

    # Making room ---------------------------------------------------------------------------------

    async def make_room(self, name: str) -> None:
        """Evict idle models until the resident ones (`name`'s reservation included) fit in main
        memory; waits for busy ones to become idle, at most `room_timeout`. `NoRoom` then."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._room_timeout
        while True:
            async with self._room:
                locked = {n for n, lock in self._locks.items() if lock.locked() and n != name}
                victims = self._state.victims(locked | {name})
                if victims == []:
                    return
                if victims is not None:
                    for victim in victims:
                        await self._evict(victim)
                    continue  # look again: an eviction may have failed, or a request come in
                self._changed.clear()
            left = until - loop.time()
            if left <= 0:
                raise NoRoom(self._why_no_room(name))
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()  # a request ended or a model went away
            except TimeoutError:
                raise NoRoom(self._why_no_room(name)) from None

    def _why_no_room(self, name: str) -> str:
        busy = ", ".join(sorted(m.name for m in self._state if m.busy and m.status is ModelStatus.LOADED))
        return (
            f"no room to load {name}: {self._state.resident_bytes} of {self._state.memory_bytes} bytes "
            f"resident and still needed after {self._room_timeout:g}s; serving requests: {busy or 'none'}"
        )

    async def _evict(self, name: str) -> None:
        held = self._state.get(name)
        if held is None or held.status is not ModelStatus.LOADED or held.busy or self._lock(name).locked():
            return
        async with self.hold(name):
            self._state.begin_evict(name)
            try:
                await self._server.unload(name)
            except ModelyardError as error:
                log.warning("could not evict %s: %s", name, error.message)
                self._state.evicted(name, ok=False)
                raise NoRoom(f"could not evict {name} to make room: {error.message}") from None
            self._state.evicted(name, ok=True)
        log.info("evicted %s (%d bytes): least recently used, to make room", name, held.memory_bytes)
        self._on_evicted(name)

    # Serving requests ----------------------------------------------------------------------------

    async def acquire(self, name: str) -> HeldModel | None:
        """Pin `name` for one request: counted in flight (so it is not evicted), reloaded first if
        it was evicted (the request waits, counted as queued). None when the agent does not hold
        the model (the request goes to the server as it is). `ModelNotResident` when it cannot be
        reloaded; the caller must `release` a returned model."""
        held = self._state.get(name)
        if held is None:
            return None
        if held.status is ModelStatus.LOADED:
            held.in_flight += 1
            self._state.touch(name, self._now())
            return held
        if held.status in (ModelStatus.LOADING, ModelStatus.UNLOADING):
            # The scheduler's load or unload is under way: the server answers as it stands (during
            # an in-place replace it serves the old version until the new one is in).
            return None
        waiting = held  # the record counted as queued (a LOAD may replace it meanwhile)
        waiting.queued += 1
        try:
            async with self.hold(name):  # a load, unload or eviction under way ends first
                held = self._state.get(name)
                if held is None or held.status not in (ModelStatus.LOADED, ModelStatus.EVICTED):
                    return None  # unloaded, or being unloaded, meanwhile: the server answers
                if held.status is ModelStatus.EVICTED:
                    await self._reload(held, "reload")
                held.in_flight += 1  # pinned before the lock is released
                self._state.touch(name, self._now())
                return held
        finally:
            waiting.queued -= 1

    def release(self, held: HeldModel) -> None:
        held.in_flight -= 1
        self._state.touch(held.name, self._now())
        if held.in_flight == 0:
            self.freed()

    async def _reload(self, held: HeldModel, why: str) -> None:
        """Load an evicted model again (under its lock), making room first."""
        name = held.name
        started = self._now()
        self._state.begin_reload(name)
        try:
            await self.make_room(name)
            await self._server.load(name)
        except ModelyardError as error:
            self._state.reloaded(name, self._now(), ok=False)
            self.freed()
            self._on_load(name, why, False)
            raise ModelNotResident(f"model {name!r} could not be loaded again: {error.message}") from None
        self._state.reloaded(name, self._now(), ok=True)
        self._on_load(name, why, True)
        log.info("reloaded %s in %.3fs: a request needed it", name, self._now() - started)

    async def server_ready(self, name: str) -> bool:
        return await self._server.model_ready(name)

    async def force_load(self, held: HeldModel) -> None:
        """The server answered 404 for a model the agent holds as loaded (it restarted, or lost
        it): load it again once, under its lock; the caller then retries the request once."""
        async with self.hold(held.name):
            current = self._state.get(held.name)
            if current is not held or held.status is not ModelStatus.LOADED:
                return  # changed meanwhile (unloaded, replaced): the retry finds out
            try:
                await self._server.load(held.name)
            except ModelyardError as error:
                self._on_load(held.name, "not_found", False)
                raise ModelNotResident(
                    f"model {held.name!r} was not on the server and could not be loaded: {error.message}"
                ) from None
            self._on_load(held.name, "not_found", True)
            log.warning("%s: the server did not have it; loaded it again", held.name)
