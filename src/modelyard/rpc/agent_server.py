"""`AgentServer`: hosts `modelyard.agent.v1.AgentService` on a grpc.aio server and hands each call to
an `AgentHandler`, a plain Protocol that never sees grpc.

The handler raises modelyard's errors; they become gRPC status codes here, in one place:
NotFound -> NOT_FOUND, BadRequest -> INVALID_ARGUMENT, ReplicaTaken -> ALREADY_EXISTS, Conflict ->
FAILED_PRECONDITION (Seldon answers a state mismatch with INTERNAL, which an agent cannot tell from a
scheduler bug; the agent only logs either), anything else -> INTERNAL.

Who may call (`AgentCredentials`; none: anyone who reaches the port, for loopback). Each call is
admitted here, before the handler sees it: the agent's identities are those of its client
certificate (verified against the agent CA during the handshake: every URI SAN
`spiffe://modelyard/server/<server>[/replica/<n>]`) and of its join token (metadata
`authorization: Bearer <token>`, a line `SERVER TOKEN` of the agent tokens file: any replica of that
server). No identity: UNAUTHENTICATED. A Subscribe, event, drain or stats report for a server and
replica none of its identities names: PERMISSION_DENIED. Each refusal is logged once per peer
address and claim (a bounded memory), never with the token.

An event, drain or stats report acts on a replica that is running: it is taken only over the
connection whose Subscribe holds the replica's slot (the agent sends them on its subscription's
channel; `AgentHandler.holder`), or from a certificate naming that very replica
(`.../server/<server>/replica/<n>`). A credential every replica of a server shares (a join token, a
server-wide certificate) would otherwise let one pod unload, drain or scale its siblings. Held over
another connection: PERMISSION_DENIED (logged once per peer); held by none: NOT_FOUND, as the state
answers for a replica that is not subscribed (an agent retries a drain on it while it re-subscribes).
This holds without credentials too (loopback): one connection, one replica.

A subscription admitted by a join token lasts only as long as the token: every `recheck` seconds
(10) the caller's credentials are looked at again (the tokens file is read again when it changed),
and a stream none of them allows any more ends with UNAUTHENTICATED (logged), its replica
disconnected. A certificate's identity is its connection's: it does not change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from grpc import aio

from modelyard.config import TlsServerConfig
from modelyard.errors import BadRequest, Conflict, ModelyardError, NotFound
from modelyard.rpc._server import grpc_address, start_server, watch_tls
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from modelyard.security.tls import ServerTls
from modelyard.security.tokens import AgentIdentity, TokenFile, bearer_token

log = logging.getLogger("modelyard.rpc")


class ReplicaTaken(Conflict):
    """A Subscribe for a replica whose agent is connected, over another connection (ALREADY_EXISTS)."""

    code = "replica_taken"


class AgentHandler(Protocol):
    """What the scheduler does with each AgentService call."""

    def subscribe(
        self, request: agent_pb2.SubscribeRequest, peer: str = ""
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        """The operations for this replica, until the iterator ends (the scheduler replaced or
        stopped the stream) or is closed (the agent went away). `peer` names the connection the
        call came over (gRPC's peer address)."""
        ...

    async def event(self, event: agent_pb2.ModelEvent) -> None: ...

    async def drain(self, request: agent_pb2.AgentDrainRequest) -> bool: ...

    async def stats(self, request: agent_pb2.AgentStatsRequest) -> None: ...

    def holder(self, server: str, replica: int) -> str | None:
        """The peer (gRPC's peer address, as `subscribe` was given it) of the connection whose
        Subscribe holds this replica's slot; None when none does."""
        ...


def status_code(error: ModelyardError) -> grpc.StatusCode:
    """The gRPC status for a modelyard error raised by the handler."""
    if isinstance(error, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, ReplicaTaken):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, Conflict):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class AgentCredentials:
    """What the agent port accepts: `certificates` (the port requires client certificates signed by
    the agent CA; identities from their URI SANs) and `tokens` (join tokens, keyed by server)."""

    certificates: bool = False
    tokens: TokenFile | None = None


Context = aio.ServicerContext[Any, Any]
_REFUSALS_REMEMBERED = 1024  # (peer, claim) pairs whose refusal was logged
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has for its TLS and HTTP/2 handshakes
RECHECK = 10.0  # seconds between looks at an open subscription's join token
_END = object()  # the handler's operations ended


class _Admission:
    """Admits each call: the caller's identities against the server and replica it acts for."""

    def __init__(self, credentials: AgentCredentials | None) -> None:
        self._credentials = credentials
        self._logged: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    async def admit(self, context: Context, server: str, replica: int, what: str) -> list[AgentIdentity]:
        """The caller's identities once it may act as `server`-`replica` (none: the port takes
        anyone); abort the call otherwise."""
        credentials = self._credentials
        if credentials is None:
            return []
        identities, problem = self._identities(credentials, context)
        if not identities:
            self._log_once(context, what, "", f"no credential: {problem}")
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, f"{what}: no credential: {problem}")
        if not any(identity.allows(server, replica) for identity in identities):
            names = ", ".join(str(i) for i in identities)
            line = f"{what} for server replica {server}-{replica}: the credential names {names} only"
            self._log_once(context, what, f"{server}-{replica}", line)
            await self._abort(context, grpc.StatusCode.PERMISSION_DENIED, line)
        return identities

    async def holds(
        self,
        context: Context,
        server: str,
        replica: int,
        what: str,
        identities: list[AgentIdentity],
        holder: str | None,
    ) -> None:
        """Return when the caller speaks for the running replica: over the connection that holds
        its slot (`holder`), or with a certificate naming that very replica; abort otherwise."""
        if any(i.server == server and i.replica == replica for i in identities):
            return  # only a certificate names one replica: that replica's own
        if holder is None:
            await self._abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"{what}: server replica {server}-{replica} is not subscribed (its calls come over its "
                "agent's subscription's connection)",
            )
        if holder != (context.peer() or ""):
            line = (
                f"{what} for server replica {server}-{replica}: its slot is held by another connection; "
                "only that connection (the agent's subscription) or a certificate naming this replica "
                "may act for it"
            )
            self._log_once(context, what, f"{server}-{replica}", line)
            await self._abort(context, grpc.StatusCode.PERMISSION_DENIED, line)

    @property
    def watches_tokens(self) -> bool:
        """Whether a join token may admit a call (and may be taken away while it is open)."""
        return self._credentials is not None and self._credentials.tokens is not None

    def revoked(self, context: Context, server: str, replica: int) -> bool:
        """Whether the caller's credentials, looked at again now, no longer allow `server`-`replica`."""
        if self._credentials is None:
            return False
        identities, _ = self._identities(self._credentials, context)
        return not any(identity.allows(server, replica) for identity in identities)

    @staticmethod
    def _identities(credentials: AgentCredentials, context: Context) -> tuple[list[AgentIdentity], str]:
        """The caller's identities, and why there are none."""
        identities: list[AgentIdentity] = []
        reasons: list[str] = []
        if credentials.certificates:
            for uri in context.auth_context().get("peer_uri", []):  # only a verified certificate's
                identity = AgentIdentity.from_uri(uri.decode("utf-8", "replace"))
                if identity is not None:
                    identities.append(identity)
            if not identities:
                reasons.append("the client certificate names no spiffe://modelyard/server/<server> URI")
        if credentials.tokens is not None:
            token = None
            for key, value in context.invocation_metadata() or ():
                if key == "authorization" and isinstance(value, str):
                    token = bearer_token(value)
            server = credentials.tokens.lookup(token) if token is not None else None
            if server is not None:
                identities.append(AgentIdentity(server))
            elif token is None:
                reasons.append("no join token (metadata authorization: Bearer <token>)")
            else:
                reasons.append("the join token is not one the scheduler knows")
        return identities, "; ".join(reasons)

    def _log_once(self, context: Context, what: str, claim: str, line: str) -> None:
        host = _peer_host(context.peer() or "")
        key = (host, what, claim)
        if key in self._logged:
            self._logged.move_to_end(key)
            return
        self._logged[key] = None
        if len(self._logged) > _REFUSALS_REMEMBERED:
            self._logged.popitem(last=False)
        log.warning("agent port: refused %s from %s: %s", what, host or "a peer", line)

    @staticmethod
    async def _abort(context: Context, code: grpc.StatusCode, details: str) -> NoReturn:
        await context.abort(code, details)
        raise AssertionError("unreachable: abort raises")


async def _next(operations: AsyncIterator[agent_pb2.ModelOperation]) -> object:
    return await anext(operations, _END)


def _peer_host(peer: str) -> str:
    """gRPC's `ipv4:10.0.0.7:40312` (or `ipv6:[::1]:5000`) without its port."""
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host, _, port = address.rpartition(":")
    return host if host and port.isdigit() else address


class _Servicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, handler: AgentHandler, admission: _Admission, recheck: float = RECHECK) -> None:
        self._handler = handler
        self._admission = admission
        self._recheck = recheck

    async def _own(self, context: Context, server: str, replica: int, what: str) -> None:
        """Admit a call that acts on a running replica: its credential, then its connection."""
        identities = await self._admission.admit(context, server, replica, what)
        holder = self._handler.holder(server, replica)
        await self._admission.holds(context, server, replica, what, identities, holder)

    async def Subscribe(
        self, request: agent_pb2.SubscribeRequest, context: aio.ServicerContext[object, object]
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        server, replica = request.server_name, request.replica_idx
        await self._admission.admit(context, server, replica, "Subscribe")
        operations = self._handler.subscribe(request, context.peer() or "")
        pending: asyncio.Task[object] | None = None  # the handler's next operation, awaited
        try:
            if not self._admission.watches_tokens:
                async for operation in operations:
                    yield operation
            else:  # each operation awaited beside the token's recheck, on one clock for the call
                loop = asyncio.get_running_loop()
                due = [loop.time() + self._recheck]  # the next recheck, whatever arrives meanwhile
                while True:
                    pending = asyncio.ensure_future(_next(operations))
                    await self._while_admitted(pending, context, server, replica, due)
                    item, pending = pending.result(), None
                    if not isinstance(item, agent_pb2.ModelOperation):
                        break  # _END
                    yield item
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        finally:
            if pending is not None:  # the handler's disconnect processing runs as it is cancelled
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            # Run the handler's disconnect processing now, not whenever the generator is collected.
            aclose = getattr(operations, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _while_admitted(
        self, pending: asyncio.Task[object], context: Context, server: str, replica: int, due: list[float]
    ) -> None:
        """Wait for `pending`; at each recheck (`due[0]`, moved on by `recheck` seconds each time)
        until it is done, end the call (UNAUTHENTICATED) if the caller's credentials no longer allow
        it: its join token was removed. The deadline is the call's, not this wait's: operations
        arriving more often than `recheck` must not put the check off for ever."""
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() >= due[0]:
                due[0] = loop.time() + self._recheck
                if self._admission.revoked(context, server, replica):
                    line = (
                        f"Subscribe for server replica {server}-{replica}: its join token is no longer "
                        "one the scheduler knows (removed from the agent tokens file)"
                    )
                    peer = _peer_host(context.peer() or "")
                    log.warning("agent port: ended a subscription from %s: %s", peer, line)
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, line)
            if (await asyncio.wait({pending}, timeout=due[0] - loop.time()))[0]:
                return

    async def AgentEvent(
        self, request: agent_pb2.ModelEvent, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.ModelEventResponse:
        await self._own(context, request.server_name, request.replica_idx, "AgentEvent")
        try:
            await self._handler.event(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.ModelEventResponse()

    async def AgentDrain(
        self, request: agent_pb2.AgentDrainRequest, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.AgentDrainResponse:
        await self._own(context, request.server_name, request.replica_idx, "AgentDrain")
        try:
            success = await self._handler.drain(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.AgentDrainResponse(success=success)

    async def AgentStats(
        self, request: agent_pb2.AgentStatsRequest, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.AgentStatsResponse:
        await self._own(context, request.server_name, request.replica_idx, "AgentStats")
        try:
            await self._handler.stats(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.AgentStatsResponse()


class AgentServer:
    """AgentService on `host:port` (port 0: any free port; `port` holds the bound one after start).

    With `tls`, over TLS from its files (checked now: a TlsError naming the file; reloaded when
    they change); its `client_ca_file`, if any, is the agent CA and every agent must show a
    certificate it signed. `credentials` say who may call (see the module). `keepalive` (seconds)
    pings each connection that has a call open: one that does not answer within as long again is
    closed, so the stream of an agent that vanished ends and its replica's slot is free. A connection
    that has not finished its handshake within `handshake_timeout` seconds (10) is closed. An open
    subscription's join token is looked at again every `recheck` seconds (see the module)."""

    def __init__(
        self,
        handler: AgentHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: TlsServerConfig | None = None,
        credentials: AgentCredentials | None = None,
        keepalive: float | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        recheck: float = RECHECK,
    ) -> None:
        self.host = host
        self.port = port
        self._handler = handler
        self._server: aio.Server | None = None
        self.tls = ServerTls(tls, alpn=()) if tls is not None else None
        self._tls_watch: asyncio.Task[None] | None = None
        self._admission = _Admission(credentials)
        self._keepalive = keepalive
        self._handshake_timeout = handshake_timeout
        self._recheck = recheck

    @property
    def address(self) -> str:
        return grpc_address(self.host, self.port)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("AgentServer already started")
        servicer = _Servicer(self._handler, self._admission, self._recheck)
        options: list[tuple[str, Any]] = [
            # Agents may ping their stream as often as every 5 s (grpc's default refuses more than
            # one ping in 5 minutes with GOAWAY).
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            # A connection that has not finished its (TLS and HTTP/2) handshake by then is closed:
            # gRPC's default, 120 s, let anyone who reaches the port hold thousands of silent ones.
            ("grpc.server_handshake_timeout_ms", int(self._handshake_timeout * 1000)),
        ]
        if self._keepalive:
            ms = int(self._keepalive * 1000)
            options += [
                ("grpc.keepalive_time_ms", ms),
                ("grpc.keepalive_timeout_ms", ms),
                ("grpc.http2.ping_timeout_ms", ms),
                ("grpc.http2.max_pings_without_data", 0),  # an idle stream is pinged all the same
            ]
        self._server, self.port = await start_server(
            self.host,
            self.port,
            lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server),
            what="agents",
            options=options,
            tls=self.tls,
        )
        self._tls_watch = watch_tls(self.tls)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting calls; calls in flight get `grace` seconds, then are cancelled. Safe twice."""
        server, self._server = self._server, None
        if self._tls_watch is not None:
            self._tls_watch.cancel()
            self._tls_watch = None
        if server is not None:
            await server.stop(grace)
