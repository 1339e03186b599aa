"""`OipChannels`: OIP v2 calls to backends over gRPC, the messages passed as bytes.

The gateway relays a gRPC client's call to a backend that speaks gRPC as it came: the request
message's bytes go out and the answer's bytes come back, with no conversion to JSON and back. A
call's outcome is given as the REST call's would be, so the attempt loop treats both alike: an
answer is `(200, message bytes)`, an error status is `(its HTTP status, OIP's error JSON)` (the
usual gRPC-to-HTTP table), and a backend that could not be reached raises `UpstreamUnreachable`
(retried as connect-failure), one that dropped the call `UpstreamClosed` (reset), one that ran
past `time_limit` (seconds) `UpstreamTimeout`.

One channel per backend address, made on first use; gRPC multiplexes the calls over its HTTP/2
connection. The channel's reconnect backoff is capped at a second: a backend that restarts is
called again as soon as it listens, not after gRPC's default of up to two minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

import grpc
import orjson
from grpc import aio

from modelyard.errors import UpstreamClosed, UpstreamTimeout, UpstreamUnreachable

# The HTTP status a REST server would have answered with (the inverse of oip_server's table).
_STATUSES = {
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
}
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),  # the attempt loop retries, by the route's policy
]


def grpc_target(url: str) -> str:
    """`host:port` of a `grpc://host:port` URL (a checked config value)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}"


class OipChannels:
    def __init__(self) -> None:
        self._channels: dict[str, aio.Channel] = {}
        self._calls: dict[tuple[str, str], aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}

    async def call(
        self,
        url: str,
        method: str,
        message: bytes,
        metadata: Sequence[tuple[str, str]],
        time_limit: float | None,
    ) -> tuple[int, bytes]:
        """Call `method` (e.g. `/inference.GRPCInferenceService/ModelInfer`) on the backend at `url`
        (`grpc://host:port`) with a serialized request; the answer as described above."""
        call = self._calls.get((url, method))
        if call is None:
            channel = self._channels.get(url)
            if channel is None:
                channel = self._channels[url] = aio.insecure_channel(grpc_target(url), _CHANNEL_OPTIONS)
            call = self._calls[(url, method)] = channel.unary_unary(method)
        try:
            answer: bytes = await call(message, timeout=time_limit, metadata=metadata)
        except aio.AioRpcError as error:
            return _answer_for(url, error)
        return 200, answer

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._calls = {}
        for channel in channels.values():
            await channel.close()


def _answer_for(url: str, error: aio.AioRpcError) -> tuple[int, bytes]:
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        raise UpstreamTimeout(f"{url} did not answer in time")
    if code is grpc.StatusCode.UNAVAILABLE:
        # gRPC says UNAVAILABLE both when it could not connect and when a server answers so; the
        # details tell them apart ("failed to connect to all addresses", "Socket closed").
        lowered = details.lower()
        if "failed to connect" in lowered or "connection refused" in lowered:
            raise UpstreamUnreachable(f"cannot connect to {url}: {details}")
        if "socket closed" in lowered or "connection reset" in lowered or "goaway" in lowered:
            raise UpstreamClosed(f"{url} closed the call without an answer: {details}")
    status = _STATUSES.get(code, 500)
    return status, orjson.dumps({"error": details or f"the model server answered {code.name}"})
