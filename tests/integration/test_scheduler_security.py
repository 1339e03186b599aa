"""A control plane only its own components can drive (issue 28 item 3, the scheduler's side): every
attack an outside probe made on the scheduler, as a regression test that must be refused. A real
scheduler in-process, real TLS handshakes with real certificates (trustme, and URI SANs made with
cryptography), real gRPC calls from fake agents."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest

from agent_identities import agent_certificate, issue_uri
from certificates import Issued, Pki
from modelyard.config import TlsClientConfig
from modelyard.errors import ConfigError
from modelyard.protocols.feed import Snapshot
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from modelyard.security.tls import ClientTls
from modelyard.upstream.feed import FeedClient
from support import wait_until

READ_TOKEN = "r-9f2c6d0a7b1e4c3f8a5d"
WRITE_TOKEN = "w-5e8b1a3c9d7f2e6a0b4c"
JOIN_TOKEN = "j-1c7e9a2f5b3d8e0a6c4f"
REALM = 'Bearer realm="modelyard-scheduler"'
REAL_URL = "http://127.0.0.1:18080"
EVIL_URL = "http://127.0.0.1:18666"
IRIS = {"storage_uri": "file:///models/iris", "memory": 100, "parameters": {"api_key": "hunter2"}}
Code = grpc.StatusCode


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "server-ca")


@pytest.fixture
def agent_ca(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "agent-ca")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the scheduler's REST tokens\nread {READ_TOKEN}\nwrite {WRITE_TOKEN}\n")
    agents = tmp_path / "agent-tokens"
    agents.write_text(f"sim {JOIN_TOKEN}\n")
    return {"tokens": str(tokens), "agent_tokens": str(agents)}


@pytest.fixture
async def scheduler(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[RunningScheduler] = []

    async def start(**overrides: Any) -> RunningScheduler:
        settings = {"port": 0, "agent_port": 0, "db": ":memory:", "retry_interval": 60, **overrides}
        running = await start_scheduler(SchedulerConfig(**settings))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


def tls(server: Issued, **fields: Any) -> dict[str, Any]:
    return {"cert_file": str(server.cert), "key_file": str(server.key), **fields}


def secured(pki: Pki, agent_ca: Pki, files: dict[str, str], **overrides: Any) -> dict[str, Any]:
    """A scheduler as it should run on a network: TLS, REST tokens, agents by mutual TLS."""
    return {
        "tls": tls(pki.issue()),
        "tokens_file": files["tokens"],
        "agent_ca_file": str(agent_ca.ca_file),
        **overrides,
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Agent:
    """A fake agent on its own gRPC connection, with whatever credentials a test gives it: it
    subscribes as a replica and answers LOAD with LOADED and UNLOAD with UNLOADED."""

    def __init__(
        self,
        sched: RunningScheduler,
        pki: Pki | None = None,
        cert: Issued | None = None,
        token: str | None = None,
    ) -> None:
        self.sched = sched
        # Its own connection, as another process's would be (grpc shares them between channels).
        options = [("grpc.use_local_subchannel_pool", 1)]
        if pki is not None:
            key = cert.key.read_bytes() if cert is not None else None
            chain = cert.cert.read_bytes() if cert is not None else None
            credentials = grpc.ssl_channel_credentials(pki.ca_file.read_bytes(), key, chain)
            self.channel = grpc.aio.secure_channel(sched.agent_address, credentials, options)
        else:
            self.channel = grpc.aio.insecure_channel(sched.agent_address, options)
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.operations: list[agent_pb2.ModelOperation] = []
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self.ended: grpc.aio.AioRpcError | None = None

    async def subscribe(
        self, server: str = "sim", replica: int = 0, url: str = REAL_URL, memory: int = 1000
    ) -> None:
        """Subscribe and keep answering; returns once the scheduler has it (or raises its refusal)."""
        self.server, self.replica = server, replica
        request = agent_pb2.SubscribeRequest(
            server_name=server,
            replica_idx=replica,
            shared=True,
            replica_config=agent_pb2.ReplicaConfig(inference_url=url, memory_bytes=memory),
            available_memory_bytes=memory,
        )
        self._call = self.stub.Subscribe(request, metadata=self.metadata)
        self._task = asyncio.create_task(self._answer())
        # A refusal ends the call; a stream the scheduler keeps stays open and registers the replica.
        task = self._task
        for _ in range(500):
            if task.done():
                break
            held = self.sched.state.servers.get(server)
            replica_now = held.replicas.get(replica) if held is not None else None
            if replica_now is not None and replica_now.connected and replica_now.inference_url == url:
                return
            await asyncio.sleep(0.01)
        if self.ended is not None:
            raise self.ended
        assert not task.done(), "the stream ended without an error"

    async def _answer(self) -> None:
        try:
            async for operation in self._call:
                self.operations.append(operation)
                load = operation.operation == agent_pb2.ModelOperation.LOAD_MODEL
                await self.event(
                    operation.model_version.name,
                    agent_pb2.ModelEvent.LOADED if load else agent_pb2.ModelEvent.UNLOADED,
                    version=operation.model_version.version,
                )
        except grpc.aio.AioRpcError as error:
            self.ended = error

    async def event(
        self, model: str, kind: int, *, server: str = "", replica: int | None = None, version: int = 1
    ) -> None:
        await self.stub.AgentEvent(
            agent_pb2.ModelEvent(
                server_name=server or self.server,
                replica_idx=self.replica if replica is None else replica,
                model_name=model,
                model_version=version,
                event=kind,
                available_memory_bytes=900,
            ),
            metadata=self.metadata,
            timeout=5,
        )

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.channel.close()


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for agent in made:
        await agent.close()


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def rest(
    http: aiohttp.ClientSession, method: str, url: str, token: str | None = None, **kwargs: Any
) -> tuple[int, Any, Any]:
    headers = bearer(token) if token else {}
    async with http.request(method, url, headers=headers, **kwargs) as response:
        body = await response.read()
        return response.status, response.headers, orjson.loads(body) if body else None


async def model_state(sched: RunningScheduler, name: str = "iris") -> str:
    model = sched.state.models.get(name)
    return model.latest.status.state.value if model is not None else "absent"


async def placed(
    http: aiohttp.ClientSession, sched: RunningScheduler, ssl_context: Any = None, token: str = WRITE_TOKEN
) -> None:
    """iris applied and Available."""
    status, _, body = await rest(
        http, "PUT", f"{sched.url}/v1/models/iris", token, json=IRIS, ssl=ssl_context
    )
    assert status == 200, body

    async def available() -> bool:
        return await model_state(sched) == "ModelAvailable"

    await wait_until(available, attempts=500)


def endpoints(sched: RunningScheduler) -> list[Any]:
    return [e["url"] for e in sched.state.feed_snapshot()[0]["endpoints"]]


# --- REST: tokens, roles, client certificates ------------------------------------------------


async def test_rest_writes_need_a_write_credential(
    scheduler: Any, files: dict[str, str], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sched = await scheduler(tokens_file=files["tokens"])
    models = f"{sched.url}/v1/models"

    # The attack: PUT and DELETE with no credential at all.
    for method in ("PUT", "DELETE"):
        status, headers, body = await rest(http, method, f"{models}/iris", json=IRIS)
        assert status == 401 and headers["WWW-Authenticate"] == REALM
        assert (
            body["error"]["code"] == "missing_credentials" and body["error"]["type"] == "authentication_error"
        )
    status, headers, body = await rest(http, "PUT", f"{models}/iris", "not-a-token", json=IRIS)
    assert status == 401 and headers["WWW-Authenticate"] == REALM and body["error"]["code"] == "invalid_token"
    async with http.put(f"{models}/iris", json=IRIS, headers={"Authorization": f"Basic {WRITE_TOKEN}"}) as r:
        assert r.status == 401
    status, _, body = await rest(http, "PUT", f"{models}/iris", READ_TOKEN, json=IRIS)
    assert status == 403 and body["error"] == {
        "message": "PUT /v1/models/iris needs the role write; this credential has read",
        "type": "permission_error",
        "param": None,
        "code": "insufficient_role",
    }
    assert "iris" not in sched.state.models  # nothing refused changed anything

    # Reading needs read (or write); the probes stay open.
    for path in ("/v1/models", "/v1/servers", "/v1/models/iris", "/metrics"):
        status, headers, _ = await rest(http, "GET", sched.url + path)
        assert status == 401 and headers["WWW-Authenticate"] == REALM, path
    assert (await rest(http, "GET", models, READ_TOKEN))[0] == 200
    assert (await rest(http, "GET", f"{sched.url}/v1/servers", WRITE_TOKEN))[0] == 200
    async with http.get(f"{sched.url}/metrics", headers=bearer(READ_TOKEN)) as response:
        assert response.status == 200
    for path in ("/healthz", "/readyz"):
        assert (await rest(http, "GET", sched.url + path))[0] == 200
    async with http.get(f"{sched.url}/v1/feed") as response:
        assert response.status == 401
    async with http.get(f"{sched.url}/v1/feed", headers=bearer(READ_TOKEN)) as response:
        assert response.status == 200
        assert orjson.loads(await response.content.readline())["type"] == "snapshot"

    status, _, body = await rest(http, "PUT", f"{models}/iris", WRITE_TOKEN, json=IRIS)
    assert status == 200 and body["change"] == "created"
    assert (await rest(http, "DELETE", f"{models}/iris", READ_TOKEN))[0] == 403
    assert (await rest(http, "DELETE", f"{models}/iris", WRITE_TOKEN))[0] == 200

    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert READ_TOKEN not in logged and WRITE_TOKEN not in logged


def role_certificate(pki: Pki, *roles: str, name: str) -> Issued:
    """A REST client's certificate naming `roles` (URI SANs spiffe://modelyard/role/<role>)."""
    return issue_uri(pki, *(f"spiffe://modelyard/role/{role}" for role in roles), name=name)


async def test_rest_over_tls_takes_a_client_certificate_by_the_role_it_names(
    scheduler: Any, pki: Pki, tmp_path: Path, files: dict[str, str], http: aiohttp.ClientSession
) -> None:
    clients = Pki(tmp_path, "client-ca")
    sched = await scheduler(
        tls=tls(pki.issue(), client_ca_file=str(clients.ca_file)), tokens_file=files["tokens"]
    )
    assert sched.url.startswith("https://")
    url = f"{sched.url}/v1/models/iris"
    writer = pki.client_context(role_certificate(clients, "write", name="operator"))
    assert (await rest(http, "PUT", url, json=IRIS, ssl=writer))[0] == 200
    anonymous = pki.client_context()
    status, headers, _ = await rest(http, "DELETE", url, json=IRIS, ssl=anonymous)
    assert status == 401 and headers["WWW-Authenticate"] == REALM
    assert (await rest(http, "GET", url, READ_TOKEN, ssl=anonymous))[0] == 200  # a token still works
    # A certificate from another CA does not get through the handshake; plain HTTP gets no answer.
    stranger = pki.client_context(Pki(tmp_path, "other-ca").issue("mallory@example.com"))
    with pytest.raises(aiohttp.ClientError):
        await rest(http, "DELETE", url, ssl=stranger)
    with pytest.raises(aiohttp.ClientError):
        await rest(http, "DELETE", url.replace("https:", "http:"))
    assert await model_state(sched) != "absent"


async def test_an_agents_certificate_is_no_rest_credential_even_when_one_ca_signs_both(
    scheduler: Any, pki: Pki, tmp_path: Path, files: dict[str, str], http: aiohttp.ClientSession
) -> None:
    """The review's D2: every certificate the REST client CA signed had the role write, so with one
    CA for agents and REST clients (one cert-manager issuer) an agent's certificate applied and
    deleted models. A certificate's role now comes only from its URI SAN spiffe://modelyard/role/..."""
    one = Pki(tmp_path, "cluster-ca")
    sched = await scheduler(
        tls=tls(pki.issue(), client_ca_file=str(one.ca_file)),
        tokens_file=files["tokens"],
        agent_ca_file=str(one.ca_file),
    )
    models = f"{sched.url}/v1/models"
    url = f"{models}/iris"
    writer = pki.client_context(role_certificate(one, "write", name="ci-job"))
    assert (await rest(http, "PUT", url, json=IRIS, ssl=writer))[0] == 200

    # The attack: an agent's certificate (one replica's, a whole server's) writes. Refused, and a
    # write token sent beside it does not help: an agent's certificate is never a REST caller's.
    for cert in (agent_certificate(one, "sim", 0), agent_certificate(one, "sim")):
        agent = pki.client_context(cert)
        for method, path, token in (
            ("PUT", f"{models}/evil", None),
            ("DELETE", url, None),
            ("GET", models, None),
            ("DELETE", url, WRITE_TOKEN),
        ):
            status, _, body = await rest(http, method, path, token, json=IRIS, ssl=agent)
            assert status == 403, (cert.cert.name, method, path, body)
            assert body["error"]["type"] == "permission_error"
            assert "spiffe://modelyard/server/sim" in body["error"]["message"]
    assert sorted(sched.state.models) == ["iris"] and await model_state(sched) != "absent"
    assert not sched.state.models["iris"].deleted

    # A certificate that names no role (trustme's, an e-mail address; a URI of another kind or
    # domain) gives none: without a token 403, with one the token's role.
    for cert in (
        one.issue("operator@example.com"),
        issue_uri(one, "spiffe://modelyard/role/admin", "spiffe://other/role/write", name="no-role"),
    ):
        roleless = pki.client_context(cert)
        status, _, body = await rest(http, "DELETE", url, ssl=roleless)
        assert status == 403 and "spiffe://modelyard/role/write" in body["error"]["message"], body
        assert (await rest(http, "GET", models, READ_TOKEN, ssl=roleless))[0] == 200
        assert (await rest(http, "DELETE", url, READ_TOKEN, ssl=roleless))[0] == 403
    # role/read reads (the feed too) and may not write; role/write does both.
    reader = pki.client_context(role_certificate(one, "read", name="dashboard"))
    assert (await rest(http, "GET", models, ssl=reader))[0] == 200
    status, _, body = await rest(http, "DELETE", url, ssl=reader)
    assert status == 403 and body["error"]["code"] == "insufficient_role"
    # The gateway's feed client, showing a role/read certificate instead of its read token.
    cert = role_certificate(one, "read", name="gateway")
    feed = FeedClient(
        sched.url,
        connect_timeout=2.0,
        ping_timeout=10.0,
        tls=ClientTls(
            TlsClientConfig(ca_file=str(pki.ca_file), cert_file=str(cert.cert), key_file=str(cert.key))
        ),
    )
    events = feed.events()
    try:
        first = await anext(events)
        assert isinstance(first, Snapshot) and [m.name for m in first.models] == ["iris"]
    finally:
        await events.aclose()
        await feed.close()
    assert (await rest(http, "DELETE", url, ssl=writer))[0] == 200


# --- agents: who may connect, as whom -------------------------------------------------------


async def test_a_fake_agent_cannot_take_a_connected_replicas_slot(
    scheduler: Any,
    pki: Pki,
    agent_ca: Pki,
    files: dict[str, str],
    http: aiohttp.ClientSession,
    agents: list[Agent],
) -> None:
    sched = await scheduler(**secured(pki, agent_ca, files))
    real = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
    agents.append(real)
    await real.subscribe("sim", 0)
    await placed(http, sched, pki.client_context())
    assert endpoints(sched) == [REAL_URL]

    # No certificate: the handshake fails (the port requires one). Plain text: no answer either.
    for fake in (Agent(sched, pki), Agent(sched)):
        agents.append(fake)
        error = await refused(fake.subscribe("sim", 0, EVIL_URL))
        assert error.code() == Code.UNAVAILABLE
    # Signed by another CA (the server's, say): refused in the handshake too.
    fake = Agent(sched, pki, pki.issue(name="not-an-agent"))
    agents.append(fake)
    assert (await refused(fake.subscribe("sim", 0, EVIL_URL))).code() == Code.UNAVAILABLE
    # A real agent's certificate for another replica: not this one's slot.
    fake = Agent(sched, pki, agent_certificate(agent_ca, "sim", 1))
    agents.append(fake)
    error = await refused(fake.subscribe("sim", 0, EVIL_URL))
    assert error.code() == Code.PERMISSION_DENIED and "sim-0" in (error.details() or "")
    # Even the slot's own identity, from another connection: the connected agent keeps it.
    fake = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
    agents.append(fake)
    assert (await refused(fake.subscribe("sim", 0, EVIL_URL))).code() == Code.ALREADY_EXISTS
    assert endpoints(sched) == [REAL_URL]
    assert sched.state.servers["sim"].replicas[0].inference_url == REAL_URL

    # Once the real agent has gone, its replica's own certificate may take the slot again.
    await real.close()
    again = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
    agents.append(again)

    async def back() -> bool:
        try:
            await again.subscribe("sim", 0, "http://127.0.0.1:18082")  # its restart, say
        except grpc.aio.AioRpcError:
            return False
        return True

    await wait_until(back, attempts=100, interval=0.05)


async def test_without_credentials_on_loopback_a_second_connection_still_cannot_take_a_slot(
    scheduler: Any, http: aiohttp.ClientSession, agents: list[Agent]
) -> None:
    sched = await scheduler()
    real, fake = Agent(sched), Agent(sched)
    agents += [real, fake]
    await real.subscribe("sim", 0)
    await placed(http, sched)
    assert (await refused(fake.subscribe("sim", 0, EVIL_URL))).code() == Code.ALREADY_EXISTS
    assert endpoints(sched) == [REAL_URL]
    # The same connection may start its stream again (an agent re-subscribing).
    await real.subscribe("sim", 0)

    async def connected() -> bool:
        return "sim" in sched.state.servers and sched.state.servers["sim"].replicas[0].connected

    await wait_until(connected, attempts=200)


async def test_a_rogue_server_gets_no_model(
    scheduler: Any,
    pki: Pki,
    files: dict[str, str],
    http: aiohttp.ClientSession,
    agents: list[Agent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = await scheduler(
        tls=tls(pki.issue()),
        tokens_file=files["tokens"],
        agent_tokens_file=files["agent_tokens"],
        max_replica_memory="64Gi",
    )
    tebibyte = 2**40
    # No credential, a made-up token, and sim's own token used for another server: all refused.
    for token, code in ((None, Code.UNAUTHENTICATED), ("guess", Code.UNAUTHENTICATED), (JOIN_TOKEN, None)):
        rogue = Agent(sched, pki, token=token)
        agents.append(rogue)
        error = await refused(rogue.subscribe("rogue", 0, EVIL_URL, memory=tebibyte))
        assert error.code() == (code or Code.PERMISSION_DENIED), error.details()
    # sim's token, for sim, but claiming a tebibyte: over the scheduler's bound.
    greedy = Agent(sched, pki, token=JOIN_TOKEN)
    agents.append(greedy)
    error = await refused(greedy.subscribe("sim", 5, EVIL_URL, memory=tebibyte))
    assert error.code() == Code.INVALID_ARGUMENT and "--max-replica-memory" in (error.details() or "")
    assert "rogue" not in sched.state.servers and "sim" not in sched.state.servers

    # The join token lets an agent be any replica of its server, and nothing else.
    real = Agent(sched, pki, token=JOIN_TOKEN)
    agents.append(real)
    await real.subscribe("sim", 3)
    await placed(http, sched, pki.client_context())
    assert endpoints(sched) == [REAL_URL]
    assert [o.model_version.parameters["api_key"] for o in real.operations] == ["hunter2"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert JOIN_TOKEN not in logged and "guess" not in logged


async def test_spoofed_events_drains_and_lag_reports_are_refused(
    scheduler: Any,
    pki: Pki,
    agent_ca: Pki,
    files: dict[str, str],
    http: aiohttp.ClientSession,
    agents: list[Agent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "modelyard.rpc")
    sched = await scheduler(
        **secured(pki, agent_ca, files),
        scale_up_lag=1.0,
        scale_up_window=0.0,
        scaling_interval=0.05,
        stats_max_age=60,
    )
    real = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
    spare = Agent(sched, pki, agent_certificate(agent_ca, "sim", 1))  # room for a second replica
    agents += [real, spare]
    await real.subscribe("sim", 0)
    await spare.subscribe("sim", 1, "http://127.0.0.1:18081")
    status, _, body = await rest(
        http,
        "PUT",
        f"{sched.url}/v1/models/iris",
        WRITE_TOKEN,
        json={**IRIS, "min_replicas": 1, "max_replicas": 2},
        ssl=pki.client_context(),
    )
    assert status == 200, body

    async def available() -> bool:
        return await model_state(sched) == "ModelAvailable"

    await wait_until(available, attempts=500)
    (held,) = sched.state.models["iris"].latest.replicas
    other = 1 - held
    attacker = {0: spare, 1: real}[held]  # a real agent of the other replica, acting as this one

    # UNLOADED for the replica that serves iris, sent again and again: refused, logged once.
    for _ in range(5):
        error = await refused(attacker.event("iris", agent_pb2.ModelEvent.UNLOADED, replica=held))
        assert error.code() == Code.PERMISSION_DENIED
    lines = [r.getMessage() for r in caplog.records if "refused AgentEvent" in r.getMessage()]
    assert len(lines) == 1 and f"sim-{held}" in lines[0]
    # Without any credential it does not get through the handshake.
    anonymous = Agent(sched, pki)
    agents.append(anonymous)
    anonymous.server, anonymous.replica = "sim", held
    assert (await refused(anonymous.event("iris", agent_pb2.ModelEvent.UNLOADED))).code() == Code.UNAVAILABLE

    drain = agent_pb2.AgentDrainRequest(server_name="sim", replica_idx=held)
    error = await refused(attacker.stub.AgentDrain(drain, timeout=5))
    assert error.code() == Code.PERMISSION_DENIED
    lag = agent_pb2.AgentStatsRequest(
        server_name="sim",
        replica_idx=held,
        models=[agent_pb2.ModelStats(name="iris", version=1, in_flight=500, queued=500)],
    )
    error = await refused(attacker.stub.AgentStats(lag, timeout=5))
    assert error.code() == Code.PERMISSION_DENIED

    await asyncio.sleep(0.5)  # ten scaling decisions
    model = sched.state.models["iris"]
    assert await model_state(sched) == "ModelAvailable"
    assert list(model.latest.replicas) == [held] and model.latest.spec.replicas in (None, 1)
    assert endpoints(sched) == [REAL_URL if held == 0 else "http://127.0.0.1:18081"]
    assert not sched.state.servers["sim"].replicas[held].draining
    # The agent of `other` may still speak for itself.
    await attacker.stub.AgentStats(
        agent_pb2.AgentStatsRequest(server_name="sim", replica_idx=other), timeout=5
    )


@pytest.mark.parametrize("credential", ["join token", "server-wide certificate"])
async def test_a_sibling_holding_the_same_servers_credential_cannot_act_for_a_connected_replica(
    credential: str,
    scheduler: Any,
    pki: Pki,
    agent_ca: Pki,
    files: dict[str, str],
    http: aiohttp.ClientSession,
    agents: list[Agent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The review's D12: with one credential for every replica of a server (a join token, or a
    certificate naming spiffe://modelyard/server/sim: what a pod template can carry), another pod of
    the server sent UNLOADED for sim-0 from its own connection (iris went ModelProgressing, its
    endpoints empty, while sim-0's agent still served it) and drained sim-0. Calls for a replica are
    taken only over the connection whose Subscribe holds its slot."""
    caplog.set_level(logging.WARNING, "modelyard.rpc")
    settings: dict[str, Any] = {"tls": tls(pki.issue()), "tokens_file": files["tokens"]}
    if credential == "join token":
        settings["agent_tokens_file"] = files["agent_tokens"]

        def pod() -> Agent:
            return Agent(sched, pki, token=JOIN_TOKEN)
    else:
        settings["agent_ca_file"] = str(agent_ca.ca_file)
        server_wide = agent_certificate(agent_ca, "sim")

        def pod() -> Agent:
            return Agent(sched, pki, server_wide)

    sched = await scheduler(**settings, scale_up_lag=1.0, scale_up_window=0.0, scaling_interval=0.05)
    real = pod()
    agents.append(real)
    await real.subscribe("sim", 0)
    await placed(http, sched, pki.client_context())
    sibling = pod()  # another pod of server sim, connected in its own slot
    agents.append(sibling)
    await sibling.subscribe("sim", 1, "http://127.0.0.1:18081")
    loner = pod()  # the same credential, no subscription at all
    agents.append(loner)

    for attacker in (sibling, loner):
        for _ in range(3):
            error = await refused(
                attacker.event("iris", agent_pb2.ModelEvent.UNLOADED, server="sim", replica=0)
            )
            assert error.code() == Code.PERMISSION_DENIED, error.details()
            assert "sim-0" in (error.details() or "") and "connection" in (error.details() or "")
        drain = agent_pb2.AgentDrainRequest(server_name="sim", replica_idx=0)
        error = await refused(attacker.stub.AgentDrain(drain, metadata=attacker.metadata, timeout=5))
        assert error.code() == Code.PERMISSION_DENIED
        lag = agent_pb2.AgentStatsRequest(
            server_name="sim",
            replica_idx=0,
            models=[agent_pb2.ModelStats(name="iris", version=1, in_flight=500, queued=500)],
        )
        error = await refused(attacker.stub.AgentStats(lag, metadata=attacker.metadata, timeout=5))
        assert error.code() == Code.PERMISSION_DENIED
    # A replica no agent holds: nothing to act on, and no state touched.
    error = await refused(loner.event("iris", agent_pb2.ModelEvent.UNLOADED, server="sim", replica=5))
    assert error.code() == Code.NOT_FOUND

    await asyncio.sleep(0.3)  # six scaling decisions: a spoofed lag report would have scaled iris
    model = sched.state.models["iris"]
    assert await model_state(sched) == "ModelAvailable" and list(model.latest.replicas) == [0]
    assert endpoints(sched) == [REAL_URL]
    assert not sched.state.servers["sim"].replicas[0].draining
    # Logged once per peer and call, never per attempt.
    lines = [r.getMessage() for r in caplog.records if "refused AgentEvent" in r.getMessage()]
    assert len(lines) == 1 and "sim-0" in lines[0], lines
    # Each agent still speaks for its own replica over its own connection.
    for agent, replica in ((real, 0), (sibling, 1)):
        stats = agent_pb2.AgentStatsRequest(server_name="sim", replica_idx=replica)
        await agent.stub.AgentStats(stats, metadata=agent.metadata, timeout=5)
    await real.event("iris", agent_pb2.ModelEvent.LOADED)  # a repeat: a no-op, but accepted
    if credential != "join token":
        # A certificate naming that very replica is its own: taken from any connection.
        exact = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
        agents.append(exact)
        stats = agent_pb2.AgentStatsRequest(server_name="sim", replica_idx=0)
        await exact.stub.AgentStats(stats, timeout=5)


async def test_a_certificate_without_an_agent_identity_is_refused(
    scheduler: Any, pki: Pki, agent_ca: Pki, files: dict[str, str], agents: list[Agent]
) -> None:
    sched = await scheduler(**secured(pki, agent_ca, files))
    for cert in (
        issue_uri(agent_ca, name="no-san"),
        issue_uri(agent_ca, "spiffe://elsewhere/server/sim/replica/0", name="other-domain"),
    ):
        agent = Agent(sched, pki, cert)
        agents.append(agent)
        error = await refused(agent.subscribe("sim", 0))
        assert error.code() == Code.UNAUTHENTICATED and "spiffe://modelyard/server/" in (
            error.details() or ""
        )
    # A server-wide certificate acts as any replica of its server.
    agent = Agent(sched, pki, agent_certificate(agent_ca, "sim"))
    agents.append(agent)
    await agent.subscribe("sim", 7)
    assert sched.state.servers["sim"].replicas[7].connected


def rewrite(path: str, text: str) -> None:
    Path(path).write_text(text)


async def test_open_feeds_and_subscriptions_end_once_their_token_is_removed(
    scheduler: Any, pki: Pki, files: dict[str, str], http: aiohttp.ClientSession, agents: list[Agent]
) -> None:
    """A token removed from its file (a leaked one, rotated away) stopped new calls but left the
    feeds and agent subscriptions it had opened running for as long as their connections lasted."""
    sched = await scheduler(
        tls=tls(pki.issue()),
        tokens_file=files["tokens"],
        agent_tokens_file=files["agent_tokens"],
        credential_recheck=0.2,
        feed_ping_interval=0.2,
    )
    client = pki.client_context()
    agent = Agent(sched, pki, token=JOIN_TOKEN)
    agents.append(agent)
    await agent.subscribe("sim", 0)
    async with http.get(f"{sched.url}/v1/feed", headers=bearer(READ_TOKEN), ssl=client) as feed:
        assert feed.status == 200
        assert orjson.loads(await feed.content.readline())["type"] == "snapshot"
        # Both tokens rotated away: the files now hold other tokens only.
        rewrite(files["tokens"], f"write {WRITE_TOKEN}\nread r-rotated-0123456789abcdef\n")
        rewrite(files["agent_tokens"], "sim j-rotated-0123456789abcdef\n")
        async with asyncio.timeout(5):  # about one recheck (0.2 s) and one ping after it
            while (line := await feed.content.readline()) != b"":
                assert orjson.loads(line)["type"] in ("ping", "model"), line

    async def ended() -> bool:
        return agent.ended is not None

    await wait_until(ended, attempts=500)
    assert agent.ended is not None and agent.ended.code() == Code.UNAUTHENTICATED
    assert "token" in (agent.ended.details() or "")

    async def gone() -> bool:
        server = sched.state.servers.get("sim")
        return server is None or 0 not in server.replicas

    await wait_until(gone, attempts=500)
    # The old tokens open nothing new either; the write token still works.
    again = Agent(sched, pki, token=JOIN_TOKEN)
    agents.append(again)
    assert (await refused(again.subscribe("sim", 0))).code() == Code.UNAUTHENTICATED
    assert (await rest(http, "GET", f"{sched.url}/v1/feed", READ_TOKEN, ssl=client))[0] == 401
    assert (await rest(http, "GET", f"{sched.url}/v1/models", WRITE_TOKEN, ssl=client))[0] == 200


# Enough to show they are dropped, not counted: each is two descriptors here (both ends live in the
# test's process), and a machine's default limit may be 1,024.
SILENT_CONNECTIONS = 400


def still_open(held: list[socket.socket]) -> list[socket.socket]:
    """The sockets the far end has not closed (non-blocking: nothing to read yet)."""
    left = []
    for sock in held:
        try:
            while sock.recv(4096):
                pass  # what the server says first (a plain port's HTTP/2 settings), if anything
        except BlockingIOError:
            left.append(sock)
        except OSError:
            pass  # reset: closed
    return left


async def test_silent_connections_to_the_agent_port_are_dropped_after_the_handshake_timeout(
    scheduler: Any, pki: Pki, agent_ca: Pki, files: dict[str, str]
) -> None:
    """The review's D10: a connection that never starts its TLS handshake was held for gRPC's
    default 120 s, so anyone reaching the agent port could hold thousands of them. Now 10 s."""
    sched = await scheduler(**secured(pki, agent_ca, files))

    def connect() -> list[socket.socket]:
        made = []
        for _ in range(SILENT_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", sched.agent_port), timeout=5)
            sock.setblocking(False)
            made.append(sock)
        return made

    held = await asyncio.to_thread(connect)
    opened = time.monotonic()
    try:
        await asyncio.sleep(2.0)
        assert len(still_open(held)) == SILENT_CONNECTIONS  # not before the timeout
        left = held
        while left and time.monotonic() - opened < 20.0:
            await asyncio.sleep(0.5)
            left = still_open(left)
        took = time.monotonic() - opened
        assert not left, f"{len(left)} of {SILENT_CONNECTIONS} still open after {took:.1f}s"
        assert 9.0 < took < 16.0, took
        # The port still serves an agent that speaks.
        agent = Agent(sched, pki, agent_certificate(agent_ca, "sim", 0))
        try:
            await agent.subscribe("sim", 0)
        finally:
            await agent.close()
    finally:
        for sock in held:
            sock.close()


# --- plain text only on loopback -------------------------------------------------------------


async def test_a_scheduler_reachable_from_elsewhere_needs_tls_and_credentials(
    scheduler: Any, pki: Pki, agent_ca: Pki, files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError) as caught:
        await scheduler(host="0.0.0.0")
    assert caught.value.source == "--host 0.0.0.0"
    (problem,) = caught.value.problems
    for missing in ("TLS (--tls-cert, --tls-key)", "--tokens-file or --tls-client-ca", "--agent-ca"):
        assert missing in problem
    assert "--insecure" in problem
    with pytest.raises(ConfigError, match="no agent credentials"):
        await scheduler(host="0.0.0.0", tls=tls(pki.issue()), tokens_file=files["tokens"])
    with pytest.raises(ConfigError, match="there is no TLS"):
        await scheduler(host="0.0.0.0", tokens_file=files["tokens"], agent_tokens_file=files["agent_tokens"])

    secure = await scheduler(host="0.0.0.0", **secured(pki, agent_ca, files))
    assert secure.url.startswith("https://")
    caplog.set_level(logging.WARNING, "modelyard.scheduler")
    await scheduler(host="0.0.0.0", insecure=True)
    (warning,) = [r.getMessage() for r in caplog.records if "--insecure" in r.getMessage()]
    assert "0.0.0.0" in warning and "without TLS" in warning
