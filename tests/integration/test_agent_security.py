"""The agent's side of a control plane only its own components can drive (issue 28 item 3): its data
plane forwards inference requests only, serves TLS; it reaches a real scheduler over TLS with a
client certificate (mutual TLS) or a join token, acts only as what its credential names, and never
logs the token. Real certificates (trustme, URI SANs made with cryptography), real handshakes, a real
scheduler and sim-worker in-process."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent_identities import agent_certificate
from certificates import Issued, Pki
from fake_agent_scheduler import OIP_BODY, Event, model_source
from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.config import TlsClientConfig
from modelyard.rpc.agent_v1 import agent_pb2
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from raw_http import request, send
from support import metric_value, wait_until

JOIN_TOKEN = "j-7d1e4a9c2f6b8e3a0c5d"
IRIS = {"storage_uri": "file:///models/iris", "memory": 100}
LOAD = agent_pb2.ModelOperation.LOAD_MODEL


# --- the data plane forwards inference requests only -------------------------------------------

# What the probe sent to the agent's data-plane port, and what else would reach the server's
# repository or admin API through it: each must be answered by the agent, never forwarded.
NOT_FORWARDED = [
    ("POST", "/v2/repository/models/iris/unload"),  # the probe's: it unloaded the model
    ("POST", "/v2/repository/models/iris/load"),
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/models/iris/../../repository/models/iris/unload"),  # dot segments, raw
    ("POST", "/v2/models/iris/%2E%2E/%2E%2E/repository/models/iris/unload"),
    ("POST", "/v2/models/..%2F..%2Frepository%2Fmodels%2Firis/unload"),  # an encoded slash
    ("POST", "/v2/models/iris%2F..%2F..%2Frepository%2Fmodels%2Firis%2Funload/infer"),
    ("POST", "/v2//repository/models/iris/unload"),
    ("POST", "/v2/models/iris/unload"),  # not an inference verb
    ("POST", "/v1/models/iris:unload"),
    ("GET", "/v2/models/iris/infer"),  # the right path, the wrong method
    ("DELETE", "/v2/models/iris"),
    ("GET", "/sim/repository"),  # the sim-worker's own admin paths
    ("PUT", "/sim/config"),
    ("GET", "/sim/stats"),
    ("POST", "/v2/systemsharedmemory/region/x/register"),  # Triton's
    ("POST", "/v2/logging"),
    ("POST", "/v2/trace/setting"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
]


async def resident(http: aiohttp.ClientSession, worker: Any) -> dict[str, int]:
    async with http.get(worker.url + "/sim/repository") as response:
        return dict((await response.json())["loaded"])


async def test_the_servers_repository_and_admin_paths_are_not_reachable_through_the_data_plane(
    setup: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fake, agent, worker = await setup()
    source = model_source(tmp_path, memory_bytes=100)
    fake.send(LOAD, "iris", storage_uri=str(source), memory_bytes=100)
    await fake.event("iris", Event.LOADED)
    body = b'{"parameters": {}}'
    for method, path in NOT_FORWARDED:
        reply = await send(agent.url, request(method, path, body if method in ("POST", "PUT") else b""))
        assert reply.status == 404, (method, path, reply.body)
        envelope = reply.json()["error"]
        message = envelope if isinstance(envelope, str) else envelope["message"]  # OIP / OpenAI shape
        assert "not an inference path" in message, (method, path, message)
    assert await resident(http, worker) == {"iris": 100}  # still loaded: nothing reached the server
    async with http.get(worker.url + "/metrics") as response:
        assert 'modelyard_sim_model_loads_total{model="iris"} 1.0' in await response.text()

    # A model the server has but the agent did not load (the user's own, or kept at start).
    shutil.copytree(model_source(tmp_path, "other"), agent.config.repository / "other")
    async with http.post(worker.url + "/v2/repository/models/other/load", json={}) as response:
        assert response.status == 200
    async with http.post(f"{agent.url}/v2/models/other/infer", json=OIP_BODY) as response:
        assert response.status == 404
        assert (await response.json())["error"] == "model 'other' is not served by this replica"
    chat = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat) as response:
        error = (await response.json())["error"]
        assert response.status == 404 and error["code"] == "not_forwarded"  # OpenAI's envelope

    # Inference, metadata and health still pass, in every protocol.
    async with http.post(f"{agent.url}/v2/models/iris/infer", json=OIP_BODY) as response:
        assert response.status == 200
    async with http.post(f"{agent.url}/v2/models/iris/versions/1/infer", json=OIP_BODY) as response:
        assert response.status in (200, 404)  # the server's answer about the version, forwarded
    for path in ("/v2/models/iris", "/v2/models/iris/ready", "/v2", "/v2/health/live", "/v1/models/iris"):
        async with http.get(agent.url + path) as response:
            assert response.status == 200, path
    async with http.post(f"{agent.url}/v1/models/iris:predict", json={"instances": [[1.0]]}) as response:
        assert response.status == 200
    chat["model"] = "iris"
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat) as response:
        assert response.status == 200
    refused = await metric_value(http, agent.url, "modelyard_agent_requests_total", model="", code="404")
    assert refused == len(NOT_FORWARDED) + 2


async def test_the_data_plane_serves_tls_and_may_require_client_certificates(
    setup: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    pki = Pki(tmp_path, "data-plane")
    served, gateway = pki.issue(), pki.issue(name="gateway")
    tls = {"cert_file": str(served.cert), "key_file": str(served.key), "client_ca_file": str(pki.ca_file)}
    fake, agent, _worker = await setup(tls=tls)
    assert agent.url.startswith("https://127.0.0.1:")
    assert fake.subscribes[0].replica_config.inference_url == agent.url  # where gateways send requests
    fake.send(LOAD, "iris", storage_uri=str(model_source(tmp_path, memory_bytes=100)), memory_bytes=100)
    await fake.event("iris", Event.LOADED)
    async with http.post(
        f"{agent.url}/v2/models/iris/infer", json=OIP_BODY, ssl=pki.client_context(gateway)
    ) as response:
        assert response.status == 200
    with pytest.raises(aiohttp.ClientError):  # no client certificate: the handshake fails
        async with http.post(f"{agent.url}/v2/models/iris/infer", json=OIP_BODY, ssl=pki.client_context()):
            pass
    with pytest.raises(aiohttp.ClientError):  # plain text to the TLS port
        async with http.post(agent.url.replace("https:", "http:") + "/v2/models/iris/infer", json=OIP_BODY):
            pass


# --- to the scheduler: TLS, mutual TLS, join tokens ----------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "server-ca")


@pytest.fixture
def agent_ca(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "agent-ca")


@pytest.fixture
async def schedulers() -> AsyncIterator[Any]:
    """`await schedulers(**config)`: a real scheduler in-process (the `scheduler` fixture is the fake's)."""
    started: list[RunningScheduler] = []

    async def start(**overrides: Any) -> RunningScheduler:
        settings = {"port": 0, "agent_port": 0, "db": ":memory:", "retry_interval": 60, **overrides}
        running = await start_scheduler(SchedulerConfig(**settings))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


@pytest.fixture
async def agents() -> AsyncIterator[Any]:
    """`await agents(sched, worker, **config)`: a started agent of server sim, replica 0 by default."""
    started: list[Agent] = []

    async def start(sched: RunningScheduler, worker: Any, **overrides: Any) -> Agent:
        settings = {
            "scheduler": sched.agent_address,
            "server_name": "sim",
            "inference_url": worker.url,
            "memory_bytes": 1000,
            "unload_grace": 0.0,
            "reconnect_backoff": 0.05,
            "reconnect_backoff_max": 0.2,
            "connect_timeout": 0.5,
            **overrides,
        }
        agent = await start_agent(AgentConfig(**settings))
        started.append(agent)
        return agent

    yield start
    for agent in started:
        await agent.stop()


def server_tls(issued: Issued, **fields: Any) -> dict[str, Any]:
    return {"cert_file": str(issued.cert), "key_file": str(issued.key), **fields}


def to_scheduler(pki: Pki, cert: Issued | None = None, **fields: Any) -> TlsClientConfig:
    """The agent's TLS to a scheduler whose certificate `pki` signed, showing `cert` if given."""
    client = {"cert_file": str(cert.cert), "key_file": str(cert.key)} if cert is not None else {}
    return TlsClientConfig(ca_file=str(pki.ca_file), **client, **fields)


def connected(sched: RunningScheduler, replica: int = 0) -> bool:
    server = sched.state.servers.get("sim")
    return server is not None and replica in server.replicas and server.replicas[replica].connected


async def until(check: Any, what: str, attempts: int = 1000) -> None:
    async def ready() -> bool:
        return bool(check())

    try:
        await wait_until(ready, attempts=attempts)
    except AssertionError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def apply_and_wait(http: aiohttp.ClientSession, sched: RunningScheduler, pki: Pki) -> None:
    """iris placed on the agent, loaded and reported: every call of the agent passed admission."""
    async with http.put(f"{sched.url}/v1/models/iris", json=IRIS, ssl=pki.client_context()) as response:
        assert response.status == 200, await response.text()

    def available() -> bool:
        model = sched.state.models.get("iris")
        return model is not None and model.latest.status.state.value == "ModelAvailable"

    await until(available, "iris available")


def rotate(files: Issued, new: Issued) -> None:
    """`new`'s certificate and key written into `files`, as a rotation does."""
    files.cert.write_bytes(new.cert.read_bytes())
    files.key.write_bytes(new.key.read_bytes())


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


async def test_an_agent_connects_over_mutual_tls_and_serves_what_it_is_given(
    schedulers: Any, agents: Any, sim_workers: Any, pki: Pki, agent_ca: Pki, http: aiohttp.ClientSession
) -> None:
    sched = await schedulers(tls=server_tls(pki.issue()), agent_ca_file=str(agent_ca.ca_file))
    (worker,) = await sim_workers(1, repository_api=True)
    agent = await agents(
        sched, worker, scheduler_tls=to_scheduler(pki, agent_certificate(agent_ca, "sim", 0))
    )
    await until(lambda: connected(sched), "the agent subscribed over mutual TLS")
    await apply_and_wait(http, sched, pki)
    async with http.post(f"{agent.url}/v2/models/iris/infer", json=OIP_BODY) as response:
        assert response.status == 200


async def test_the_scheduler_address_may_be_an_ip_with_the_name_to_verify_given(
    schedulers: Any, agents: Any, sim_workers: Any, pki: Pki, agent_ca: Pki
) -> None:
    """--scheduler-name: a certificate for scheduler.internal only, reached at 127.0.0.1."""
    sched = await schedulers(
        tls=server_tls(pki.issue("scheduler.internal")), agent_ca_file=str(agent_ca.ca_file)
    )
    (worker,) = await sim_workers(1, repository_api=True)
    cert = agent_certificate(agent_ca, "sim", 0)
    await agents(sched, worker, scheduler_tls=to_scheduler(pki, cert, server_name="scheduler.internal"))
    await until(lambda: connected(sched), "the agent subscribed, verifying scheduler.internal")


async def test_an_agent_acts_only_as_the_replica_its_certificate_names_and_a_rotated_one_is_used(
    schedulers: Any,
    agents: Any,
    sim_workers: Any,
    pki: Pki,
    agent_ca: Pki,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    sched = await schedulers(tls=server_tls(pki.issue()), agent_ca_file=str(agent_ca.ca_file))
    (worker,) = await sim_workers(1, repository_api=True)
    # Its files hold a certificate for replica 1 while it says it is replica 0.
    other = agent_certificate(agent_ca, "sim", 1)
    agent = await agents(sched, worker, scheduler_tls=to_scheduler(pki, other))
    await asyncio.sleep(1.0)  # a few attempts, each refused
    assert not connected(sched) and agent.subscriptions >= 2
    refusals = warnings_with(caplog, "PERMISSION_DENIED")
    assert len(refusals) == 1, refusals  # logged once, not once per attempt
    assert "sim-0" in refusals[0] and "sim-1" in refusals[0]

    # cert-manager writes the right certificate into the same files: the next attempt uses it.
    rotate(other, agent_certificate(agent_ca, "sim", 0))
    await until(lambda: connected(sched), "the agent subscribed with the rotated certificate")
    assert any("TLS files for the scheduler" in r.getMessage() for r in caplog.records)
    await asyncio.sleep(1.2)  # the stream stays: the streak of refusals is over
    assert any("again after" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", ["no client certificate", "scheduler not verified", "wrong name"])
async def test_a_failed_handshake_is_one_clear_line_and_the_agent_keeps_trying(
    schedulers: Any,
    agents: Any,
    sim_workers: Any,
    pki: Pki,
    agent_ca: Pki,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    case: str,
) -> None:
    sched = await schedulers(tls=server_tls(pki.issue()), agent_ca_file=str(agent_ca.ca_file))
    (worker,) = await sim_workers(1, repository_api=True)
    cert = agent_certificate(agent_ca, "sim", 0)
    tls = {
        "no client certificate": to_scheduler(pki),
        "scheduler not verified": to_scheduler(Pki(tmp_path, "elsewhere"), cert),
        "wrong name": to_scheduler(pki, cert, server_name="scheduler.elsewhere"),
    }[case]
    agent = await agents(sched, worker, scheduler_tls=tls, connect_timeout=0.2)
    await asyncio.sleep(1.5)
    assert not connected(sched) and agent.subscriptions == 0
    (failure,) = warnings_with(caplog, "subscription to")  # once, not once per attempt
    assert f"scheduler {sched.agent_address} not reachable within 0.2s: " in failure
    said = {
        "no client certificate": "wants a client certificate: --cert, --key",
        "scheduler not verified": "TLS handshake failed: certificate verify failed: unable to get local",
        "wrong name": "TLS handshake failed: Custom verification check failed with error: UNAUTHENTICATED: "
        "Hostname Verification Check failed",
    }[case]
    assert said in failure


async def test_a_join_token_is_sent_with_every_call_and_never_logged(
    schedulers: Any,
    agents: Any,
    sim_workers: Any,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    tokens = tmp_path / "agent-tokens"
    tokens.write_text(f"sim {JOIN_TOKEN}\n")
    sched = await schedulers(tls=server_tls(pki.issue()), agent_tokens_file=str(tokens))
    (worker,) = await sim_workers(1, repository_api=True)
    token_file = tmp_path / "join-token"
    token_file.write_text(JOIN_TOKEN + "\n")
    agent = await agents(
        sched, worker, scheduler_tls=to_scheduler(pki), scheduler_token_file=token_file, stats_interval=0.05
    )
    await until(lambda: connected(sched), "the agent subscribed with its token")
    await apply_and_wait(http, sched, pki)  # its events carry the token too
    async with http.post(f"{agent.url}/v2/models/iris/infer", json=OIP_BODY) as response:
        assert response.status == 200
    await asyncio.sleep(0.2)  # usage reports, accepted
    assert not warnings_with(caplog, "usage report")

    # The same token in the environment's way (a SecretStr in the config); a wrong one is refused.
    env_agent = await agents(
        sched, worker, replica_idx=1, scheduler_tls=to_scheduler(pki), scheduler_token=JOIN_TOKEN
    )
    await until(lambda: connected(sched, 1), "the second agent subscribed")
    wrong = "j-not-the-token-0000"
    await agents(sched, worker, replica_idx=2, scheduler_tls=to_scheduler(pki), scheduler_token=wrong)
    await asyncio.sleep(0.8)
    assert not connected(sched, 2)
    (refused,) = warnings_with(caplog, "UNAUTHENTICATED")
    assert "join token is not one the scheduler knows" in refused

    assert JOIN_TOKEN not in repr(env_agent.config) and JOIN_TOKEN not in str(env_agent.config)
    for record in caplog.records:
        for text in (record.getMessage(), str(record.args), str(record.exc_info)):
            assert JOIN_TOKEN not in text and wrong not in text, record.getMessage()


async def test_an_agent_refused_a_connected_replicas_slot_keeps_trying_without_taking_it(
    schedulers: Any,
    agents: Any,
    sim_workers: Any,
    pki: Pki,
    agent_ca: Pki,
    caplog: pytest.LogCaptureFixture,
    http: aiohttp.ClientSession,
) -> None:
    sched = await schedulers(tls=server_tls(pki.issue()), agent_ca_file=str(agent_ca.ca_file))
    (worker,) = await sim_workers(1, repository_api=True)
    cert = agent_certificate(agent_ca, "sim", 0)
    real = await agents(sched, worker, scheduler_tls=to_scheduler(pki, cert))
    await until(lambda: connected(sched), "the real agent subscribed")
    second = await agents(sched, worker, scheduler_tls=to_scheduler(pki, cert))
    await asyncio.sleep(0.8)
    assert second.subscriptions >= 1 and not second.subscribed
    (refused,) = warnings_with(caplog, "ALREADY_EXISTS")
    assert "subscription to" in refused
    assert sched.state.servers["sim"].replicas[0].inference_url == real.url
    await apply_and_wait(http, sched, pki)  # the real agent is the one that serves


def test_an_unreadable_token_or_certificate_is_refused_at_construction(pki: Pki, tmp_path: Path) -> None:
    """In the library as on the command line: one problem, naming the file."""
    from modelyard.errors import ConfigError

    base = {"scheduler": "127.0.0.1:9005", "server_name": "sim", "inference_url": "http://127.0.0.1:1"}
    for settings, named in (
        ({"scheduler_token_file": tmp_path / "none"}, tmp_path / "none"),
        ({"scheduler_tls": TlsClientConfig(ca_file=str(tmp_path / "no-ca"))}, tmp_path / "no-ca"),
        ({"tls": server_tls(pki.expired())}, None),
    ):
        with pytest.raises(ConfigError) as caught:
            Agent(AgentConfig(**base, **settings))
        assert len(caught.value.problems) == 1
        if named is not None:
            assert caught.value.source == str(named)
        else:
            assert "expired" in caught.value.problems[0]
    with pytest.raises(ConfigError, match="--insecure"):  # plain text on every address
        Agent(AgentConfig(**base, host="0.0.0.0"))


async def test_with_insecure_an_agent_others_can_reach_starts_and_warns_once(
    setup: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, "modelyard.agent")
    fake, agent, _worker = await setup(host="0.0.0.0", insecure=True)
    (warning,) = [r.getMessage() for r in caplog.records if "--insecure" in r.getMessage()]
    assert "its data plane listens on 0.0.0.0 without TLS" in warning
    fake.send(LOAD, "iris", storage_uri=str(model_source(tmp_path, memory_bytes=100)), memory_bytes=100)
    await fake.event("iris", Event.LOADED)
    port = agent.url.rsplit(":", 1)[1]
    async with http.post(f"http://127.0.0.1:{port}/v2/models/iris/infer", json=OIP_BODY) as response:
        assert response.status == 200
    assert len([r for r in caplog.records if "--insecure" in r.getMessage()]) == 1


async def test_a_gateway_reaches_placed_models_through_an_agent_over_mutual_tls_end_to_end(
    schedulers: Any,
    agents: Any,
    sim_workers: Any,
    gateways: Any,
    pki: Pki,
    agent_ca: Pki,
    http: aiohttp.ClientSession,
) -> None:
    """Every hop over TLS: the gateway verifies the agent's data plane (upstream.tls) and shows its
    own certificate, the agent shows its identity to the scheduler, which is TLS as well."""
    served = pki.issue()
    sched = await schedulers(tls=server_tls(served), agent_ca_file=str(agent_ca.ca_file))
    (worker,) = await sim_workers(1, repository_api=True)
    data_plane, gateway_cert = pki.issue(name="data-plane"), pki.issue(name="gateway-client")
    tls = server_tls(data_plane, client_ca_file=str(pki.ca_file))
    cert = agent_certificate(agent_ca, "sim", 0)
    agent = await agents(sched, worker, scheduler_tls=to_scheduler(pki, cert), tls=tls)
    assert agent.url.startswith("https://")
    await until(lambda: connected(sched), "the agent subscribed")
    await apply_and_wait(http, sched, pki)
    gateway = await gateways(
        [],
        placement={
            "scheduler": sched.url,
            "tls": {"ca_file": str(pki.ca_file)},
            "models": {"health_check": {"interval": "60s"}},
        },
        upstream={
            "tls": {
                "ca_file": str(pki.ca_file),
                "cert_file": str(gateway_cert.cert),
                "key_file": str(gateway_cert.key),
            }
        },
    )

    async def served_through_the_agent() -> bool:
        async with http.post(f"{gateway.url}/v2/models/iris/infer", json=OIP_BODY) as response:
            return response.status == 200

    await wait_until(served_through_the_agent, attempts=1000)  # its one endpoint: the agent's https URL
    counted = agent.metrics.registry.get_sample_value(
        "modelyard_agent_requests_total", {"model": "iris", "code": "200"}
    )
    assert counted is not None and counted >= 1
