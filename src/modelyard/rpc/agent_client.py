"""`AgentClient`: the agent's side of `modelyard.agent.v1.AgentService`.

grpc stays in this module: callers pass and receive `agent_pb2` messages and see modelyard's
error tree. Every grpc failure is translated by `_translate`, the one place that knows status
codes: a scheduler that cannot be reached (or went away mid-stream) is `SchedulerUnavailable`,
so the agent's reconnect loop needs to catch only that and the rest of the tree.

Security (the scheduler's side: `agent_server.py`): with `tls` the channel is TLS, the scheduler
verified against `tls.ca_file` (default: the system's CAs) by the target's host or
`tls.server_name`, and the agent's client certificate (`cert_file`/`key_file`) shown for mutual
TLS; the files are checked at construction (a `TlsError` naming the file) and looked at again
before each subscribe (`ClientTls.reload`): when they changed, a new channel is made with them, so
a rotated certificate is used from the next reconnect on. A join token (`token`, or
`token_file`: its first line, read again when the file changes) goes with every call as the
metadata `authorization: Bearer <token>`; it is never logged nor put in an error.

Keepalive: the channel pings the scheduler every `keepalive` seconds (10 s), with or without a call
open, and gives up on a connection whose ping is not answered within as long again: a scheduler
whose host vanished without closing the connection (a node failure, a partition, a conntrack entry
to a dead pod's address) is noticed within about 20 s, the subscription breaks
(`SchedulerUnavailable`) and the agent subscribes again on a new connection, well inside a new
scheduler's 60 s resync. Without it, the agent waited on the dead stream for ever while the new
scheduler dropped its replica. The scheduler's agent port permits a ping every 5 s
(`rpc/agent_server.py`); gRPC's default (one in 5 minutes) would answer these with GOAWAY.

Reconnecting: gRPC's own reconnect backoff (1 s growing to 120 s by default) would leave an agent
waiting for up to two minutes after its scheduler came back; here it starts at 0.1 s and is capped
at `reconnect_backoff_max` (2 s; gRPC adds 20 % jitter), so a channel waiting to be ready connects
within about that long of the scheduler's return.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable

import grpc
from grpc import aio

from modelyard.config import TlsClientConfig
from modelyard.errors import (
    BadRequest,
    Conflict,
    ModelyardError,
    NotFound,
    SchedulerUnavailable,
)
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from modelyard.rpc.oip_client import system_cas, tls_failure
from modelyard.security.tls import ClientTls
from modelyard.security.tokens import TokenFileError, read_token

log = logging.getLogger("modelyard.rpc")

# Codes that mean "the scheduler is not there (now)": the caller backs off and tries again.
_UNAVAILABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,  # a servicer that raised: the scheduler's fault, maybe transient
        grpc.StatusCode.INTERNAL,
    }
)
# A method the scheduler does not have: asked of a channel that did not get ready, gRPC answers at
# once with why it could not connect (its last error), and a scheduler that answers says
# UNIMPLEMENTED and does nothing.
_PROBE = "/modelyard.agent.v1.AgentService/Reachable"
Stat = tuple[int, int, int, int] | None
KEEPALIVE = 10.0  # seconds between pings, and the longest wait for an answer (see the module)


def _translate(error: aio.AioRpcError, what: str) -> ModelyardError:
    """The one mapping from grpc status codes to modelyard's error tree."""
    code = error.code()
    detail = f"{what}: {code.name}: {error.details() or 'no details'}"
    if code in _UNAVAILABLE:
        return SchedulerUnavailable(detail)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return Conflict(detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(detail)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return BadRequest(detail)
    return ModelyardError(detail)


class _Token:
    """A join token: given, or the first line of a file, read again when the file changes (a
    rotated Secret). A file that cannot be read at start is a TokenFileError naming it; later, the
    token read before stays and the problem is logged once per change of the file."""

    def __init__(self, token: str | None, path: str | None) -> None:
        self._path = path
        self._seen: Stat = _stat(path) if path else None
        self._failed: Stat = None
        self._token = read_token(path) if path else token

    def __call__(self) -> str | None:
        if self._path:
            seen = _stat(self._path)
            if seen != self._seen and seen is not None:
                try:
                    self._token = read_token(self._path)
                except TokenFileError as exc:  # names the file and the line, never the token
                    if seen != self._failed:
                        log.error("%s; still sending the token read before", exc)
                        self._failed = seen
                else:
                    self._seen = seen
                    log.info("join token read again from %s", self._path)
        return self._token


def _stat(path: str) -> Stat:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class AgentClient:
    """One channel to the scheduler's agent port (`host:port`), plain text or, with `tls`, TLS.

    The channel is created on first use, inside the running event loop (grpc.aio requires it),
    and reconnects by itself (backoff 0.1 s growing to `reconnect_backoff_max`); `close()` ends it
    and any stream on it. It has a connection of its own (not shared with other channels of the
    process to the same scheduler, as gRPC would by default): the scheduler tells agents apart by
    their connections. `keepalive` (seconds; None = off) sends HTTP/2 pings so a vanished scheduler
    host is noticed (see the module); a server other than modelyard's scheduler may refuse pings
    this frequent (gRPC's default allows one in 5 minutes). `token` (or `token_file`) is the join
    token sent with every call; see the module for both.
    """

    def __init__(
        self,
        target: str,
        *,
        connect_timeout: float = 5.0,
        keepalive: float | None = KEEPALIVE,
        tls: TlsClientConfig | None = None,
        token: str | None = None,
        token_file: str | None = None,
        reconnect_backoff_max: float = 2.0,
    ) -> None:
        self.target = target
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._backoff_max = reconnect_backoff_max
        self._tls = ClientTls(tls) if tls is not None else None  # the files checked now
        self._token = _Token(token, token_file) if token is not None or token_file else None
        self._channel: aio.Channel | None = None
        self._stub: agent_pb2_grpc.AgentServiceAsyncStub | None = None
        self._made_with: object = None  # the ClientTls context the channel was made with

    @property
    def secure(self) -> bool:
        return self._tls is not None

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token() if self._token is not None else None
        return (("authorization", f"Bearer {token}"),) if token else None

    def _options(self) -> list[tuple[str, int | str]]:
        backoff_ms = max(100, int(self._backoff_max * 1000))
        options: list[tuple[str, int | str]] = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            # The bound on one connection attempt (TCP and TLS handshakes); gRPC's default is 20 s.
            ("grpc.min_reconnect_backoff_ms", max(backoff_ms, int(self._connect_timeout * 1000))),
        ]
        if self._keepalive:
            ms = int(self._keepalive * 1000)
            options += [
                ("grpc.keepalive_time_ms", ms),
                ("grpc.keepalive_timeout_ms", ms),
                ("grpc.http2.ping_timeout_ms", ms),  # else gRPC waits 60 s for the answer, whatever the above
                # A subscription sends nothing after its request, and an idle channel still holds the
                # connection its next call will use: ping both (gRPC stops after 2 pings without data).
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        return options

    def _connect(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        if self._stub is None:
            options = self._options()
            if self._tls is None:
                self._channel = aio.insecure_channel(self.target, options=options)
            else:
                self._made_with = self._tls.context()  # first: the files as they are now
                ca, key, chain = self._tls.material()
                credentials = grpc.ssl_channel_credentials(ca if ca is not None else system_cas(), key, chain)
                if self._tls.server_name:
                    options.append(("grpc.ssl_target_name_override", self._tls.server_name))
                self._channel = aio.secure_channel(self.target, credentials, options=options)
            self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        assert self._stub is not None
        return self._stub

    async def _renew(self) -> None:
        """Before a subscribe (a reconnect): a channel made with TLS files that changed since is
        closed, so the next one is made with the new certificate."""
        if self._tls is None or self._channel is None:
            return
        self._tls.reload()  # the files as they are now, not as they were at most 10 s ago
        if self._tls.context() is self._made_with:
            return
        log.info("the TLS files for the scheduler %s changed: reconnecting with them", self.target)
        channel, self._channel, self._stub = self._channel, None, None
        await channel.close(grace=1.0)  # an event or report on it is retried by its sender

    async def _ready(self, what: str) -> agent_pb2_grpc.AgentServiceAsyncStub:
        """The stub once the channel is connected; SchedulerUnavailable after connect_timeout,
        saying why it could not connect (refused, a TLS handshake that failed) where gRPC knows."""
        stub = self._connect()
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self._connect_timeout)
        except TimeoutError:
            why = await self._why_unreachable()
            raise SchedulerUnavailable(
                f"{what}: scheduler {self.target} not reachable within {self._connect_timeout:g}s"
                + (f": {why}" if why else "")
            ) from None
        return stub

    async def _why_unreachable(self) -> str:
        """Why the channel is not connected, as gRPC's last error says it ("" if it does not)."""
        if self._channel is None:
            return ""
        probe: aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(_PROBE)
        try:
            await probe(b"", timeout=1.0, wait_for_ready=False)
        except aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                return ""
            details = error.details() or ""
            failure = tls_failure(details)
            if failure:
                return f"TLS handshake failed: {failure}"
            last = details.rsplit("last error: ", 1)[-1][:300]
            if self._tls is not None and not self._tls.config.cert_file and "Connection refused" not in last:
                # TLS 1.3: a server that wants a client certificate closes after the handshake.
                last += " (a scheduler with --agent-ca wants a client certificate: --cert, --key)"
            return last
        except asyncio.CancelledError:
            raise
        return ""

    async def subscribe(
        self, request: agent_pb2.SubscribeRequest, on_open: Callable[[], None] | None = None
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        """Operations for this replica until the scheduler ends the stream (a normal return) or it
        breaks (`SchedulerUnavailable`). `on_open` is called once the channel is connected and the
        request sent. Closing the iterator cancels the call."""
        await self._renew()
        stub = await self._ready("subscribe")
        call = stub.Subscribe(request, metadata=self._metadata())
        if on_open is not None:
            on_open()
        try:
            async for operation in call:
                yield operation
        except aio.AioRpcError as error:
            raise _translate(error, f"subscribe to {self.target}") from None
        finally:
            call.cancel()  # no-op once the call has ended

    async def event(self, event: agent_pb2.ModelEvent, *, deadline: float = 10.0) -> None:
        stub = await self._ready("event")
        try:
            await stub.AgentEvent(event, timeout=deadline, metadata=self._metadata())
        except aio.AioRpcError as error:
            raise _translate(error, f"event to {self.target}") from None

    async def drain(self, request: agent_pb2.AgentDrainRequest, *, deadline: float | None = None) -> bool:
        """Blocks until the scheduler has moved this replica's models (or gave up); its answer."""
        stub = await self._ready("drain")
        try:
            response = await stub.AgentDrain(request, timeout=deadline, metadata=self._metadata())
        except aio.AioRpcError as error:
            raise _translate(error, f"drain via {self.target}") from None
        return response.success

    async def stats(self, request: agent_pb2.AgentStatsRequest, *, deadline: float = 5.0) -> None:
        stub = await self._ready("stats")
        try:
            await stub.AgentStats(request, timeout=deadline, metadata=self._metadata())
        except aio.AioRpcError as error:
            raise _translate(error, f"stats to {self.target}") from None

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)
