"""`OipChannels`: OIP v2 calls to backends over gRPC, the messages passed as bytes.

The gateway relays a gRPC client's call to a backend that speaks gRPC as it came: the request
message's bytes go out and the answer's bytes come back, with no conversion to JSON and back. A
call's outcome is given as the REST call's would be, so the attempt loop treats both alike:
- an answer is `(200, message bytes)`;
- an error status the server sent is `(the HTTP status it stands for, OIP's error JSON)`, by the
  usual gRPC-to-HTTP table, the JSON naming the gRPC status too (`grpc_status`) so that the
  client gets the very status the server sent;
- a backend that could not be reached raises `UpstreamUnreachable` (retried as connect-failure),
  a call the backend dropped `UpstreamClosed` (reset), one that ran past `time_limit`
  `UpstreamTimeout`. These are told apart by gRPC's own texts for them (the client library gives
  no other sign), matched from their start; a server's own message is never searched.

One channel per backend address, made on first use; gRPC multiplexes the calls over its HTTP/2
connection. The channel's reconnect backoff is capped at a second: a backend that restarts is
called again as soon as it listens, not after gRPC's default of up to two minutes.

A `grpcs://` address is called over TLS: verified against the CA of its settings (a URL that
carries its own, as the gateway's `TlsUrl` does, else the default: `upstream.tls`, else the
system's CAs), `server_name` sent as SNI and verified, a client certificate presented when set.
When the files change, the next call opens a new channel with them and the old one is closed once
its calls end. A handshake that fails is logged once per address until a call succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import urlsplit

import grpc
import orjson
from grpc import aio

from modelyard.config import TlsClientConfig
from modelyard.errors import (
    BadRequest,
    ModelServerAnswered,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from modelyard.security.tls import ClientTls

log = logging.getLogger("modelyard.upstream")

# The HTTP status a REST server would have answered with (the inverse of oip_server's table).
_STATUSES = {
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# gRPC core's texts (grpcio 1.85) for a call that never reached a server, and for one the
# connection or the server's shutdown dropped before its answer.
_UNREACHABLE = ("failed to connect to all addresses", "DNS resolution failed")
_DROPPED = ("Socket closed", "Connection reset", "Broken pipe", "Cancelling all calls", "Stream removed")
_LOCAL_DEADLINE = "Deadline Exceeded"
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),  # the attempt loop retries, by the route's policy
]
# A channel made with files that changed since is closed once its calls end, at most this long after.
_RETIRE_GRACE = 600.0
# gRPC core's words for a failed TLS handshake, in its UNAVAILABLE details.
_TLS_FAILURE = re.compile(r"(?i)handshake|ssl|certificate|verification|tsi_")
# The start of the last error in gRPC's details: its status and the address ("UNKNOWN: ipv4:h:p: ").
_LAST_ERROR = re.compile(r"^[A-Z_]+: (?:(?:ipv4|ipv6|unix|dns):\S+: )?")
_VERIFY_FAILED = re.compile(r"CERTIFICATE_VERIFY_FAILED: (.*?)(?:: OK)?$")
# What gRPC takes as metadata (keys lower-case); an HTTP header may hold more (a tab, upper case).
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+\Z")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*\Z")


def grpc_target(url: str) -> str:
    """`host:port` of a `grpc://host:port` (or `grpcs://`) URL (a checked config value)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}"


def system_cas() -> bytes | None:
    """The system's CA bundle as PEM (what OpenSSL verifies with by default), for a gRPC channel:
    gRPC otherwise trusts its own bundled roots. None when there is no such file."""
    path = ssl.get_default_verify_paths().cafile
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None


def tls_failure(details: str) -> str:
    """The reason in gRPC's details of a failed TLS handshake ("" when they are not about TLS):
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake
    failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:
    CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK" gives "certificate
    verify failed: unable to get local issuer certificate"."""
    if not details.startswith(_UNREACHABLE):
        return ""
    last = _LAST_ERROR.sub("", details.rsplit("last error: ", 1)[-1])
    if not _TLS_FAILURE.search(last):
        return ""
    verify = _VERIFY_FAILED.search(last)
    if verify is not None:
        return f"certificate verify failed: {verify.group(1)}"
    return last.removesuffix(": OK")[:300]


class OipPending:
    """One call on its way: `answer()` waits for its outcome; `abort(error)` gives it up (its
    endpoint was taken out), and `answer()` then raises `error`. `watch`: the channels that log a
    TLS call's failed handshake (None for a plain call)."""

    __slots__ = ("_aborted", "_call", "_url", "_watch")

    def __init__(
        self, url: str, call: aio.UnaryUnaryCall[bytes, bytes], watch: OipChannels | None = None
    ) -> None:
        self._url = url
        self._call = call
        self._aborted: UpstreamError | None = None
        self._watch = watch

    def abort(self, error: UpstreamError) -> None:
        if not self._call.done():
            self._aborted = error
            self._call.cancel()

    async def answer(self) -> tuple[int, bytes]:
        try:
            data: bytes = await self._call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._aborted is not None and not (task is not None and task.cancelling()):
                raise self._aborted from None
            raise  # the caller itself was cancelled (its client left, its time is up)
        except aio.AioRpcError as error:
            if self._aborted is not None:
                raise self._aborted from None
            if self._watch is not None:
                self._watch.tls_outcome(self._url, error.details() or "")
            return _answer_for(self._url, error)
        except Exception as error:  # what grpc raises for a call it could not start
            raise UpstreamError(f"cannot call {self._url}: {error}") from None
        if self._watch is not None:
            self._watch.tls_outcome(self._url, "")
        return 200, data


class OipChannels:
    """`tls`: the TLS of grpcs:// URLs without settings of their own (a URL's `tls` attribute),
    asked for when the first such channel is made; None: the system's CAs."""

    def __init__(self, tls: Callable[[], ClientTls] | None = None) -> None:
        self._tls = tls
        self._default_tls: ClientTls | None = None
        self._channels: dict[str, aio.Channel] = {}
        self._calls: dict[tuple[str, str], aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        # TLS channels: the settings and the context they were made with (a newer one: files changed).
        self._made_with: dict[str, tuple[ClientTls, ssl.SSLContext]] = {}
        self._tls_calls: dict[
            tuple[str, str], tuple[aio.Channel, aio.UnaryUnaryMultiCallable[bytes, bytes]]
        ] = {}
        self._tls_failing: dict[str, str] = {}  # address -> the handshake failure logged
        self._retiring: set[asyncio.Task[None]] = set()

    def start(
        self,
        url: str,
        method: str,
        message: bytes,
        metadata: Sequence[tuple[str, str]],
        time_limit: float | None,
    ) -> OipPending:
        """Call `method` (e.g. `/inference.GRPCInferenceService/ModelInfer`) on the backend at `url`
        (`grpc://host:port`) with a serialized request. `metadata` keys are lower case; BadRequest
        names one gRPC cannot carry."""
        _check_metadata(metadata)
        multicallable = self._calls.get((url, method))
        if multicallable is None:
            if url in self._made_with or urlsplit(url).scheme == "grpcs":
                return OipPending(
                    url, self._tls_call(url, method)(message, timeout=time_limit, metadata=metadata), self
                )
            multicallable = self._calls[(url, method)] = self._channel(url).unary_unary(method)
        return OipPending(url, multicallable(message, timeout=time_limit, metadata=metadata))

    def _tls_call(self, url: str, method: str) -> aio.UnaryUnaryMultiCallable[bytes, bytes]:
        """A TLS address's method, looked up at each call (not kept in `_calls`), so that a channel
        made before its files changed is replaced."""
        channel = self._channel(url)
        kept = self._tls_calls.get((url, method))
        if kept is None or kept[0] is not channel:
            kept = self._tls_calls[(url, method)] = (channel, channel.unary_unary(method))
        return kept[1]

    def tls_outcome(self, url: str, details: str) -> None:
        """A TLS call ended (`details`: its error's, "" when it succeeded): a failed handshake is
        logged once per address, until a call there succeeds."""
        reason = tls_failure(details) if details else ""
        if reason:
            made = self._made_with.get(url)
            if made is not None:  # the next call opens a new channel if the files changed
                made[0].reload()
            if self._tls_failing.get(url) != reason:
                self._tls_failing[url] = reason
                log.warning(
                    "TLS to %s failed: %s; its calls fail until a handshake succeeds (logged once)",
                    url, reason,
                )  # fmt: skip
        elif not details and self._tls_failing.pop(url, None) is not None:
            log.info("TLS to %s works again", url)

    async def stream(
        self, url: str, method: str, messages: AsyncIterator[bytes], metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[bytes]:
        """A bidirectional call (ModelStreamInfer) to the backend at `url`: `messages` go out as
        they come, and each answer message comes back as it was sent, however many there are per
        request (a decoupled model's). A status other than OK ends it: ModelServerAnswered with
        the server's status, or the errors `start`'s answers raise for a backend that could not
        be reached or dropped the call."""
        _check_metadata(metadata)
        multicallable: aio.StreamStreamMultiCallable[bytes, bytes] = self._channel(url).stream_stream(method)
        call = multicallable(messages, metadata=metadata)
        try:
            async for message in call:
                yield message
        except aio.AioRpcError as error:
            status, body = _answer_for(url, error)
            document = orjson.loads(body)
            raise ModelServerAnswered(
                status, document["error"], grpc_status=document["grpc_status"]
            ) from None
        finally:
            call.cancel()  # a no-op once it ended; else the caller left: the backend learns it

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._calls, self._tls_calls, self._made_with = {}, {}, {}
        for channel in channels.values():
            await channel.close()
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    def _channel(self, url: str) -> aio.Channel:
        channel = self._channels.get(url)
        made = self._made_with.get(url)
        if channel is not None and made is not None and made[0].context() is not made[1]:
            # The files changed: new calls go on a channel made with them; the old one's end.
            retired = asyncio.get_running_loop().create_task(channel.close(grace=_RETIRE_GRACE))
            self._retiring.add(retired)
            retired.add_done_callback(self._retiring.discard)
            channel = None
        if channel is None:
            channel = self._channels[url] = self._open(url)
        return channel

    def _open(self, url: str) -> aio.Channel:
        target = grpc_target(url)
        if urlsplit(url).scheme != "grpcs":
            return aio.insecure_channel(target, _CHANNEL_OPTIONS)
        tls: ClientTls | None = getattr(url, "tls", None)
        if tls is None:
            if self._default_tls is None:
                self._default_tls = self._tls() if self._tls is not None else ClientTls(TlsClientConfig())
            tls = self._default_tls
        context = tls.context()  # first: the files read as they are now
        ca, key, chain = tls.material()
        if not tls.config.verify:
            log.warning("%s: tls.verify false does not apply to gRPC, which verifies the server anyway", url)
        credentials = grpc.ssl_channel_credentials(ca if ca is not None else system_cas(), key, chain)
        options: list[tuple[str, int | str]] = [*_CHANNEL_OPTIONS]
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        self._made_with[url] = (tls, context)
        return aio.secure_channel(target, credentials, options)


def _check_metadata(metadata: Sequence[tuple[str, str]]) -> None:
    for key, value in metadata:
        if not (_METADATA_KEY.match(key) and _METADATA_VALUE.match(value)):
            raise BadRequest(
                f"metadata {key[:100]!r}: a gRPC backend takes only lower-case keys of letters, "
                "digits, '-', '_' and '.', and values of printable ASCII (no tab)"
            )


def _answer_for(url: str, error: aio.AioRpcError) -> tuple[int, bytes]:
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and details == _LOCAL_DEADLINE:
        raise UpstreamTimeout(f"{url} did not answer in time")
    if code is grpc.StatusCode.UNAVAILABLE:
        if details.startswith(_UNREACHABLE):
            raise UpstreamUnreachable(f"cannot connect to {url}: {details}")
        if details.startswith(_DROPPED):
            raise UpstreamClosed(f"{url} dropped the call without an answer: {details}")
    status = _STATUSES.get(code, 500)
    message = details or f"the model server answered {code.name}"
    return status, orjson.dumps({"error": message, "grpc_status": code.name})
