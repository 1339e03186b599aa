"""`start_scheduler(config)`: the scheduler service, in-process (tests) or under the CLI.

It restores the state from the store, serves the REST API and feed (restored endpoints at once),
the agents' gRPC service, a retry timer and, after a restart, the resync deadline: placing waits
until every replica it knew has re-subscribed, or `resync_timeout` (60 s) has passed.

Before anything listens, the configuration is checked for exposure (access.py): a scheduler on an
address other than loopback without TLS and credentials refuses to start unless `insecure`; token
files and certificate files are read (a ConfigError naming the file).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from modelyard.config import ListenConfig
from modelyard.errors import StoreWriteFailed
from modelyard.placement.scaling import ScalingPolicy
from modelyard.rpc import AgentServer
from modelyard.scheduler.access import agent_credentials, check_exposure, rest_access
from modelyard.scheduler.agents import Agents
from modelyard.scheduler.api import create_app
from modelyard.scheduler.autoscaler import Autoscaler
from modelyard.scheduler.changes import Changes
from modelyard.scheduler.config import SchedulerConfig
from modelyard.scheduler.feed import FeedHub, FeedLine
from modelyard.scheduler.metrics import SchedulerMetrics
from modelyard.scheduler.state import SchedulerState
from modelyard.serving import HttpServer
from modelyard.store import Store
from modelyard.telemetry import build_tracer

log = logging.getLogger("modelyard.scheduler")


class SchedulerService:
    """The parts of a running scheduler; `start_scheduler` builds and starts one."""

    def __init__(self, config: SchedulerConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.changes = Changes()
        self.feed = FeedHub(config.feed_queue_size)
        self.store = Store(config.db)
        self.tracer = build_tracer(config.telemetry, "modelyard-scheduler")
        self.agents = Agents(
            self.changes,
            clock,
            queue_size=config.agent_queue_size,
            drain_timeout=config.drain_timeout,
            tracer=self.tracer,
            max_replica_memory=config.max_replica_memory,
        )
        try:  # a database it cannot read is a ConfigError naming it (one line from the CLI)
            self.state = SchedulerState.restore(
                self.store, self.agents.send, self._publish, retry_interval=config.retry_interval
            )
        except BaseException:
            self.store.close()
            raise
        self.agents.state = self.state
        self.metrics = SchedulerMetrics(self.state)
        policy = ScalingPolicy(
            lag_threshold=config.scale_up_lag,
            scale_up_window=config.scale_up_window,
            inactivity=config.scale_down_inactivity,
            scale_down_cooldown=config.scale_down_cooldown,
        )
        self.autoscaler = Autoscaler(
            self.state, policy, stats_max_age=config.stats_max_age, on_scaled=self.metrics.scaled
        )
        self.agents.autoscaler = self.autoscaler
        self.agents.metrics = self.metrics
        self._tasks: list[asyncio.Task[None]] = []

    def _publish(self, line: FeedLine) -> None:
        self.feed.publish(line)

    def start_timers(self) -> None:
        self._tasks.append(asyncio.create_task(self._retry_loop(), name="scheduler-retry"))
        if not self.state.ready:
            self._tasks.append(asyncio.create_task(self._resync_deadline(), name="scheduler-resync"))
        if self.config.autoscaling:
            self._tasks.append(asyncio.create_task(self._scaling_loop(), name="scheduler-scaling"))

    async def _scaling_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scaling_interval)
            if not self.state.ready:
                continue  # after a restart, nothing moves until the known replicas are back
            try:
                if self.autoscaler.tick(self.clock()):
                    self.changes.pulse()
            except Exception:  # nothing must end autoscaling for good
                log.exception("autoscaling")

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.retry_interval)
            try:
                self.state.retry(self.clock())  # also writes what a failed write left unwritten
            except StoreWriteFailed as error:
                log.error("retrying failed models: %s (kept in memory; written on the next try)", error)
            except Exception:  # nothing must end the retries for good
                log.exception("retrying failed models")
            self.changes.pulse()

    async def _resync_deadline(self) -> None:
        ready = await self.changes.wait_for(lambda: self.state.ready, self.config.resync_timeout)
        if not ready:
            missing = ", ".join(f"{s}-{i}" for s, i in sorted(self.state.awaiting))
            log.warning("resync timeout: removing server replicas that did not come back: %s", missing)
            self.state.finish_resync(self.clock())
            self.changes.pulse()

    async def stop_timers(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()


class RunningScheduler:
    """A started scheduler: `url` and `port` of the REST API, `agent_port` of AgentService."""

    def __init__(self, service: SchedulerService, http: HttpServer, agents: AgentServer) -> None:
        self.service = service
        self.http = http
        self.agent_server = agents
        self.url = http.url
        self.port = http.port
        self.agent_port = agents.port
        self.agent_address = agents.address

    @property
    def state(self) -> SchedulerState:
        return self.service.state

    async def stop(self) -> None:
        """Stop the timers, end the feeds and agent streams, close the listeners and the store. A feed
        reader connecting after the feeds ended is ended at once (FeedHub.close)."""
        await self.service.stop_timers()
        self.service.feed.close()
        self.service.agents.close_all()
        await self.agent_server.stop(grace=1.0)
        await self.http.stop()
        self.service.store.close()
        if self.service.tracer is not None:  # the spans still batched go out (blocking: off the loop)
            await asyncio.to_thread(self.service.tracer.shutdown)


async def start_scheduler(
    config: SchedulerConfig, *, clock: Callable[[], float] = time.time
) -> RunningScheduler:
    check_exposure(config)
    access, credentials = rest_access(config), agent_credentials(config)  # token files read now
    rest_tls = agent_tls = config.tls
    if config.tls is not None:
        if config.tls.client_ca_file and config.tokens_file:
            # A token is a credential too: a client without a certificate must still be able to send one.
            rest_tls = config.tls.model_copy(update={"client_cert": "optional"})
        # The agent port trusts the agent CA, not the REST clients' one.
        update = {"client_ca_file": config.agent_ca_file, "client_cert": "required"}
        agent_tls = config.tls.model_copy(update=update)
    listen = ListenConfig(
        host=config.host, port=config.port, drain_seconds=0.0, shutdown_timeout=5.0, tls=rest_tls
    )
    service = SchedulerService(config, clock=clock)
    try:  # certificate files are checked as the listeners are made (TlsError naming the file)
        http = HttpServer(create_app(service, access), listen)
        agents = AgentServer(
            service.agents,
            config.host,
            config.agent_port,
            tls=agent_tls,
            credentials=credentials,
            keepalive=config.agent_keepalive,
            recheck=config.credential_recheck,
        )
    except BaseException:
        service.store.close()
        raise
    try:
        await http.start()
        await agents.start()
    except BaseException:
        await http.stop()
        service.store.close()
        raise
    service.start_timers()
    return RunningScheduler(service, http, agents)
