"""`OipServer`: the Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`, what
tritonclient.grpc and KServe's clients call) on a grpc.aio server, handing each call to an
`OipHandler`: a plain Protocol that speaks OIP's REST JSON and never sees grpc or protobuf.

Messages are translated to and from JSON in oip_tensors.py. The handler raises modelyard's errors;
`oip_status` turns them into gRPC status codes here, in one place, from the HTTP status each error
carries (the usual HTTP-to-gRPC table): 400 INVALID_ARGUMENT, 404 NOT_FOUND, 413/429
RESOURCE_EXHAUSTED, 502/503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, the rest INTERNAL and friends.
Status details are cut to `MAX_DETAILS` characters: gRPC carries them in a header, which clients
cap at 8 KiB.

The call's metadata becomes the request headers the handler routes on and forwards, less gRPC's
own (pseudo-headers, `grpc-*`, content-type, te, accept-encoding) and the framing headers the
gateway sets itself; `-bin` metadata (binary) is not forwarded. A value with a character outside
visible ASCII, space and tab is refused (INVALID_ARGUMENT): grpc-core takes CR and LF from a raw
HTTP/2 client, and they must never reach an HTTP/1.1 request head.

A unary call (ModelReady, ModelMetadata, ModelInfer) has a request id, as a REST request does: its
`x-request-id` metadata, else one the handler makes (`request_id`), added to the headers the
handler gets. It goes back to the client in the answer's trailing metadata, errors included (the
counterpart of a REST answer's X-Request-Id header), unless gRPC metadata cannot carry it (a tab,
or over MAX_ID_BACK characters), or the call is refused before the handler sees it (metadata no
header may carry, no model name). A stream's requests, answered one by one, have an id each that
does not come back: one stream has one set of trailing metadata.

An infer call asks the handler to `admit` the model (known, with capacity) before anything else.
The handler gets the call as an `OipCall`: the request message's bytes, to relay to a backend that
speaks gRPC as they are, and (for ModelInfer) its JSON for a REST backend, converted only when asked
and bounded by `max_message_bytes` of JSON. It answers with JSON, or with `Relayed` bytes: a gRPC
backend's answer message, passed on unconverted.
ModelStreamInfer is relayed whole when the handler has a `stream_relay` for its first request's
model (a gRPC backend: every answer it sends, several per request for a decoupled model, and its
status); otherwise each request of the stream is answered as a ModelInfer, in order, an error
in-stream (`error_message`) without ending the stream. The Triton-only methods (ModelConfig, repository and
shared-memory calls) are not defined by this service: gRPC answers them UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from grpc import aio

from modelyard.config import TlsServerConfig
from modelyard.errors import BadRequest, ModelServerAnswered, ModelyardError, UpstreamError
from modelyard.rpc._server import grpc_address, start_server, watch_tls
from modelyard.rpc.oip_tensors import infer_request_json, infer_response, model_metadata
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from modelyard.security.tls import ServerTls

log = logging.getLogger("modelyard.rpc")

Headers = Sequence[tuple[str, str]]
T = TypeVar("T")

# Metadata that belongs to the gRPC call itself, or frames a message, not to the request the handler
# routes and forwards (the gateway frames that request itself).
_CALL_METADATA = frozenset(
    {
        "accept-encoding",
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "expect",
        "host",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_HEADER_TEXT = re.compile(r"[^\t\x20-\x7e]")
_NOT_METADATA_TEXT = re.compile(r"[^\x20-\x7e]")  # what gRPC allows in a text metadata value
REQUEST_ID = "x-request-id"
# Longer ids are not sent back: with MAX_DETAILS of status details they could pass the 8 KiB of
# metadata a client takes.
MAX_ID_BACK = 256
MAX_DETAILS = 1000


_SERVICE = "/inference.GRPCInferenceService/"
MODEL_READY = _SERVICE + "ModelReady"
MODEL_METADATA = _SERVICE + "ModelMetadata"
MODEL_INFER = _SERVICE + "ModelInfer"
MODEL_STREAM_INFER = _SERVICE + "ModelStreamInfer"
StreamRelay = Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]  # request messages -> answers


@dataclass(frozen=True, slots=True)
class Relayed:
    """An answer message as a gRPC backend sent it (serialized), passed on without conversion."""

    message: bytes


class OipCall:
    """One call for the handler: `method` (the gRPC method's path) and `message` (the request's
    bytes) relay it to a gRPC backend unchanged; `json()` is a ModelInfer request as OIP's REST JSON
    body, converted on the first call (BadRequest for tensors that do not convert, RESOURCE_EXHAUSTED
    past the JSON bound)."""

    __slots__ = ("_json", "_max_json_bytes", "_message", "_request", "method")

    def __init__(self, method: str, request: Any, max_json_bytes: int = 0) -> None:
        self.method = method
        self._request = request
        self._max_json_bytes = max_json_bytes
        self._json: dict[str, Any] | None = None
        self._message: bytes | None = None

    @property
    def message(self) -> bytes:
        if self._message is None:
            self._message = self._request.SerializeToString()
        return self._message

    def json(self) -> dict[str, Any]:
        if self._json is None:
            self._json = infer_request_json(self._request, max_json_bytes=self._max_json_bytes)
        return self._json


class OipHandler(Protocol):
    """What the gateway does with each OIP call. `headers` is the call's metadata (routes match on it,
    and it is forwarded as request headers); bodies are OIP v2 REST JSON, or `Relayed` messages."""

    def ready(self) -> bool:
        """Whether the server is ready for inference (REST: GET /v2/health/ready)."""
        ...

    def request_id(self, headers: Headers) -> str:
        """A unary call's request id: its x-request-id metadata, else a new one ("": none)."""
        ...

    def server_metadata(self) -> tuple[str, str, list[str]]:
        """The server's name, version and extensions."""
        ...

    async def model_ready(
        self, model: str, version: str, headers: Headers, call: OipCall
    ) -> bool | Relayed: ...

    def admit(self, model: str, version: str, headers: Headers) -> None:
        """Raise when an inference for `model` would be refused anyway (an unknown model, no
        capacity): the call fails before its tensors are converted. (`version` and `headers` say
        which call it was, for the handler's own account of it, such as an access log line.)"""
        ...

    async def model_metadata(self, model: str, version: str, headers: Headers, call: OipCall) -> object:
        """The model's metadata as JSON (REST: GET /v2/models/{model}[/versions/{version}])."""
        ...

    async def infer(self, model: str, version: str, call: OipCall, headers: Headers) -> object:
        """One inference: the JSON answer to `call.json()` (REST: POST /v2/models/{model}/infer)."""
        ...

    def stream_relay(self, model: str, headers: Headers) -> StreamRelay | None:
        """How to relay a whole ModelStreamInfer whose first request is for `model` (its request
        messages in, its answer messages out, as bytes); None: answer each request as a ModelInfer."""
        ...


_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def oip_status(error: ModelyardError) -> grpc.StatusCode:
    """The gRPC status for a modelyard error (or a model server's answer carried as one: a gRPC
    server's own status as it was)."""
    if isinstance(error, ModelServerAnswered) and error.grpc_status is not None:
        relayed = getattr(grpc.StatusCode, error.grpc_status, None)
        if isinstance(relayed, grpc.StatusCode) and relayed is not grpc.StatusCode.OK:
            return relayed
    code = _CODES.get(error.status)
    if code is not None:
        return code
    if 400 <= error.status < 500:
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _is_header_text(text: str) -> bool:
    """Visible ASCII, space and tab only: what may stand in an HTTP/1.1 header field."""
    return _NOT_HEADER_TEXT.search(text) is None


def call_headers(metadata: Iterable[tuple[str, str | bytes]]) -> list[tuple[str, str]]:
    """The request headers a call's metadata stands for; BadRequest names a key whose value (or
    the key itself) holds a character no HTTP header may carry."""
    headers = []
    for key, value in metadata:
        if key.endswith("-bin") or not isinstance(value, str):
            continue  # binary metadata: no header carries it
        if key.startswith((":", "grpc-")) or key in _CALL_METADATA:
            continue
        if not (_is_header_text(key) and _is_header_text(value)):
            raise BadRequest(
                f"metadata {key[:100]!r}: a header may hold only visible ASCII, space and tab "
                "(no CR, LF or other control characters)"
            )
        headers.append((key, value))
    return headers


def _headers(context: aio.ServicerContext[Any, Any]) -> list[tuple[str, str]]:
    return call_headers(context.invocation_metadata() or ())


def _identified(handler: OipHandler, context: aio.ServicerContext[Any, Any]) -> list[tuple[str, str]]:
    """A unary call's headers, with its request id (added when the call had none), which is set as
    the answer's trailing metadata: sent with its status, whether the call succeeds or is aborted."""
    headers = _headers(context)
    request_id = handler.request_id(headers)
    if not request_id:
        return headers
    # The one id the handler sees from here (an empty one sent by the client would make it a new
    # id each time it asked).
    headers = [(key, value) for key, value in headers if key.lower() != REQUEST_ID]
    headers.append((REQUEST_ID, request_id))
    if len(request_id) <= MAX_ID_BACK and _NOT_METADATA_TEXT.search(request_id) is None:
        context.set_trailing_metadata(((REQUEST_ID, request_id),))
    return headers


def _details(message: str) -> str:
    if len(message) <= MAX_DETAILS:
        return message
    return message[: MAX_DETAILS - 3] + "..."


async def _answer(context: aio.ServicerContext[Any, Any], work: Callable[[], Awaitable[T]]) -> T:
    """`work()`'s answer, or the call aborted with the status for what it raised."""
    try:
        return await work()
    except ModelyardError as error:
        await context.abort(oip_status(error), _details(error.message))
    except Exception:
        log.exception("unhandled error in an OIP gRPC call")
        await context.abort(grpc.StatusCode.INTERNAL, "internal gateway error; see the gateway log")
    raise AssertionError("unreachable: abort raises")


M = TypeVar(
    "M", pb.ModelReadyResponse, pb.ModelMetadataResponse, pb.ModelInferResponse, pb.ModelStreamInferResponse
)


def _parsed(kind: type[M], answer: Relayed) -> M:
    try:
        return kind.FromString(answer.message)
    except Exception:  # protobuf's DecodeError, whichever backend (upb, C++, Python) raised it
        raise UpstreamError(f"the model server's answer is not a {kind.__name__}") from None


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, handler: OipHandler, max_json_bytes: int) -> None:
        self._handler = handler
        self._max_json_bytes = max_json_bytes

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._handler.ready())

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        name, version, extensions = self._handler.server_metadata()
        return pb.ServerMetadataResponse(name=name, version=version, extensions=extensions)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            call = OipCall(MODEL_READY, request)
            headers = _identified(self._handler, context)
            ready = await self._handler.model_ready(request.name, request.version, headers, call)
            if isinstance(ready, Relayed):
                return _parsed(pb.ModelReadyResponse, ready)
            return pb.ModelReadyResponse(ready=ready)

        return await _answer(context, work)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            call = OipCall(MODEL_METADATA, request)
            headers = _identified(self._handler, context)
            body = await self._handler.model_metadata(request.name, request.version, headers, call)
            if isinstance(body, Relayed):
                return _parsed(pb.ModelMetadataResponse, body)
            return model_metadata(body, request.name)

        return await _answer(context, work)

    async def _infer(self, request: pb.ModelInferRequest, headers: Headers) -> pb.ModelInferResponse:
        if not request.model_name:
            raise BadRequest("model_name is required")
        self._handler.admit(request.model_name, request.model_version, headers)
        call = OipCall(MODEL_INFER, request, self._max_json_bytes)
        answer = await self._handler.infer(request.model_name, request.model_version, call, headers)
        if isinstance(answer, Relayed):
            response = _parsed(pb.ModelInferResponse, answer)
        else:
            response = infer_response(answer, request.model_name, request.model_version)
        if request.id and not response.id:
            response.id = request.id  # as Triton: a stream's answers are matched to requests by id
        return response

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        async def work() -> pb.ModelInferResponse:
            if not request.model_name:  # refused before the gateway sees it: no id (and no access line)
                raise BadRequest("model_name is required")
            return await self._infer(request, _identified(self._handler, context))

        return await _answer(context, work)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Relayed whole when the handler has a `stream_relay` for the first request's model (see
        `_relay_stream`). Otherwise each request of the stream is a ModelInfer, answered in order;
        a request that fails is answered with its error (`error_message`) and the stream goes on,
        as Triton's does."""
        try:
            headers = _headers(context)
        except ModelyardError as error:
            await context.abort(oip_status(error), _details(error.message))
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        relay = self._handler.stream_relay(first.model_name, headers)
        if relay is not None:
            async for answer in self._relay_stream(relay, first, request_iterator, context):
                yield answer
            return
        async for request in _chain(first, request_iterator):
            try:
                yield pb.ModelStreamInferResponse(infer_response=await self._infer(request, headers))
            except ModelyardError as error:
                yield pb.ModelStreamInferResponse(
                    error_message=_details(error.message),
                    infer_response=pb.ModelInferResponse(
                        model_name=request.model_name, model_version=request.model_version, id=request.id
                    ),
                )
            except Exception:
                log.exception("unhandled error in an OIP gRPC stream")
                yield pb.ModelStreamInferResponse(
                    error_message="internal gateway error; see the gateway log",
                    infer_response=pb.ModelInferResponse(id=request.id),
                )

    async def _relay_stream(
        self,
        relay: StreamRelay,
        first: pb.ModelInferRequest,
        rest: AsyncIterator[pb.ModelInferRequest],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The stream relayed whole: an error from the backend (or in routing) ends it with its
        status, as the backend's own stream would."""

        unread: list[Exception] = []  # a request of the client's that could not be read

        async def messages() -> AsyncIterator[bytes]:
            try:
                async for request in _chain(first, rest):
                    yield request.SerializeToString()
            except Exception as error:  # grpc's task feeding the backend cancels the call on it
                unread.append(error)
                raise

        try:
            async for data in relay(messages()):
                yield _parsed(pb.ModelStreamInferResponse, Relayed(data))
        except ModelyardError as error:
            await context.abort(oip_status(error), _details(error.message))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if unread and not (task is not None and task.cancelling()):
                message = f"a request of the stream could not be read: {unread[0]}"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(message))
            raise


async def _chain(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


class OipServer:
    """GRPCInferenceService on `host:port` (port 0: any free port; `port` holds the bound one after
    start). `max_message_bytes` bounds a request message, as limits.max_body_bytes bounds a REST body,
    and the JSON an infer call becomes. `reuse_port`: bind with SO_REUSEPORT, to share the port with
    the other workers of one group (their parent has checked that nothing else holds it); off, a
    port in use is refused."""

    def __init__(
        self,
        handler: OipHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_message_bytes: int,
        reuse_port: bool = False,
        tls: TlsServerConfig | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._handler = handler
        self._max_message_bytes = max_message_bytes
        self._reuse_port = reuse_port
        self._server: aio.Server | None = None
        self.tls = ServerTls(tls, alpn=()) if tls is not None else None  # files checked now
        self._tls_watch: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return grpc_address(self.host, self.port)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("OipServer already started")
        servicer = _Servicer(self._handler, self._max_message_bytes)
        # SO_REUSEPORT off unless asked: a second gateway on a port in use fails here instead of
        # sharing it.
        self._server, self.port = await start_server(
            self.host,
            self.port,
            lambda server: pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server),
            what="OIP gRPC",
            reuse_port=self._reuse_port,
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", -1),
            ],
            tls=self.tls,
        )
        self._tls_watch = watch_tls(self.tls)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting calls; calls in flight get `grace` seconds, then are cancelled. Safe twice."""
        server, self._server = self._server, None
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        if server is not None:
            await server.stop(grace)
