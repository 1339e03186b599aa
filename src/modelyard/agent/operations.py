"""LOAD and UNLOAD: what the agent does for one operation from the scheduler (compat §7.4).

Each operation runs in its own task. Work on one model is serialised by a lock per model *name*
(Seldon locks per `<name>_<version>`; here the inference server sees one name for all versions,
so two versions of a model must not be loaded or unloaded at once). Out-of-order protection is
per `(name, version)`, as in Seldon, checked under the lock and, for an unload, after its grace.

Where it differs from Seldon, and why:
- The model is loaded under its own name; a LOAD of another version replaces the one held (its
  files are swapped, the old ones kept aside, and the server reloads it). When that load fails
  and the server still serves the old version (a failed reload keeps the old model in MLServer),
  the agent keeps it too, puts its files back and reports only the LOAD_FAILED; otherwise neither
  version is loaded, and the agent says so with an UNLOADED for the old version.
- An UNLOAD of a version the agent does not hold (never loaded, replaced, failed) answers UNLOADED
  without touching the server: the server's model of that name may be another version.
- A model larger than the replica's whole memory fails at once (Seldon retries 5 times first).
  Anything else is loaded once the resident models fit, evicting idle ones least recently used
  first (`residency.py`); a LOAD of a version held but evicted answers LOADED without loading it
  (the next request reloads it), as Seldon's agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from modelyard.agent.artefacts import Artefacts, Placed, instance_count
from modelyard.agent.config import AgentConfig
from modelyard.agent.policy import CommandStamps, retry_delays
from modelyard.agent.residency import Residency
from modelyard.agent.state import REGISTERED, HeldModel, LocalState, ModelStatus
from modelyard.errors import ModelyardError
from modelyard.rpc import agent_pb2
from modelyard.telemetry import Span
from modelyard.upstream.repository import RepositoryClient

log = logging.getLogger("modelyard.agent")


class FetchCancelled(ModelyardError):
    """A load whose fetch was stopped because an UNLOAD of that version arrived."""


@dataclass
class _Fetching:
    """A load's fetch under way: an UNLOAD of `version` cancels `task` (and sets `stopped`)."""

    version: int
    task: asyncio.Task[Placed]
    stopped: bool = False


Event = agent_pb2.ModelEvent
_UNDER_WAY = frozenset({ModelStatus.WAITING, ModelStatus.LOADING})
# (model version, event, message, instance count) -> sent (or given up on) when it returns
SendEvent = Callable[
    [agent_pb2.ModelVersion, "agent_pb2.ModelEvent.Event.ValueType", str, int], Awaitable[None]
]


class Operations:
    def __init__(
        self,
        config: AgentConfig,
        state: LocalState,
        server: RepositoryClient,
        artefacts: Artefacts | None,
        send_event: SendEvent,
        rng: random.Random,
        residency: Residency,
        on_load: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self._config = config
        self._state = state
        self._server = server
        self._artefacts = artefacts
        self._send = send_event
        self._rng = rng
        self._residency = residency
        self._on_load = on_load  # (loaded ok): counted in modelyard_model_loads_total
        self._stamps = CommandStamps()
        self._fetching: dict[str, _Fetching] = {}  # by model name: the fetch an UNLOAD stops
        self.draining = False

    def _lock(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._residency.hold(name)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def load(self, model: agent_pb2.ModelVersion, stamp: int, span: Span | None = None) -> None:
        """`span`: the operation's, when tracing: the server's load call carries its context and a
        failure reported to the scheduler marks it failed."""
        name, version = model.name, model.version
        send = self._send if span is None else _marking(self._send, span)
        headers = span.inject(()) if span is not None else ()
        async with self._lock(name):
            if not self._stamps.admit(name, version, stamp):
                log.info("dropped LOAD %s v%d: a newer command for it was handled", name, version)
                return
            held = self._state.get(name)
            if held is not None and held.version == version and held.status in REGISTERED:
                await send(model, Event.LOADED, "", held.instance_count)  # a repeated LOAD
                return
            too_large = self._state.too_large(model.memory_bytes)
            if too_large:
                await send(model, Event.LOAD_FAILED, too_large, 0)
                return
            fetch = self._artefacts is not None and bool(model.storage_uri)
            replaced = self._state.begin_load(name, version, model.memory_bytes, self._now(), stamp)
            previous: list[Path] = []  # the replaced version's files, kept aside until the load ends
            try:
                await self._residency.make_room(name)  # evicts idle models when overcommitted
                instances = await self._load_on_server(model, fetch, replaced is not None, previous, headers)
            except asyncio.CancelledError:  # the agent is stopping: leave no load half-registered
                current = self._state.get(name)
                if current is not None and current.version == version and current.status in _UNDER_WAY:
                    self._state.forget(name)
                raise
            except Exception as error:  # whatever went wrong, the scheduler hears of it
                failed = self._state.forget(name)
                if replaced is not None:  # held while it is found out whether it still serves: the
                    self._state.restore(replaced)  # data plane forwards only for models held
                self._residency.freed()
                # Stopped by an UNLOAD: the scheduler expects that UNLOAD's answer (UNLOADED, sent
                # by it once this returns), not a LOAD_FAILED for a replica it is unloading.
                stopped = isinstance(error, FetchCancelled)
                if stopped:
                    log.info("load of %s v%d stopped: %s", name, version, error)
                else:
                    self._on_load(False)
                why = _describe(error)
                if replaced is not None and await self._kept(replaced, previous, version):
                    if not stopped:
                        await send(
                            model, Event.LOAD_FAILED, f"{why}; version {replaced.version} serves on", 0
                        )
                    return
                if replaced is not None and self._state.get(name) is replaced:
                    self._state.forget(name)  # it does not serve on
                ours = (failed is not None and failed.fetched) or (replaced is not None and replaced.fetched)
                await self._clean_up_failed(model, replaced is not None, ours, previous)
                if not stopped:
                    await send(model, Event.LOAD_FAILED, why, 0)
                if replaced is not None:
                    old = agent_pb2.ModelVersion(name=name, version=replaced.version)
                    await send(old, Event.UNLOADED, f"replaced by version {version}, which failed", 0)
                return
            if previous and self._artefacts is not None:
                await asyncio.to_thread(self._artefacts.discard, previous[0])
            self._state.loaded_ok(name, version, self._now(), instances)
            self._on_load(True)
            if self.draining:  # as Seldon: a load that ends while draining must not attract traffic
                await send(model, Event.LOAD_FAILED, "server replica is draining", 0)
                return
            log.info("loaded %s v%d", name, version)
            await send(model, Event.LOADED, "", instances)

    async def _kept(self, replaced: HeldModel, previous: list[Path], failed: int) -> bool:
        """`_keep_replaced`, where anything going wrong (the files cannot be put back) means the
        old version is not kept: the caller then cleans up and reports both versions."""
        try:
            return await self._keep_replaced(replaced, previous, failed)
        except Exception:
            log.exception("could not keep %s v%d after a failed replace", replaced.name, replaced.version)
            if self._state.get(replaced.name) is replaced:
                self._state.forget(replaced.name)
            return False

    async def _keep_replaced(self, replaced: HeldModel, previous: list[Path], failed: int) -> bool:
        """After a failed replace: whether the version it replaced still serves, and so stays held
        (with its files put back). A server whose reload failed keeps the model it had (MLServer,
        the sim-worker); an evicted one was not in the server's memory anyway."""
        name = replaced.name
        if replaced.status is not ModelStatus.EVICTED and not await self._server.model_ready(name):
            return False
        if previous and self._artefacts is not None:
            await asyncio.to_thread(self._artefacts.restore, name, previous[0])
        self._state.restore(replaced)
        log.warning("load of %s v%d failed; v%d serves on", name, failed, replaced.version)
        return True

    async def _load_on_server(
        self,
        model: agent_pb2.ModelVersion,
        fetch: bool,
        replacing: bool,
        previous: list[Path],
        headers: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Fetch the artefact (once), then load with bounded retries; the instance count if known.
        When `replacing`, the files the fetch replaced are kept aside in `previous`."""
        model_dir = None
        if fetch:
            placed, stopped = await self._fetch(model, replacing)
            if placed.previous is not None:
                previous.append(placed.previous)
            model_dir = placed.path
            # Only now, once files the agent made were swapped in, are they the agent's to delete.
            self._state.set_fetched(model.name, model.version, placed.owned)
            if stopped:  # as its files were swapped in: they are recorded, so they go with the rest
                raise FetchCancelled(f"an unload of version {model.version} arrived")
        attempts = self._config.load_attempts
        delays = retry_delays(attempts, self._config.load_backoff, self._config.load_backoff_max, self._rng)
        for attempt in range(1, attempts + 1):
            try:
                await self._server.load(model.name, headers)
                break
            except ModelyardError as error:
                if attempt == attempts:
                    raise ModelyardError(
                        f"load of {model.name} failed after {attempts} attempt(s): {error.message}"
                    ) from None
                log.warning("load %s attempt %d/%d failed: %s", model.name, attempt, attempts, error.message)
                await asyncio.sleep(delays[attempt - 1])  # the backoff between load attempts
        return await asyncio.to_thread(instance_count, model_dir) if model_dir is not None else 0

    async def _fetch(self, model: agent_pb2.ModelVersion, replacing: bool) -> tuple[Placed, bool]:
        """The artefact fetched in a task of its own, which an UNLOAD of this version cancels
        (`stop_fetch`): FetchCancelled then, once the fetch has stopped and cleaned up. Also
        says whether an UNLOAD came just as the fetch ended (its files are swapped in: the
        caller records them, then gives up)."""
        assert self._artefacts is not None
        work = self._artefacts.fetch(model.name, model.storage_uri, keep_previous=replacing)
        task = asyncio.create_task(work, name=f"agent-fetch-{model.name}")
        fetching = self._fetching[model.name] = _Fetching(model.version, task)
        try:
            placed = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if fetching.stopped and (current is None or not current.cancelling()):
                raise FetchCancelled(f"an unload of version {model.version} arrived") from None
            raise  # the agent is stopping
        finally:
            if self._fetching.get(model.name) is fetching:
                del self._fetching[model.name]
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise asyncio.CancelledError  # the agent is stopping: it came as the files were placed
        return placed, fetching.stopped

    def stop_fetch(self, name: str, version: int) -> bool:
        """Cancel the fetch of `name` at `version` if one is under way (an UNLOAD of it arrived,
        the model was deleted): its transfer stops and its partial files go. True if one was."""
        fetching = self._fetching.get(name)
        if fetching is None or fetching.version != version or fetching.stopped:
            return False
        fetching.stopped = True
        fetching.task.cancel()
        log.info("stopping the fetch of %s v%d: it is being unloaded", name, version)
        return True

    async def _clean_up_failed(
        self, model: agent_pb2.ModelVersion, replacing: bool, ours: bool, previous: list[Path]
    ) -> None:
        if previous and self._artefacts is not None:
            await asyncio.to_thread(self._artefacts.discard, previous[0])
        if replacing:  # the server may still serve the old version under this name: take it down
            try:
                await self._server.unload(model.name)
            except ModelyardError as error:
                log.warning("unload of %s after a failed replace: %s", model.name, error.message)
        # The files go only if this agent swapped them in (this fetch, or the replaced version's);
        # `remove` checks the marker too, so a user's directory is never deleted.
        if ours and self._artefacts is not None:
            await asyncio.to_thread(self._artefacts.remove, model.name)

    async def unload(self, model: agent_pb2.ModelVersion, stamp: int, span: Span | None = None) -> None:
        name, version = model.name, model.version
        send = self._send if span is None else _marking(self._send, span)
        # At once, before the grace and the lock (which the load holds while it fetches): a fetch
        # of this version stops now, its load ends, and this unload then finds nothing held.
        self.stop_fetch(name, version)
        if self._config.unload_grace > 0:
            # Seldon's grace (compat §7.4, §13.14): routes stop sending before the model goes, and
            # a LOAD received meanwhile wins over this UNLOAD (the stamp check below).
            await asyncio.sleep(self._config.unload_grace)
        async with self._lock(name):
            if not self._stamps.admit(name, version, stamp):
                log.info("dropped UNLOAD %s v%d: a newer command for it was handled", name, version)
                return
            held = self._state.get(name)
            if held is None or held.version != version:
                await send(model, Event.UNLOADED, "", 0)
                return
            evicted = held.status is ModelStatus.EVICTED  # not on the server: nothing to unload there
            self._state.begin_unload(name, version)
            try:
                if not evicted:
                    headers = span.inject(()) if span is not None else ()
                    await self._server.unload(name, headers)  # one attempt, as Seldon's default
            except Exception as error:
                self._state.unload_failed(name, version)
                await send(model, Event.UNLOAD_FAILED, _describe(error), 0)
                return
            self._state.forget(name)
            self._residency.freed()
            if held.fetched and self._artefacts is not None:
                await asyncio.to_thread(self._artefacts.remove, name)
            log.info("unloaded %s v%d", name, version)
            await send(model, Event.UNLOADED, "", 0)


_FAILED = frozenset({Event.LOAD_FAILED, Event.UNLOAD_FAILED})


def _marking(send: SendEvent, span: Span) -> SendEvent:
    """`send`, marking `span` failed when what it sends is a failure (the operation's outcome)."""

    async def sending(
        model: agent_pb2.ModelVersion, event: agent_pb2.ModelEvent.Event.ValueType, message: str, count: int
    ) -> None:
        if event in _FAILED:
            span.fail(message or "failed", Event.Event.Name(event))
        await send(model, event, message, count)

    return sending


def _describe(error: Exception) -> str:
    """The text an event carries: our errors' messages as they are; anything else (a corrupt
    archive, a disk error) with its type, and logged with its traceback, since it is a surprise."""
    if isinstance(error, ModelyardError):
        return error.message
    log.error("unexpected error in an operation", exc_info=error)
    return f"{type(error).__name__}: {error}"
