"""`Residency`: which models are in the server's memory, eviction to make room, and lazy reload.

The scheduler may place more models on a replica than fit in its memory (overcommit, compat §7.5);
the agent keeps the excess registered but evicted. Room is made the same way for a load from the
scheduler and for a request that needs an evicted model back (`make_room`): under one room lock,
evict idle models, least recently used first, until the model fits, then reserve its memory (it
counts as resident from then on) in the same step, so two loads never count the same free bytes
and a load waiting for room holds none. A model with requests in flight or queued is never
evicted; when the idle ones are not enough, `make_room` waits for requests or loads to end
(bounded by `room_timeout`) rather than evict a busy one.

A reload runs as a task of its own, shared by every request waiting for that model: a client that
goes away does not abort it, and the waiters get its outcome together (one `room_timeout` for all).

Work on one model is serialised by its lock (also used by LOAD and UNLOAD); evictions skip models
whose lock is held (a load or reload under way), so no two locks are ever waited for in opposite
orders. An eviction or reload cut short (the agent stopping) leaves the model as it was before
(loaded, or evicted); a server that did unload it meanwhile answers 404, which reloads it.

Differs from Seldon (compat §7.7): Seldon's agent evicts a model that requests are using (the
request then fails and is retried by the client); here it waits for them. A reload that cannot
get room within `room_timeout` answers 503 (`ModelNotResident`), never a half-served request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from modelyard.agent.state import LocalState, ModelStatus
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
        self._reloads: dict[str, asyncio.Task[None]] = {}
        self._holding: dict[str, int] = {}  # model -> tasks holding or waiting for its lock

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """The model's lock. Whoever holds it or waits for it counts in `_holding`, so an eviction
        never picks that model (it would wait behind them while holding the room lock they may
        need next). The release wakes whoever waits for room: the model may be evictable now, or
        its load failed and freed memory."""
        self._holding[name] = self._holding.get(name, 0) + 1
        try:
            async with self._lock(name):
                yield
        finally:
            left = self._holding[name] - 1
            if left:
                self._holding[name] = left
            else:
                del self._holding[name]
            self.freed()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def freed(self) -> None:
        """Memory may be free now, or a model may have become evictable (a request ended, a model
        was unloaded or evicted): wake whoever waits for room."""
        self._changed.set()

    # Making room ---------------------------------------------------------------------------------

    async def make_room(self, name: str) -> None:
        """Evict idle models until `name` (WAITING or EVICTED) fits in main memory beside the
        resident ones, then reserve its memory (`LocalState.reserve`); waits for busy models to
        become idle, at most `room_timeout`. `NoRoom` then."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._room_timeout
        failed: dict[str, str] = {}  # victims whose unload failed: not tried again by this call
        while True:
            async with self._room:
                held = self._state.get(name)
                if held is None:
                    raise NoRoom(f"{name} was unloaded while it waited for room")
                taken = (set(self._holding) | set(failed)) - {name}
                # A replace in place needs only what the new version takes beyond the old one's
                # bytes, which stay counted while it waits (`replaced_bytes`).
                needed = held.memory_bytes - held.replaced_bytes
                victims = self._state.victims(needed, taken)
                if victims == []:
                    self._state.reserve(name)
                    return
                if victims is not None:
                    for victim in victims:
                        why = await self._evict(victim)
                        if why:
                            failed[victim] = why
                    continue  # look again: an eviction may have failed, or a request come in
                self._changed.clear()
            left = until - loop.time()
            if left <= 0:
                raise NoRoom(self._why_no_room(name, failed))
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()  # a request or a load ended, or a model went away
            except TimeoutError:
                raise NoRoom(self._why_no_room(name, failed)) from None

    def _why_no_room(self, name: str, failed: dict[str, str]) -> str:
        state = self._state
        busy = ", ".join(
            sorted(m.name for m in state if state.busy(m.name) and m.status is ModelStatus.LOADED)
        )
        why = (
            f"no room to load {name}: {state.resident_bytes} of {state.memory_bytes} bytes resident "
            f"after {self._room_timeout:g}s; serving requests: {busy or 'none'}"
        )
        for victim, error in sorted(failed.items()):
            why += f"; could not evict {victim}: {error}"
        return why

    async def _evict(self, name: str) -> str:
        """Unload an idle model from the server, keeping it registered; the error text if the
        server refused (the model stays loaded), else ""."""
        held = self._state.get(name)
        if held is None or held.status is not ModelStatus.LOADED or self._state.busy(name):
            return ""
        if name in self._holding:
            return ""  # a load or reload of it is under way or waiting: not a victim
        async with self.hold(name):  # free and nobody waiting: taken at once
            self._state.begin_evict(name)
            ok = False
            try:
                await self._server.unload(name)
                ok = True
            except ModelyardError as error:
                log.warning("could not evict %s: %s", name, error.message)
                return error.message
            finally:
                self._state.evicted(name, ok=ok)
        log.info("evicted %s (%d bytes): least recently used, to make room", name, held.memory_bytes)
        self._on_evicted(name)
        return ""

    # Serving requests ----------------------------------------------------------------------------

    async def acquire(self, name: str) -> bool:
        """Pin `name` for one request: counted in flight (so it is not evicted), reloaded first if
        it was evicted (the request waits, counted as queued). False when the agent does not hold
        the model, or its own load or unload is under way (the request goes to the server as it
        is, unpinned). `ModelNotResident` when it cannot be reloaded; after True the caller must
        `release`."""
        held = self._state.get(name)
        if held is None:
            return False
        if held.status is ModelStatus.LOADED:
            self._state.pin(name, self._now())
            return True
        self._state.queue(name)
        try:
            while True:
                held = self._state.get(name)
                if held is None or held.status in (
                    ModelStatus.WAITING,
                    ModelStatus.LOADING,
                    ModelStatus.UNLOADING,
                ):
                    # The scheduler's load or unload is under way: the server answers as it stands
                    # (during an in-place replace it serves the old version until the new one is in).
                    return False
                if held.status is ModelStatus.LOADED:
                    self._state.pin(name, self._now())
                    return True
                # Evicted, being evicted or being reloaded: wait for the one reload of it.
                task = self._reloads.get(name)
                if task is None or task.done():
                    task = self._reloads[name] = asyncio.create_task(
                        self._reload(name), name=f"reload-{name}"
                    )
                    # Every waiter may have gone when it fails: its outcome is read here, so it is
                    # never an unretrieved task exception.
                    task.add_done_callback(_outcome_read)
                await asyncio.shield(task)  # a client going away leaves the reload to the others
        finally:
            if self._state.unqueue(name):
                self.freed()  # the model may be evictable now

    def release(self, name: str) -> None:
        if self._state.unpin(name, self._now()):
            self.freed()

    async def _reload(self, name: str) -> None:
        """Load an evicted model again (under its lock), making room first. Ends with it LOADED,
        or EVICTED and `ModelNotResident` for everyone waiting on it."""
        async with self.hold(name):
            held = self._state.get(name)
            if held is None or held.status is not ModelStatus.EVICTED:
                return  # unloaded, loaded or replaced meanwhile: the waiters look again
            started = self._now()
            ok = False
            try:
                await self.make_room(name)
                await self._server.load(name)
                ok = True
            except ModelyardError as error:
                self._on_load(name, "reload", False)
                raise ModelNotResident(f"model {name!r} could not be loaded again: {error.message}") from None
            finally:
                self._state.reloaded(name, self._now(), ok=ok)  # back to EVICTED unless loaded
            self._on_load(name, "reload", True)
            log.info("reloaded %s in %.3fs: a request needed it", name, self._now() - started)

    async def server_ready(self, name: str) -> bool:
        return await self._server.model_ready(name)

    async def force_load(self, name: str) -> None:
        """The server answered 404 for a model the agent holds as loaded (it restarted, or lost
        it): load it again once, under its lock; the caller then retries the request once."""
        async with self.hold(name):
            held = self._state.get(name)
            if held is None or held.status is not ModelStatus.LOADED:
                return  # changed meanwhile (unloaded, replaced, evicted): the retry finds out
            try:
                await self._server.load(name)
            except ModelyardError as error:
                self._on_load(name, "not_found", False)
                raise ModelNotResident(
                    f"model {name!r} was not on the server and could not be loaded: {error.message}"
                ) from None
            self._on_load(name, "not_found", True)
            log.warning("%s: the server did not have it; loaded it again", name)

    async def close(self) -> None:
        """Cancel reloads under way (the agent is stopping)."""
        tasks = [t for t in self._reloads.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reloads.clear()


def _outcome_read(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
