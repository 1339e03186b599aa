"""`modelyard agent` and the sim-worker's repository flags as a user runs them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import grpc

from certificates import Pki
from fake_agent_scheduler import FakeScheduler
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from support import free_ports, run_modelyard, wait_until


def modelyard(*args: str) -> subprocess.CompletedProcess[str]:
    return run_modelyard(*args)


def test_bad_agent_flags_print_one_line_and_exit_1():
    result = modelyard(
        "agent", "--scheduler", "nohost", "--server", "s", "--inference-url", "ftp://x", "--memory", "1Zi"
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--scheduler: expected host:port" in lines[0]
    assert "--inference-url: expected an http://" in lines[0]
    assert "--memory: expected bytes or a quantity like 100Ki or 1Gi, got '1Zi'" in lines[0]


def test_an_unreadable_labels_file_prints_one_line_and_exits_1(tmp_path):
    base = [
        "agent",
        "--scheduler",
        "h:1",
        "--server",
        "s",
        "--inference-url",
        "http://h:2",
        "--memory",
        "1Ki",
    ]
    result = modelyard(*base, "--capabilities-from", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: agent options: --capabilities-from: {tmp_path / 'nope'}: No such file or directory"
    )
    bad = tmp_path / "labels"
    bad.write_text("not a label line\n")
    result = modelyard(*base, "--capabilities-from", str(bad))
    assert result.returncode == 1
    assert "--capabilities-from: " + str(bad) + ": line 1: expected key=" in result.stderr


def test_bad_fetch_flags_print_one_line_and_exit_1(tmp_path):
    base = [
        "agent",
        "--scheduler",
        "h:1",
        "--server",
        "s",
        "--inference-url",
        "http://h:2",
        "--memory",
        "1Ki",
    ]
    result = modelyard(*base, "--fetch-network", "10.0.0.1/8", "--max-artefact-bytes", "lots")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "--fetch-network: '10.0.0.1/8': 10.0.0.1/8 has host bits set" in line
    assert "--max-artefact-bytes: expected bytes or a quantity" in line
    result = modelyard(*base, "--fetch-bearer-token", "files.example")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: agent options: --fetch-bearer-token: expected HOST=FILE, got 'files.example'"
    )
    result = modelyard(*base, "--fetch-basic-auth", f"files.example={tmp_path / 'nope'}")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: agent options: credential for files.example: {tmp_path / 'nope'}: no such file"
    )


def test_bad_sim_worker_memory_prints_one_line_and_exits_1():
    result = modelyard("sim-worker", "--repository-api", "--memory", "lots")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: sim-worker options: --memory: expected bytes or a quantity like 100Ki or 1Gi, got 'lots'"
    ]


async def test_an_agent_port_in_use_is_named_with_what_it_is_for(sim_workers):
    (server,) = await sim_workers(1, repository_api=True)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "modelyard", "agent", "--scheduler", "127.0.0.1:1", "--server", "s",
            "--inference-url", server.url, "--memory", "1Gi", "--port", str(port),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(agent.communicate(), 60)
    assert agent.returncode == 1
    assert stderr.decode().strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port} (agent data plane): Address already in use"
    )


async def test_agent_and_sim_worker_processes_load_a_model_for_the_scheduler(tmp_path):
    fake = FakeScheduler()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)
    scheduler_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (sim_port,) = free_ports(1)
    python = [sys.executable, "-m", "modelyard"]
    # The pod's labels as the Downward API writes them (deploy/: the agent beside MLServer).
    labels = tmp_path / "labels"
    labels.write_text('app="x"\ncapability.modelyard.io/gpu="true"\ncapability.modelyard.io/tpu="false"\n')
    sim = await asyncio.create_subprocess_exec(
        *python, "sim-worker", "--port", str(sim_port), "--repository-api", "--model-memory", "100",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    agent = await asyncio.create_subprocess_exec(
        *python, "agent", "--scheduler", f"127.0.0.1:{scheduler_port}", "--server", "sim",
        "--replica", "1", "--inference-url", f"http://127.0.0.1:{sim_port}", "--memory", "1Ki",
        "--capabilities", "sim,llm", "--capabilities-from", str(labels), "--unload-grace", "0",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        async def subscribed() -> bool:
            return bool(fake.subscribes) or agent.returncode is not None

        await wait_until(subscribed, attempts=3000)
        assert agent.returncode is None
        request = fake.subscribes[0]
        assert (request.server_name, request.replica_idx) == ("sim", 1)
        assert request.replica_config.memory_bytes == 1024
        assert list(request.replica_config.capabilities) == ["sim", "llm", "gpu"]
        fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "llm", memory_bytes=100)
        loaded = await fake.event("llm", agent_pb2.ModelEvent.LOADED, within=30)
        assert loaded.available_memory_bytes == 924
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 30) == 0
    finally:
        for process in (agent, sim):
            if process.returncode is None:
                process.kill()
                await process.wait()
        await server.stop(0)


# --- security: plain text only on loopback, files checked at start, the token never logged -----

BASE = ["agent", "--server", "sim", "--inference-url", "http://127.0.0.1:1", "--memory", "1Ki"]
JOIN_TOKEN = "j-0a9e8d7c6b5a4f3e2d1c"


def agent_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelyard", *BASE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "250", **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


def test_an_agent_others_could_reach_without_tls_does_not_start():
    line = one_error_line(agent_run("--scheduler", "127.0.0.1:1", "--host", "0.0.0.0"))
    assert "its data plane listens on 0.0.0.0 without TLS (--tls-cert, --tls-key)" in line
    assert "--insecure" in line
    line = one_error_line(agent_run("--scheduler", "10.0.0.1:9005"))
    assert "it reaches the scheduler 10.0.0.1:9005 without TLS (--scheduler-ca) or a credential" in line


def test_unusable_certificate_and_token_files_are_one_line_naming_them(tmp_path):
    pki = Pki(tmp_path, "ca")
    cert, other = pki.issue(), pki.issue()
    expired = pki.expired()
    loopback = ["--scheduler", "127.0.0.1:1"]
    cases = [
        (["--scheduler-ca", str(tmp_path / "none.pem")], str(tmp_path / "none.pem")),
        (["--cert", str(cert.cert), "--key", str(other.key)], str(other.key)),  # not its key
        (["--tls-cert", str(expired.cert), "--tls-key", str(expired.key)], str(expired.cert)),
        (["--token-file", str(tmp_path / "no-token")], str(tmp_path / "no-token")),
    ]
    for args, named in cases:
        line = one_error_line(agent_run(*loopback, *args))
        assert named in line, (args, line)
    line = one_error_line(agent_run(*loopback, "--cert", str(cert.cert)))
    assert line == "error: agent options: --cert and --key go together"
    secret = "j-has a space-and-secret"
    line = one_error_line(agent_run(*loopback, env={"MODELYARD_AGENT_TOKEN": secret}))
    assert (
        line
        == "error: agent options: MODELYARD_AGENT_TOKEN: the token must be printable ASCII without spaces"
    )


async def test_the_agent_joins_a_tls_scheduler_with_the_token_from_its_environment_and_never_logs_it(
    tmp_path, sim_workers
):
    """A real agent process at debug level, a real scheduler over TLS taking join tokens: the agent
    subscribes and loads what it is given, and the token is nowhere in what it printed."""
    from modelyard.scheduler import SchedulerConfig, start_scheduler

    pki = Pki(tmp_path, "ca")
    served = pki.issue()
    tokens = tmp_path / "agent-tokens"
    tokens.write_text(f"sim {JOIN_TOKEN}\n")
    sched = await start_scheduler(
        SchedulerConfig(
            port=0,
            agent_port=0,
            db=":memory:",
            tls={"cert_file": str(served.cert), "key_file": str(served.key)},
            agent_tokens_file=str(tokens),
        )
    )
    (worker,) = await sim_workers(1, repository_api=True)
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "agent", "--scheduler", sched.agent_address, "--server", "sim",
        "--inference-url", worker.url, "--memory", "1Ki", "--port", "0", "--unload-grace", "0",
        "--scheduler-ca", str(pki.ca_file), "--log-level", "debug", "--drain-timeout", "5",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "MODELYARD_AGENT_TOKEN": JOIN_TOKEN},
    )  # fmt: skip
    try:

        async def subscribed() -> bool:
            server = sched.state.servers.get("sim")
            return (server is not None and server.replicas[0].connected) or agent.returncode is not None

        await wait_until(subscribed, attempts=3000)
        assert agent.returncode is None
        async with aiohttp.ClientSession() as http:
            spec = {"storage_uri": "file:///models/iris", "memory": 100}
            async with http.put(f"{sched.url}/v1/models/iris", json=spec, ssl=pki.client_context()) as r:
                assert r.status == 200

        async def available() -> bool:
            model = sched.state.models.get("iris")
            return model is not None and model.latest.status.state.value == "ModelAvailable"

        await wait_until(available, attempts=3000)
        agent.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(agent.communicate(), 30)
        assert agent.returncode == 0, stderr.decode()
        output = stdout.decode() + stderr.decode()
        assert "DEBUG" in output and "loaded iris" in output  # it did log, at length
        assert JOIN_TOKEN not in output
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await sched.stop()
