"""OIP v2 over gRPC, the gateway's side: `GatewayOip` answers rpc.OipServer's calls through the same
routing as REST OIP requests (the model's cluster, routes, strategy, retries, outlier detection,
capacity and metrics), through `Proxy.call`.

The endpoint the strategy picks decides how the call reaches it. One with a `grpc_url` gets the
gRPC call itself, its message relayed as it came, and its answer message goes back unconverted
(`Relayed`). Any other gets the REST request a client would send over HTTP: the call's message
becomes OIP's JSON body (rpc/ converts it, only when such an endpoint is tried) and the JSON
answer goes back to rpc/ to become a gRPC message. A backend's error answer becomes
`ModelServerAnswered`, carrying its status and message, which rpc/ maps to a gRPC code (and cuts to
fit the header gRPC carries it in). The call's metadata goes to the backend as the REST path's
headers do (`forwarded_request_headers`: no hop-by-hop or framing headers), with an X-Request-Id:
the caller's `x-request-id` metadata, else one made here. A call refused before routing has an
access line and a routing-log record of its own (`_refused`), as a REST request has. A model's
`fallbacks` do not apply to gRPC calls (gateway/fallback.py): a call goes to the model it names.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import quote

import orjson

from modelyard import __version__
from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.errors import BadRequest, ModelServerAnswered, ModelyardError, NoHealthyEndpoint, UpstreamError
from modelyard.gateway.admission import CREDENTIAL_FIELDS
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.gateway import Gateway
from modelyard.gateway.proxy import REQUEST_ID_HEADER, Called
from modelyard.gateway.quotas import Permit
from modelyard.rpc import MODEL_STREAM_INFER, OipCall, Relayed, StreamRelay
from modelyard.upstream import forwarded_request_headers

_JSON = ("Content-Type", "application/json")
_REQUEST_ID = REQUEST_ID_HEADER.lower()


class GatewayOip:
    """The gateway as an `rpc.OipHandler`. `draining` says whether the gateway is shutting down."""

    def __init__(self, gateway: Gateway, draining: Callable[[], bool]) -> None:
        self._gateway = gateway
        self._draining = draining

    def ready(self) -> bool:
        return not self._draining() and all(c.ready for c in self._gateway.clusters.values())

    def server_metadata(self) -> tuple[str, str, list[str]]:
        return "modelyard", __version__, []

    async def model_ready(
        self, model: str, version: str, headers: Sequence[tuple[str, str]], call: OipCall
    ) -> bool | Relayed:
        cluster, path = self._target(headers, "GET", model, version, "/ready")
        try:
            answer = await self._call(cluster, "GET", path, headers, b"", call)
        except (UpstreamError, NoHealthyEndpoint):
            return False  # nothing serves it now: not ready, as opposed to unknown
        if answer.grpc and answer.status == 200:
            return Relayed(answer.body)
        return 200 <= answer.status < 300

    async def model_metadata(
        self, model: str, version: str, headers: Sequence[tuple[str, str]], call: OipCall
    ) -> object:
        cluster, path = self._target(headers, "GET", model, version, "")
        answer = await self._call(cluster, "GET", path, headers, b"", call)
        return _answer(answer)

    def admit(self, model: str, version: str, headers: Sequence[tuple[str, str]]) -> None:
        """ModelNotFound (or the placement error) for an unknown model, Overloaded when every
        endpoint is full: checked before rpc/ converts the call's tensors."""
        try:
            caller = None
            if self._gateway.admission is not None:
                caller = self._gateway.admission.admit_metadata(headers, model)
            self._gateway.admit(model, caller)
        except ModelyardError as exc:
            self._refused(headers, model, "POST", _rest_path(model, version, "/infer"), exc)
            raise

    async def infer(
        self, model: str, version: str, call: OipCall, headers: Sequence[tuple[str, str]]
    ) -> object:
        """The inference, once `admit(model)` has passed (rpc/ calls it first)."""
        sent = [*headers, _JSON]
        cluster, path = self._target(headers, "POST", model, version, "/infer")
        if cluster.speaks_grpc:  # converted only if an endpoint without gRPC is tried
            body, rest_body = None, lambda: orjson.dumps(call.json())
        else:  # converted before routing: a call that does not convert never takes a slot
            try:
                body, rest_body = orjson.dumps(call.json()), None
            except ModelyardError as exc:
                self._refused(headers, model, "POST", path, exc)
                raise
        permit = await self._take(headers, model, path)
        try:
            answer = await self._call(cluster, "POST", path, sent, body, call, rest_body, permit)
        except BaseException as exc:
            self._end(permit, exc)
            raise
        self._end(permit)
        return _answer(answer)

    def _end(self, permit: Permit | None, failed: BaseException | None = None) -> None:
        if permit is not None and self._gateway.admission is not None:
            self._gateway.admission.quotas_end(permit, failed)

    async def _take(self, headers: Sequence[tuple[str, str]], model: str, path: str) -> Permit | None:
        """auth.enabled: the caller's request let in against its limits (429: RESOURCE_EXHAUSTED)."""
        admission = self._gateway.admission
        if admission is None:
            return None
        try:
            return await admission.take(admission.admit_metadata(headers, model))
        except ModelyardError as exc:
            self._refused(headers, model, "POST", path, exc)
            raise

    def stream_relay(self, model: str, headers: Sequence[tuple[str, str]]) -> StreamRelay | None:
        """How a ModelStreamInfer whose first request is for `model` is relayed whole, as a stream,
        to one of the model's endpoints with a grpc_url (a decoupled model answers a request more
        than once); None when the model has none (each request is then routed on its own)."""
        try:
            if self._gateway.admission is not None:
                self._gateway.admission.admit_metadata(headers, model)
            cluster = self._gateway.cluster(model)
        except ModelyardError:
            return None  # unknown here (or not this caller's): each request gets its own error
        if not cluster.speaks_grpc or not any(
            e.grpc_url for e in cluster.routable(ALL_SUBSETS, time.monotonic())
        ):
            return None  # no gRPC endpoint up: answered request by request, over REST
        sent = self._forwarded(headers)
        path = _path(cluster, "", "/infer")

        async def relay(messages: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            permit = await self._take(headers, model, path)  # (the stream is one request)
            stream = self._gateway.proxy.stream(cluster, path, sent, MODEL_STREAM_INFER, messages, permit)
            try:
                async for message in stream:
                    yield message
            except BaseException as exc:
                self._end(permit, exc)
                raise
            self._end(permit)

        return relay

    async def _call(
        self,
        cluster: Cluster,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]],
        body: bytes | None,
        call: OipCall | None = None,
        rest_body: Callable[[], bytes] | None = None,
        permit: Permit | None = None,
    ) -> Called:
        sent = self._forwarded(headers)
        grpc = call if cluster.speaks_grpc else None
        return await self._gateway.proxy.call(
            cluster, method, path, sent, body, grpc=grpc, rest_body=rest_body, permit=permit
        )

    def _forwarded(self, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """The call's metadata as the headers a backend gets, with the caller's x-request-id or a
        new one."""
        if self._gateway.admission is not None:  # (the caller's key stays here)
            headers = [(k, v) for k, v in headers if k.lower().encode() not in CREDENTIAL_FIELDS]
        return forwarded_request_headers(headers, self.request_id(headers))

    def request_id(self, headers: Sequence[tuple[str, str]]) -> str:
        """The call's x-request-id metadata, or a new id as a REST request without one gets."""
        return (
            next((v for k, v in headers if k.lower() == _REQUEST_ID), "")
            or self._gateway.proxy.new_request_id()
        )

    def _target(
        self, headers: Sequence[tuple[str, str]], method: str, model: str, version: str, suffix: str
    ) -> tuple[Cluster, str]:
        """The model's cluster and the REST path a call to it stands for; an unknown model or a
        version not allowed refuses the call (with its access line)."""
        try:
            if self._gateway.admission is not None:
                self._gateway.admission.admit_metadata(headers, model)
            cluster = self._gateway.cluster(model)
            return cluster, _path(cluster, version, suffix)
        except ModelyardError as exc:
            self._refused(headers, model, method, _rest_path(model, version, suffix), exc)
            raise

    def _refused(
        self,
        headers: Sequence[tuple[str, str]],
        model: str,
        method: str,
        path: str,
        error: ModelyardError,
    ) -> None:
        """The access line and routing-log record of a call refused before routing (an unknown
        model, a version or tensors that cannot be sent, no room), as a REST request's: `path` is
        the REST one it stands for. It is refused as soon as it is looked at, so its duration is 0
        (rpc/ read its message before)."""
        request_id = self.request_id(headers)
        self._gateway.metrics.routing_log.record_refused(model, error.status, 0.0, request_id)
        access = self._gateway.access
        if access is not None:
            access.refused(request_id, method, path, error.status, 0.0)


def _path(cluster: Cluster, version: str, suffix: str) -> str:
    if version in (".", ".."):
        raise BadRequest(f"model version {version!r} is not allowed")
    return _rest_path(cluster.name, version, suffix)


def _rest_path(model: str, version: str, suffix: str) -> str:
    path = "/v2/models/" + quote(model, safe="")
    if version:
        path += "/versions/" + quote(version, safe="")
    return path + suffix


def _answer(answer: Called) -> object:
    """The server's answer (JSON, or a gRPC server's message as it is), or its error answer as a
    modelyard error with its status."""
    status, data = answer.status, answer.body
    if answer.grpc and status == 200:
        return Relayed(data)
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        body = None
    if 200 <= status < 300:
        if body is None:
            raise UpstreamError("the model server's answer is not JSON")
        return body
    message = body.get("error") if isinstance(body, dict) else None
    if not isinstance(message, str) or not message:
        message = data.decode(errors="replace")[:500] or f"the model server answered {status}"
    # A gRPC server's own status goes back as it was; otherwise the HTTP status decides the code.
    grpc_status = body.get("grpc_status") if answer.grpc and isinstance(body, dict) else None
    raise ModelServerAnswered(
        status, message, grpc_status=grpc_status if isinstance(grpc_status, str) else None
    )
