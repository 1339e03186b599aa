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
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import grpc
import orjson
from grpc import aio

from modelyard.errors import (
    BadRequest,
    ModelServerAnswered,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

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
# What gRPC takes as metadata (keys lower-case); an HTTP header may hold more (a tab, upper case).
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+\Z")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*\Z")


def grpc_target(url: str) -> str:
    """`host:port` of a `grpc://host:port` URL (a checked config value)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}"


class OipPending:
    """One call on its way: `answer()` waits for its outcome; `abort(error)` gives it up (its
    endpoint was taken out), and `answer()` then raises `error`."""

    __slots__ = ("_aborted", "_call", "_url")

    def __init__(self, url: str, call: aio.UnaryUnaryCall[bytes, bytes]) -> None:
        self._url = url
        self._call = call
        self._aborted: UpstreamError | None = None

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
            return _answer_for(self._url, error)
        except Exception as error:  # what grpc raises for a call it could not start
            raise UpstreamError(f"cannot call {self._url}: {error}") from None
        return 200, data


class OipChannels:
    def __init__(self) -> None:
        self._channels: dict[str, aio.Channel] = {}
        self._calls: dict[tuple[str, str], aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}

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
            multicallable = self._calls[(url, method)] = self._channel(url).unary_unary(method)
        return OipPending(url, multicallable(message, timeout=time_limit, metadata=metadata))

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
        self._calls = {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, url: str) -> aio.Channel:
        channel = self._channels.get(url)
        if channel is None:
            channel = self._channels[url] = aio.insecure_channel(grpc_target(url), _CHANNEL_OPTIONS)
        return channel


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
