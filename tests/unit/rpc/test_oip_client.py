"""rpc/oip_client.py: what a gRPC backend's outcome becomes, and the metadata gRPC can carry."""

from __future__ import annotations

import grpc
import orjson
import pytest
from grpc import aio

from modelyard.errors import BadRequest, UpstreamClosed, UpstreamTimeout, UpstreamUnreachable
from modelyard.rpc.oip_client import OipChannels, _answer_for, grpc_target


def _error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("details", "error"),
    [
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused",
         UpstreamUnreachable),
        ("Socket closed", UpstreamClosed),
        ("Cancelling all calls", UpstreamClosed),  # the server's graceful stop
    ],
)  # fmt: skip
def test_grpcs_own_unavailable_texts_are_failures_to_answer(details: str, error: type[Exception]):
    with pytest.raises(error):
        _answer_for("grpc://h:1", _error(grpc.StatusCode.UNAVAILABLE, details))


def test_the_local_deadline_is_a_timeout_and_a_servers_is_its_answer():
    with pytest.raises(UpstreamTimeout):
        _answer_for("grpc://h:1", _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    status, body = _answer_for("grpc://h:1", _error(grpc.StatusCode.DEADLINE_EXCEEDED, "queue timeout"))
    assert (status, orjson.loads(body)) == (
        504,
        {"error": "queue timeout", "grpc_status": "DEADLINE_EXCEEDED"},
    )


def test_a_servers_unavailable_is_an_answer_whatever_its_text():
    status, body = _answer_for("grpc://h:1", _error(grpc.StatusCode.UNAVAILABLE, "db: connection refused"))
    assert (status, orjson.loads(body)["error"]) == (503, "db: connection refused")


@pytest.mark.parametrize(("key", "value"), [("x-a", "a\tb"), ("x-a", "é"), ("x a", "v"), ("X-A", "v")])
async def test_metadata_grpc_cannot_carry_is_refused_before_the_call(key: str, value: str):
    channels = OipChannels()
    with pytest.raises(BadRequest, match="a gRPC backend takes only"):
        channels.start("grpc://127.0.0.1:1", "/x/y", b"", [(key, value)], 1.0)
    await channels.close()


def test_grpc_target_brackets_an_ipv6_host():
    assert grpc_target("grpc://[::1]:8081") == "[::1]:8081"
    assert grpc_target("grpc://triton:8001") == "triton:8001"
