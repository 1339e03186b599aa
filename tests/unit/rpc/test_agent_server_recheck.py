"""A subscription admitted by a join token ends once the token is removed from its file, however
often operations arrive: the recheck's deadline is the call's, not each wait's (with operations
more often than the recheck interval, a revoked token kept its subscription running)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from modelyard.rpc.agent_server import AgentCredentials, _Admission, _Servicer
from modelyard.rpc.agent_v1 import agent_pb2
from modelyard.security.tokens import TokenFile

TOKEN = "j-0123456789abcdef0123"


class Ended(Exception):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code


class Call:
    """The little of a gRPC call's context the servicer asks."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Ended(code)


class Operations:
    def __init__(self, every: float) -> None:
        self.every = every

    async def subscribe(self, request: object, peer: str) -> AsyncIterator[agent_pb2.ModelOperation]:
        while True:
            await asyncio.sleep(self.every)
            yield agent_pb2.ModelOperation()


@pytest.mark.parametrize("every", [0.5, 0.02], ids=["operations-rarer-than-the-recheck", "more-often"])
async def test_a_removed_join_token_ends_its_subscription(tmp_path: Path, every: float) -> None:
    tokens_file = tmp_path / "agent-tokens"
    tokens_file.write_text(f"sim {TOKEN}\n")
    tokens = TokenFile(str(tokens_file), reload_interval=0.05)
    servicer = _Servicer(
        Operations(every), _Admission(AgentCredentials(certificates=False, tokens=tokens)), recheck=0.1
    )
    delivered = 0

    async def follow() -> None:
        nonlocal delivered
        async for _ in servicer.Subscribe(
            agent_pb2.SubscribeRequest(server_name="sim", replica_idx=0), Call()
        ):
            delivered += 1
            if delivered == 3:
                tokens_file.write_text("sim j-rotated-0123456789abcdef\n")

    with pytest.raises(Ended) as ended:
        await asyncio.wait_for(follow(), 10)
    assert ended.value.code == grpc.StatusCode.UNAUTHENTICATED
