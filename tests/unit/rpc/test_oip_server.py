"""rpc/oip_server.py: the call's metadata as headers, errors as gRPC codes, and the order of an infer
call's checks, against a real grpc.aio server on an ephemeral port with a stub handler."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio

from modelyard import errors
from modelyard.errors import BadRequest, ModelNotFound, ModelyardError
from modelyard.rpc import oip_server
from modelyard.rpc.oip_server import OipCall, OipServer, Relayed, call_headers, oip_status
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2_grpc as pb_grpc


def test_metadata_becomes_headers_less_the_calls_own():
    metadata = [
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("grpc-accept-encoding", "gzip"),
        ("grpc-timeout", "1S"),
        ("te", "trailers"),
        ("accept-encoding", "identity,gzip"),
        ("content-length", "0"),
        ("content-encoding", "gzip"),
        ("transfer-encoding", "chunked"),
        ("expect", "100-continue"),
        ("host", "elsewhere"),
        ("connection", "close"),
        ("trace-bin", b"\x00\r\n"),
        ("user-agent", "grpc-python/1"),
        ("x-tier", "canary\twith a tab"),
    ]
    assert call_headers(metadata) == [("user-agent", "grpc-python/1"), ("x-tier", "canary\twith a tab")]


@pytest.mark.parametrize("value", ["v\r\nX-Injected: yes", "v\nx", "v\rx", "v\0x", "v\x7fx", "é"])
def test_metadata_that_no_header_may_carry_is_refused(value: str):
    with pytest.raises(BadRequest, match="metadata 'x-a': a header may hold only visible ASCII"):
        call_headers([("x-ok", "1"), ("x-a", value)])


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.BadRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.PayloadTooLarge("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.ModelNotFound("m", []), grpc.StatusCode.NOT_FOUND),
        (errors.Unauthorized("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.UpstreamError("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.NoHealthyEndpoint("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.UpstreamTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.ModelyardError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_oip_status_maps_the_error_tree(error: ModelyardError, code: grpc.StatusCode):
    assert oip_status(error) == code


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (499, grpc.StatusCode.CANCELLED),  # the client closed the request
        (418, grpc.StatusCode.FAILED_PRECONDITION),  # any other 4xx
        (422, grpc.StatusCode.FAILED_PRECONDITION),
        (501, grpc.StatusCode.UNIMPLEMENTED),
        (500, grpc.StatusCode.INTERNAL),
        (507, grpc.StatusCode.INTERNAL),  # any other 5xx
        (599, grpc.StatusCode.INTERNAL),
    ],
)
def test_oip_status_maps_a_model_servers_status(status: int, code: grpc.StatusCode):
    error = ModelyardError("the model server's answer")
    error.status = status
    assert oip_status(error) == code


class StubHandler:
    """An OipHandler that knows one model, "m", and records what reached it. It answers with JSON,
    as the gateway does for a REST backend, or with `relayed` bytes, as for a gRPC backend."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.error: ModelyardError | None = None
        self.relayed: bytes | None = None
        self.messages: list[tuple[str, bytes]] = []

    def ready(self) -> bool:
        return True

    def request_id(self, headers: Any) -> str:
        return next((v for k, v in headers if k == "x-request-id"), "") or "made-here"

    def server_metadata(self) -> tuple[str, str, list[str]]:
        return "stub", "0", []

    async def model_ready(self, model: str, version: str, headers: Any, call: OipCall) -> bool | Relayed:
        self.messages.append((call.method, call.message))
        return Relayed(self.relayed) if self.relayed is not None else True

    async def model_metadata(self, model: str, version: str, headers: Any, call: OipCall) -> object:
        self.messages.append((call.method, call.message))
        return Relayed(self.relayed) if self.relayed is not None else {"name": model}

    def admit(self, model: str, version: str, headers: Any) -> None:
        self.calls.append(("admit", model))
        if model != "m":
            raise ModelNotFound(model, ["m"])

    def stream_relay(self, model: str, headers: Any) -> None:
        return None

    async def infer(self, model: str, version: str, call: OipCall, headers: Any) -> object:
        self.messages.append((call.method, call.message))
        if self.relayed is not None:
            self.calls.append(("infer", headers))
            return Relayed(self.relayed)
        call.json()  # what a REST backend needs
        self.calls.append(("infer", headers))
        if self.error is not None:
            raise self.error
        return {"outputs": []}


@pytest.fixture
async def stub() -> AsyncIterator[tuple[StubHandler, pb_grpc.GRPCInferenceServiceStub]]:
    handler = StubHandler()
    server = OipServer(handler, max_message_bytes=1 << 20)
    await server.start()
    channel = aio.insecure_channel(server.address)
    try:
        yield handler, pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def _infer(
    model: str, raw: bytes, datatype: str = "FP32", shape: tuple[int, ...] = (2,)
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[raw])
    request.inputs.add(name="x", datatype=datatype, shape=list(shape))
    return request


async def test_an_unknown_model_is_refused_before_its_tensors_are_converted(stub):
    handler, client = stub
    bad = _infer("nope", b"\0" * 3)  # 3 bytes for two FP32: INVALID_ARGUMENT, were it converted
    with pytest.raises(aio.AioRpcError) as refused:
        await client.ModelInfer(bad, timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert handler.calls == [("admit", "nope")]
    with pytest.raises(aio.AioRpcError) as invalid:
        await client.ModelInfer(_infer("m", b"\0" * 3), timeout=10)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_json_a_call_becomes_is_bounded_by_max_message_bytes(stub):
    handler, client = stub
    # 64 Ki FP64 (512 KiB of message) could take 1.6 MB of JSON: over the 1 MiB bound.
    big = _infer("m", b"\0" * 8 * 65536, "FP64", (65536,))
    with pytest.raises(aio.AioRpcError) as refused:
        await client.ModelInfer(big, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_body_bytes (1048576)" in (refused.value.details() or "")
    assert not [call for call in handler.calls if call[0] == "infer"]


async def test_long_error_messages_are_cut_for_the_status_details(stub):
    handler, client = stub
    handler.error = BadRequest("x" * 20_000)
    with pytest.raises(aio.AioRpcError) as refused:
        await client.ModelInfer(_infer("m", b"\0" * 8), timeout=10)
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) == oip_server.MAX_DETAILS and details.endswith("...")


async def test_a_relayed_answer_reaches_the_client_as_the_backend_sent_it(stub):
    handler, client = stub
    answer = pb.ModelInferResponse(model_name="m", id="7", raw_output_contents=[b"\x01\x02"])
    answer.outputs.add(name="y", datatype="UINT8", shape=[2])
    handler.relayed = answer.SerializeToString()
    request = _infer("m", b"\0" * 3)  # not convertible: a relayed call is never converted
    got = await client.ModelInfer(request, timeout=10)
    assert got == answer
    assert handler.messages == [(oip_server.MODEL_INFER, request.SerializeToString())]
    handler.relayed = pb.ModelReadyResponse(ready=False).SerializeToString()
    assert (await client.ModelReady(pb.ModelReadyRequest(name="m", version="2"), timeout=10)).ready is False
    method, message = handler.messages[-1]
    assert (method, pb.ModelReadyRequest.FromString(message).version) == (oip_server.MODEL_READY, "2")
    metadata = pb.ModelMetadataResponse(name="m", versions=["2"], platform="relayed")
    handler.relayed = metadata.SerializeToString()
    assert await client.ModelMetadata(pb.ModelMetadataRequest(name="m"), timeout=10) == metadata
    assert handler.messages[-1][0] == oip_server.MODEL_METADATA


async def test_a_relayed_answer_that_is_not_the_message_is_unavailable(stub):
    handler, client = stub
    handler.relayed = b"\xff\xff\xff"  # not a ModelInferResponse
    with pytest.raises(aio.AioRpcError) as failed:
        await client.ModelInfer(_infer("m", b"\0" * 8), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.details() == "the model server's answer is not a ModelInferResponse"


async def test_a_unary_calls_request_id_comes_back_in_its_trailing_metadata(stub):
    handler, client = stub
    call = client.ModelInfer(_infer("m", b"\0" * 8), metadata=(("x-request-id", "mine"),), timeout=10)
    await call
    assert await call.trailing_metadata() == aio.Metadata(("x-request-id", "mine"))
    call = client.ModelInfer(_infer("m", b"\0" * 8), timeout=10)  # none sent: the handler's own
    await call
    assert await call.trailing_metadata() == aio.Metadata(("x-request-id", "made-here"))
    sent = [
        [v for k, v in headers if k == "x-request-id"] for name, headers in handler.calls if name == "infer"
    ]
    assert sent == [["mine"], ["made-here"]]  # once each, as it went back
    # An empty id is no id: one new one, the same for the handler and the client.
    call = client.ModelInfer(_infer("m", b"\0" * 8), metadata=(("x-request-id", ""),), timeout=10)
    await call
    assert await call.trailing_metadata() == aio.Metadata(("x-request-id", "made-here"))
    assert [v for k, v in handler.calls[-1][1] if k == "x-request-id"] == ["made-here"]
    # Too long to send back safely: the handler still has it, the answer carries none.
    long_id = "i" * (oip_server.MAX_ID_BACK + 1)
    call = client.ModelInfer(_infer("m", b"\0" * 8), metadata=(("x-request-id", long_id),), timeout=10)
    await call
    assert await call.trailing_metadata() == aio.Metadata()
    assert [v for k, v in handler.calls[-1][1] if k == "x-request-id"] == [long_id]
    with pytest.raises(aio.AioRpcError) as refused:  # an error carries it too
        await client.ModelInfer(_infer("nope", b"\0" * 8), metadata=(("x-request-id", "n1"),), timeout=10)
    assert refused.value.trailing_metadata() == aio.Metadata(("x-request-id", "n1"))
    for reply in (
        client.ModelReady(pb.ModelReadyRequest(name="m"), timeout=10),
        client.ModelMetadata(pb.ModelMetadataRequest(name="m"), timeout=10),
    ):
        await reply
        assert await reply.trailing_metadata() == aio.Metadata(("x-request-id", "made-here"))


async def test_header_injection_through_metadata(stub):
    handler, client = stub
    request = _infer("m", b"\0" * 8)
    await client.ModelInfer(request, metadata=(("x-a", "v"),), timeout=10)
    (sent,) = [headers for call, headers in handler.calls if call == "infer"]
    assert ("x-a", "v") in sent
    # grpc's Python client refuses CR/LF in a value before sending (a raw HTTP/2 client need not,
    # and grpc-core's server takes them): call_headers is unit-tested above for that case.
    with pytest.raises(Exception, match=r"(?i)metadata"):
        await client.ModelInfer(request, metadata=(("x-a", "v\r\nX-Injected: yes"),), timeout=10)
    assert len([c for c in handler.calls if c[0] == "infer"]) == 1


async def test_a_failed_bind_stops_the_server_it_made(monkeypatch):
    made: list[RecordedServer] = []
    real = aio.server

    def server(*args: Any, **kwargs: Any) -> Any:
        made.append(RecordedServer(real(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(oip_server.aio, "server", server)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        oip = OipServer(StubHandler(), port=taken.getsockname()[1], max_message_bytes=1024)
        with pytest.raises(OSError, match="OIP gRPC"):
            await oip.start()
    assert [s.stopped for s in made] == [True]


class RecordedServer:
    """A grpc.aio server that records whether it was stopped."""

    def __init__(self, server: aio.Server) -> None:
        self._server = server
        self.stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    async def stop(self, grace: float | None) -> None:
        self.stopped = True
        await self._server.stop(grace)
