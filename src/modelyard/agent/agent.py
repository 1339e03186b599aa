"""`Agent`: one agent beside one inference-server replica, and its connection to the scheduler.

Start (compat §7.2): wait for the server to be live, unload what it serves that this agent did
not load (unless `keep_existing`), then subscribe holding nothing. The subscription carries the
replica's config, the models held with their versions and the available memory; when the stream
ends or breaks the agent subscribes again after an exponential backoff with jitter
(`reconnect_backoff` .. `reconnect_backoff_max`, 2 s by default), re-sending what it holds, for as
long as it runs: the scheduler may be down for a while, and once it is back the agent is too within
about `reconnect_backoff_max` (a connect attempt that waited counts towards the backoff), well
before the scheduler's resync gives up on it. A failure is logged when it differs from the one
before (a scheduler that stays down is one warning, not one per attempt). Each operation is stamped
on receipt and handled in its own task (`operations.py`).

Security: the connection to the scheduler is TLS with `scheduler_tls` and carries the join token
(`rpc/agent_client.py`); the data plane serves TLS with `tls` and forwards inference paths only
(`dataplane.py`). An agent others can reach, or that reaches a scheduler elsewhere, without TLS and
a credential does not start unless `insecure` (`config.check_exposure`), which is warned once.

At start, with a repository, the staging and swapped-out directories an interrupted fetch left
behind are deleted (their names are the agent's own; see `artefacts.py` for what else it deletes).

The data plane (`dataplane.py`, on `port`) is where the gateway sends requests: the agent
advertises its URL to the scheduler as the replica's inference URL (or `advertise_url`), counts
requests per model, and reloads evicted models for them (`residency.py`); `/metrics` is there too.

Differs from Seldon: the files of models found at start are left in place (they may be the
user's, not ours); with `keep_existing` the models stay loaded too, though the agent does not
report them (the scheduler did not place them).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

from modelyard.agent.artefacts import Artefacts, fetch_policy
from modelyard.agent.config import AgentConfig, check_exposure, exposure
from modelyard.agent.dataplane import DataPlane
from modelyard.agent.metrics import AgentMetrics
from modelyard.agent.operations import Operations
from modelyard.agent.policy import Backoff
from modelyard.agent.residency import Residency
from modelyard.agent.state import LocalState
from modelyard.config import ListenConfig
from modelyard.errors import Conflict, ModelyardError, NotFound, SchedulerUnavailable
from modelyard.rpc import AgentClient, agent_pb2
from modelyard.rpc.agent_client import KEEPALIVE
from modelyard.serving import HttpServer
from modelyard.telemetry import TRACEPARENT, Attributes, Span, build_tracer
from modelyard.upstream.repository import RepositoryClient

log = logging.getLogger("modelyard.agent")

# A stream that lived this long counts as established: the next reconnect starts from the
# shortest backoff again (the scheduler sends nothing on subscribe, so there is no other signal).
_STABLE_AFTER = 1.0


class Agent:
    """Usable as `async with Agent(config) as agent:`; `start()` returns once subscribing began."""

    def __init__(self, config: AgentConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.tracer = build_tracer(config.telemetry, "modelyard-agent")
        self.state = LocalState(config.memory_bytes, config.overcommit_percent)
        self._rng = rng or random.Random()
        self._server = RepositoryClient(config.inference_url, timeout=config.request_timeout)
        artefacts = None
        if config.repository is not None:
            artefacts = Artefacts(
                config.repository,
                max_bytes=config.max_artefact_bytes,
                timeout=config.fetch_timeout,
                policy=fetch_policy(config),
            )
        self._artefacts = artefacts
        token = config.scheduler_token
        self._client = AgentClient(  # the TLS and token files checked now (one line naming the file)
            config.scheduler,
            connect_timeout=config.connect_timeout,
            keepalive=KEEPALIVE,  # a scheduler that went silent is noticed within about 20 s
            tls=config.scheduler_tls,
            token=token.get_secret_value() if token is not None else None,
            token_file=str(config.scheduler_token_file) if config.scheduler_token_file else None,
            reconnect_backoff_max=config.reconnect_backoff_max,
        )
        self.metrics = AgentMetrics(self.state, _loop_time)
        self.residency = Residency(
            self.state,
            self._server,
            room_timeout=config.room_timeout,
            on_evicted=self.metrics.evicted,
            on_load=self.metrics.reloaded,
        )
        self._ops = Operations(
            config,
            self.state,
            self._server,
            artefacts,
            self._send_event,
            self._rng,
            self.residency,
            on_load=self.metrics.loaded,
        )
        self._data_plane: DataPlane | None = None
        self._http: HttpServer | None = None
        if config.port is not None:
            self._data_plane = DataPlane(
                self.state,
                self.residency,
                self.metrics,
                config.inference_url,
                timeout=config.proxy_timeout,
                draining=lambda: self.draining,
                subscribed=lambda: self.subscribed,
                max_connections=config.max_server_connections,
            )
            listen = ListenConfig(
                host=config.host, port=config.port, drain_seconds=0.0, shutdown_timeout=30.0, tls=config.tls
            )
            self._http = HttpServer(self._data_plane.app(config.max_body_bytes), listen)
        # Every file checked first (fetch, scheduler TLS and token, data-plane TLS), then where it runs.
        check_exposure(config)  # plain text only on loopback, unless insecure
        self._received = 0  # receive stamps (compat §7.6)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self.subscriptions = 0  # subscribe calls sent on a connected channel so far
        self._stopping = False
        self._opened_at: float | None = None  # when the current subscription's channel opened
        self.subscribed = False  # a subscription stream is open now (the agent's readiness)
        self._stats: asyncio.Task[None] | None = None
        self._failures = _Failures(config.scheduler)
        self._settled: asyncio.TimerHandle | None = None  # when the open stream counts as accepted

    @property
    def url(self) -> str:
        """Where the gateway sends this replica's requests: the data plane, or the server itself."""
        if self.config.advertise_url is not None:
            return self.config.advertise_url
        if self._http is not None and self._http.url:
            return self._http.url
        return self.config.inference_url

    @property
    def pending_operations(self) -> int:
        """Operations received and not finished yet (each runs in its own task)."""
        return len(self._tasks)

    async def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("agent already started")
        for missing in exposure(self.config):  # only with insecure: check_exposure refused it otherwise
            log.warning("--insecure: %s", missing)
        await self._server.wait_live(self.config.server_live_timeout)
        if self._artefacts is not None:  # half-done fetches of an agent that was killed
            for leftover in await asyncio.to_thread(self._artefacts.clean_leftovers):
                log.info("removed %s: left in the repository by an interrupted fetch", leftover)
        if not self.config.keep_existing:
            await self._unload_existing()
        if self._http is not None:
            await self._http.start()
            log.info("data plane on %s, forwarding to %s", self._http.url, self.config.inference_url)
        self._loop = asyncio.create_task(self._run(), name="agent-subscribe")
        if self._http is not None:  # only the data plane sees requests: no usage to report without it
            self._stats = asyncio.create_task(self._report_usage(), name="agent-stats")

    async def _unload_existing(self) -> None:
        for model in await self._server.index():
            if not model.ready:
                continue
            try:
                await self._server.unload(model.name)
                log.info("unloaded %s: the server had it before this agent started", model.name)
            except ModelyardError as error:
                log.warning("could not unload %s found at start: %s", model.name, error.message)

    def subscribe_request(self) -> agent_pb2.SubscribeRequest:
        config = self.config
        return agent_pb2.SubscribeRequest(
            server_name=config.server_name,
            replica_idx=config.replica_idx,
            shared=True,  # as Seldon's agents always say (compat §13.11)
            replica_config=agent_pb2.ReplicaConfig(
                inference_url=self.url,
                memory_bytes=config.memory_bytes,
                capabilities=config.capabilities,
                over_commit_percentage=config.overcommit_percent,
            ),
            loaded_models=[
                agent_pb2.LoadedModel(
                    name=m.name,
                    version=m.version,
                    runtime_info=agent_pb2.RuntimeInfo(instance_count=m.instance_count),
                )
                for m in self.state.loaded()
            ],
            available_memory_bytes=self.state.available_bytes,
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(self.config.reconnect_backoff, self.config.reconnect_backoff_max, self._rng)
        failing = self._failures
        while not self._stopping:
            self._opened_at = None  # set by `_opened` once the channel is connected
            attempt = loop.time()
            try:
                stream = self._client.subscribe(self.subscribe_request(), on_open=self._opened)
                async for operation in stream:
                    self._dispatch(operation)
                log.info("the scheduler ended the subscription; subscribing again")
            except ModelyardError as error:
                failing.failed(error.message, loop.time())
            except Exception:  # a bug must not end the agent's only link to the scheduler: retry
                log.exception("subscription to %s failed unexpectedly; retrying", self.config.scheduler)
            finally:
                self.subscribed = False
                if self._settled is not None:
                    self._settled.cancel()
                    self._settled = None
            if self._stopping:
                return
            # Only a stream that was open for a while resets the backoff: counting from before the
            # connect wait (up to connect_timeout) would reset it on every unreachable attempt.
            if self._opened_at is not None and loop.time() - self._opened_at >= _STABLE_AFTER:
                backoff.reset()
            delay = backoff.next_delay()
            if self._opened_at is None:  # it never connected: the time it waited counts
                delay -= loop.time() - attempt
            await asyncio.sleep(max(0.0, delay))  # reconnect backoff

    def usage_report(self) -> agent_pb2.AgentStatsRequest:
        """What the data plane counted per registered model, for the scheduler's autoscaling."""
        now = _loop_time()
        return agent_pb2.AgentStatsRequest(
            server_name=self.config.server_name,
            replica_idx=self.config.replica_idx,
            models=[
                agent_pb2.ModelStats(
                    name=m.name,
                    version=m.version,
                    in_flight=self.state.in_flight(m.name),
                    queued=self.state.queued(m.name),
                    idle_seconds=0.0 if self.state.busy(m.name) else max(0.0, now - m.last_used),
                )
                for m in self.state.loaded()
            ],
        )

    async def _report_usage(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.stats_interval)  # the reporting period
            opened = self._opened_at
            if opened is None or _loop_time() - opened < _STABLE_AFTER:
                continue  # not subscribed (or refused a moment ago): the scheduler does not know it
            try:
                await self._client.stats(self.usage_report())
            except ModelyardError as error:  # the next report replaces it; the stream reconnects
                log.debug("usage report not delivered: %s", error.message)

    def _opened(self) -> None:
        self.subscriptions += 1
        self.subscribed = True
        loop = asyncio.get_running_loop()
        self._opened_at = loop.time()
        # A stream that stays open this long was accepted: a streak of failures is over.
        self._settled = loop.call_later(_STABLE_AFTER, self._failures.over, self._opened_at)

    def _dispatch(self, operation: agent_pb2.ModelOperation) -> None:
        self._received += 1
        stamp = self._received
        model = operation.model_version
        if operation.operation == agent_pb2.ModelOperation.LOAD_MODEL:
            kind = "load"
        elif operation.operation == agent_pb2.ModelOperation.UNLOAD_MODEL:
            kind = "unload"
        else:
            log.warning("ignored operation %d for %s", operation.operation, model.name)
            return
        span = None
        if self.tracer is not None:  # a child of the scheduler's span that sent the operation
            sent = [(TRACEPARENT, operation.traceparent)] if operation.traceparent else []
            attributes: Attributes = {
                "modelyard.model": model.name,
                "modelyard.model_version": model.version,
                "modelyard.server": self.config.server_name,
                "modelyard.replica": self.config.replica_idx,
            }
            span = self.tracer.start(f"{kind} {model.name}", sent, "server", attributes)
        operate = self._ops.load if kind == "load" else self._ops.unload
        work = operate(model, stamp, span)
        if span is not None:
            work = _ending(work, span)
        task = asyncio.create_task(work, name=f"agent-op-{model.name}-{stamp}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("operation %s failed", task.get_name(), exc_info=task.exception())

    async def _send_event(
        self,
        model: agent_pb2.ModelVersion,
        event: agent_pb2.ModelEvent.Event.ValueType,
        message: str,
        instance_count: int,
    ) -> None:
        """Report an operation's outcome; a few tries while the scheduler is unreachable. A lost
        event is recovered by the re-sync: a resubscribe reports what is held."""
        backoff = Backoff(0.1, 2.0, self._rng)
        for attempt in range(1, self.config.event_attempts + 1):
            request = agent_pb2.ModelEvent(
                server_name=self.config.server_name,
                replica_idx=self.config.replica_idx,
                model_name=model.name,
                model_version=model.version,
                event=event,
                message=message,
                available_memory_bytes=self.state.available_bytes,  # as it is when sent
                runtime_info=agent_pb2.RuntimeInfo(instance_count=instance_count),
            )
            try:
                await self._client.event(request)
                return
            except Conflict as error:  # the scheduler does not expect it: nothing to retry
                log.warning("scheduler refused event for %s: %s", model.name, error.message)
                return
            except SchedulerUnavailable as error:
                if attempt == self.config.event_attempts:
                    log.warning("event for %s not delivered: %s", model.name, error.message)
                    return
            except ModelyardError as error:
                log.warning("event for %s not delivered: %s", model.name, error.message)
                return
            await asyncio.sleep(backoff.next_delay())  # the scheduler may be restarting

    @property
    def draining(self) -> bool:
        """Once `drain` was called: the replica is not ready for new models (compat §8)."""
        return self._ops.draining

    async def drain(self, deadline: float | None = None) -> bool:
        """Ask the scheduler to move this replica's models elsewhere (compat §8) and wait until it
        has: True once each serves on another replica or cannot be placed, False when `deadline`
        seconds (None: no bound) passed first or the scheduler said it gave up. Loads that finish
        from now on report LOAD_FAILED "server replica is draining", as in Seldon. While the
        scheduler is unreachable, or has not registered this replica yet (a re-subscribe in
        progress), the request is sent again with backoff within the deadline."""
        self._ops.draining = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        held = len(self.state.loaded())
        log.info(
            "draining: not ready for new models; asking the scheduler to move %d model(s) (timeout %s)",
            held,
            "none" if deadline is None else f"{deadline:g}s",
        )
        request = agent_pb2.AgentDrainRequest(
            server_name=self.config.server_name, replica_idx=self.config.replica_idx
        )
        backoff = Backoff(0.1, 2.0, self._rng)
        while True:
            remaining = None if deadline is None else deadline - (loop.time() - started)
            if remaining is not None and remaining <= 0:
                log.warning("drain: not confirmed within %gs", deadline)
                return False
            try:
                done = await self._client.drain(request, deadline=remaining)
            except (SchedulerUnavailable, NotFound) as error:
                log.warning("drain: %s; asking again", error.message)
                pause = backoff.next_delay()
                if remaining is not None:
                    pause = min(pause, remaining)
                await asyncio.sleep(pause)  # the scheduler may be restarting, or we re-subscribing
                continue
            took = loop.time() - started
            if done:
                log.info("drained in %.2fs: every model serves elsewhere or cannot be placed", took)
            else:
                log.warning("drain: the scheduler gave up after %.2fs; some models did not move", took)
            return done

    async def stop(self) -> None:
        self._stopping = True
        tasks = [t for t in (self._loop, self._stats, *self._tasks) if t is not None]
        self._loop = self._stats = None
        for task in tasks:
            task.cancel()
        # Close the channel before waiting: it ends the calls on it. A task cancelled while grpc.aio
        # is starting a call can otherwise wait for ever (seen when an agent stops right after it
        # started), and the subscribe loop must not open a new channel meanwhile (`_stopping`).
        await self._client.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.stop()  # requests in flight finish (bounded)
        await self.residency.close()
        if self._data_plane is not None:
            await self._data_plane.close()
        await self._server.close()
        if self.tracer is not None:  # the spans still batched go out (blocking: off the loop)
            await asyncio.to_thread(self.tracer.shutdown)

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class _Failures:
    """The subscribe loop's failures, logged when they change: a warning for the first and for each
    that differs from the one before (while the scheduler is down, the same one repeats every
    attempt), debug for repeats; once subscribed again, one line says after how long."""

    def __init__(self, scheduler: str) -> None:
        self._scheduler = scheduler
        self._last: str | None = None
        self._since: float | None = None
        self._count = 0

    def failed(self, message: str, now: float) -> None:
        if self._since is None:
            self._since = now
        self._count += 1
        if message != self._last:
            log.warning("subscription to %s: %s", self._scheduler, message)
            self._last = message
        else:
            log.debug("subscription to %s: %s (again)", self._scheduler, message)

    def over(self, opened: float) -> None:
        """The stream opened at `opened` was accepted: the streak of failures, if any, is over."""
        if self._since is not None:
            log.info(
                "subscribed to %s again after %d failed attempt(s) in %.1fs",
                self._scheduler,
                self._count,
                opened - self._since,
            )
        self._last, self._since, self._count = None, None, 0


async def _ending(work: Coroutine[Any, Any, None], span: Span) -> None:
    """Run an operation, its span ended with it (failed if it raised)."""
    try:
        await work
    except Exception as error:
        span.fail(str(error), type(error).__name__)
        raise
    finally:
        span.end()


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


async def start_agent(config: AgentConfig, *, rng: random.Random | None = None) -> Agent:
    """A started agent (the server was live, the subscribe loop runs); `await agent.stop()`."""
    agent = Agent(config, rng=rng)
    try:
        await agent.start()
    except BaseException:
        await agent.stop()
        raise
    return agent
