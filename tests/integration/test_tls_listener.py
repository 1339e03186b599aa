"""TLS on the gateway's listeners (issue 28): real certificates (trustme), real handshakes, the
clients users have (curl, the openai SDK, tritonclient over HTTP and gRPC), certificates rotated
under open connections, client certificates, and a listener that bad handshakes cannot wear out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from certificates import Issued, Pki, serial_of
from support import model_config, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def tls_config(server: Issued, **fields: Any) -> dict[str, Any]:
    return {"cert_file": str(server.cert), "key_file": str(server.key), "reload_interval": 0.05, **fields}


async def start(gateways: Any, sim_workers: Any, tls: dict[str, Any], **listen: Any) -> Any:
    workers = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "tls": tls, **listen}
    return await gateways([model_config("m", workers, health_check={"interval": 0})], listen=listen)


async def chat(url: str, context: ssl.SSLContext) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=CHAT, ssl=context) as r,
    ):
        await r.read()
        return r.status


class Connection:
    """A raw keep-alive HTTPS connection: what certificate it got, and requests on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port, ssl=context))

    @property
    def serial(self) -> int:
        return serial_of(self.writer.get_extra_info("ssl_object").getpeercert(binary_form=True))

    async def health(self) -> bytes:
        self.writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:]
        )
        await self.reader.readexactly(length)
        return head.split(b" ", 2)[1]

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self.writer.wait_closed()


async def holds(value: bool) -> bool:
    return value


async def served_serial(port: int, context: ssl.SSLContext) -> int:
    connection = await Connection.open(port, context)
    try:
        return connection.serial
    finally:
        await connection.close()


async def test_https_serves_requests_and_plain_http_is_not_answered(gateways, sim_workers, pki):
    gateway = await start(gateways, sim_workers, tls_config(pki.issue()))
    assert gateway.url.startswith("https://127.0.0.1:")
    assert await chat(gateway.url, pki.client_context()) == 200
    with pytest.raises(aiohttp.ClientError):  # never a silent fallback to plain text
        await chat(gateway.url.replace("https://", "http://"), None)  # type: ignore[arg-type]


async def test_a_client_that_does_not_trust_the_certificate_fails_its_handshake(
    gateways, sim_workers, pki, tmp_path
):
    gateway = await start(gateways, sim_workers, tls_config(pki.issue()))
    stranger = Pki(tmp_path, "stranger")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await chat(gateway.url, stranger.client_context())


async def test_the_minimum_version_is_enforced(gateways, sim_workers, pki):
    gateway = await start(gateways, sim_workers, tls_config(pki.issue(), min_version="1.3"))
    old = pki.client_context()
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(aiohttp.ClientError):
        await chat(gateway.url, old)
    assert await chat(gateway.url, pki.client_context()) == 200  # 1.3 is fine


async def test_a_rotated_certificate_is_served_to_new_connections_and_open_ones_keep_theirs(
    gateways, sim_workers, pki
):
    first = pki.issue(name="server")
    gateway = await start(gateways, sim_workers, tls_config(first))
    port = gateway.server.port
    context = pki.client_context()
    kept = await Connection.open(port, context)
    try:
        assert await kept.health() == b"200"
        old_serial = kept.serial
        # As cert-manager does: new files replace the old ones (each renamed into place).
        rotated = pki.issue(name="rotated")
        os.replace(rotated.key, first.key)
        os.replace(rotated.cert, first.cert)
        new_serial = serial_of(ssl.PEM_cert_to_DER_cert(first.cert.read_text()))
        assert new_serial != old_serial

        async def rotated_in() -> bool:
            return await served_serial(port, context) == new_serial

        await wait_until(rotated_in)
        assert await kept.health() == b"200"  # the open connection goes on, with its certificate
        assert kept.serial == old_serial
        assert await chat(gateway.url, context) == 200
    finally:
        await kept.close()


async def test_a_rotation_that_cannot_be_used_keeps_the_certificate_served(
    gateways, sim_workers, pki, caplog
):
    first = pki.issue(name="server")
    gateway = await start(gateways, sim_workers, tls_config(first))
    context = pki.client_context()
    serial = await served_serial(gateway.server.port, context)
    other = pki.issue(name="other")
    os.replace(other.key, first.key)  # a key without its certificate: they do not match
    await wait_until(lambda: holds("the key does not match the certificate" in caplog.text))
    assert await served_serial(gateway.server.port, context) == serial
    assert await chat(gateway.url, context) == 200
    assert caplog.text.count("the key does not match") == 1  # once per change of the files, not every poll


async def test_client_certificates_required(gateways, sim_workers, pki, tmp_path):
    clients = Pki(tmp_path, "clients")
    tls = tls_config(pki.issue(), client_ca_file=str(clients.ca_file))
    gateway = await start(gateways, sim_workers, tls)
    good = pki.client_context(clients.issue("client-a"))
    assert await chat(gateway.url, good) == 200
    with pytest.raises(aiohttp.ClientError):
        await chat(gateway.url, pki.client_context())  # none
    stranger = Pki(tmp_path, "stranger").issue("client-b")
    with pytest.raises(aiohttp.ClientError):
        await chat(gateway.url, pki.client_context(stranger))  # from a CA the listener does not trust


async def test_client_certificates_optional(gateways, sim_workers, pki, tmp_path):
    clients = Pki(tmp_path, "clients")
    tls = tls_config(pki.issue(), client_ca_file=str(clients.ca_file), client_cert="optional")
    gateway = await start(gateways, sim_workers, tls)
    assert await chat(gateway.url, pki.client_context()) == 200
    assert await chat(gateway.url, pki.client_context(clients.issue("client-a"))) == 200
    stranger = Pki(tmp_path, "stranger").issue("client-b")
    with pytest.raises(aiohttp.ClientError):
        await chat(gateway.url, pki.client_context(stranger))  # sent, so checked


async def test_failed_handshakes_hold_no_connection_slot(gateways, sim_workers, pki):
    """asyncio tells no protocol of a handshake that failed: the listener counts a connection
    once its handshake is done, so bad handshakes cannot fill max_connections."""
    gateway = await start(gateways, sim_workers, tls_config(pki.issue()), max_connections=2)
    port = gateway.server.port
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # plain text to a TLS port
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
        writer.close()
    context = pki.client_context()
    held = [await Connection.open(port, context) for _ in range(2)]
    try:
        assert [await c.health() for c in held] == [b"200", b"200"]
        assert gateway.server.stats.open_connections == 2
    finally:
        for connection in held:
            await connection.close()
    await wait_until(lambda: holds(gateway.server.stats.open_connections == 0))


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_over_tls(gateways, sim_workers, pki):
    gateway = await start(gateways, sim_workers, tls_config(pki.issue()))
    curl = await asyncio.create_subprocess_exec(
        "curl", "-s", "--cacert", str(pki.ca_file), "-H", "Content-Type: application/json",
        "-d", orjson.dumps(CHAT).decode(), gateway.url + "/v1/chat/completions",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(curl.communicate(), 60)
    assert curl.returncode == 0, err
    assert orjson.loads(out)["object"] == "chat.completion"


async def test_openai_sdk_over_tls(gateways, sim_workers, pki):
    import httpx
    from openai import OpenAI

    gateway = await start(gateways, sim_workers, tls_config(pki.issue()))

    def ask() -> str:
        with httpx.Client(verify=pki.client_context()) as http:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="unused", http_client=http, max_retries=0)
            reply = client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=2)
            return reply.object

    assert await asyncio.to_thread(ask) == "chat.completion"


async def test_tritonclient_http_and_grpc_over_tls(gateways, sim_workers, pki):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    workers = await sim_workers(1, oip_scale=2.0, models=["echo"])
    listen = {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "tls": tls_config(pki.issue())}
    gateway = await gateways([model_config("echo", workers)], listen=listen)
    x = np.array([1.0, 2.0], dtype=np.float32)

    def over_http() -> list[float]:
        client = httpclient.InferenceServerClient(
            f"127.0.0.1:{gateway.server.port}", ssl=True, ssl_options={"ca_certs": str(pki.ca_file)}
        )
        try:
            tensor = httpclient.InferInput("x", [2], "FP32")
            tensor.set_data_from_numpy(x, binary_data=False)
            return client.infer("echo", [tensor]).as_numpy("x").tolist()
        finally:
            client.close()

    def over_grpc() -> list[float]:
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{gateway.grpc_port}", ssl=True, root_certificates=str(pki.ca_file)
        )
        try:
            tensor = grpcclient.InferInput("x", [2], "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer("echo", [tensor], client_timeout=30).as_numpy("x").tolist()
        finally:
            client.close()

    assert await asyncio.to_thread(over_http) == [2.0, 4.0]
    assert await asyncio.to_thread(over_grpc) == [2.0, 4.0]


async def test_grpc_serves_a_rotated_certificate(gateways, sim_workers, pki):
    first = pki.issue(name="server")
    workers = await sim_workers(1, models=["echo"])
    listen = {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "tls": tls_config(first)}
    gateway = await gateways([model_config("echo", workers)], listen=listen)
    context = pki.client_context()
    context.set_alpn_protocols(["h2"])
    assert await served_serial(gateway.grpc_port, context) == serial_of(
        ssl.PEM_cert_to_DER_cert(first.cert.read_text())
    )
    rotated = pki.issue(name="rotated")
    os.replace(rotated.key, first.key)
    os.replace(rotated.cert, first.cert)
    new_serial = serial_of(ssl.PEM_cert_to_DER_cert(first.cert.read_text()))

    async def rotated_in() -> bool:
        return await served_serial(gateway.grpc_port, context) == new_serial

    await wait_until(rotated_in)


# --- bad files: one line at start, naming the file ----------------------------------------------


def serve(config: Path, workers: int = 1) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "-c", str(config), "--workers", str(workers)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def config_with(tmp_path: Path, tls: dict[str, str]) -> Path:
    path = tmp_path / "gateway.yaml"
    listen = {"host": "127.0.0.1", "port": 0, "tls": tls}
    path.write_text(orjson.dumps({"listen": listen, "models": []}).decode())
    return path


def refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_bad_certificate_files_are_refused_at_start_naming_the_file(pki, tmp_path):
    server = pki.issue(name="server")
    missing = tmp_path / "missing.pem"
    line = refused(serve(config_with(tmp_path, {"cert_file": str(missing), "key_file": str(server.key)})))
    assert line == f"error: {missing}: cannot read the certificate: No such file or directory"
    workers = serve(
        config_with(tmp_path, {"cert_file": str(missing), "key_file": str(server.key)}), workers=2
    )
    assert refused(workers) == line  # checked once, before any worker starts

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    line = refused(serve(config_with(tmp_path, {"cert_file": str(garbage), "key_file": str(server.key)})))
    assert line == f"error: {garbage}: not a PEM certificate (no certificate could be read)"

    other = pki.issue(name="other")
    line = refused(serve(config_with(tmp_path, {"cert_file": str(server.cert), "key_file": str(other.key)})))
    assert line == f"error: {other.key}: the key does not match the certificate in {server.cert}"

    expired = pki.expired()
    line = refused(
        serve(config_with(tmp_path, {"cert_file": str(expired.cert), "key_file": str(expired.key)}))
    )
    assert line.startswith(f"error: {expired.cert}: the certificate expired on ")

    tls = {"cert_file": str(server.cert), "key_file": str(server.key), "client_ca_file": str(garbage)}
    line = refused(serve(config_with(tmp_path, tls)))
    assert line == f"error: {garbage}: not a PEM CA certificate (no certificate could be read)"


# --- the graph router (KServe's router container) ------------------------------------------------


async def test_the_graph_router_serves_tls(sim_workers, pki):
    from modelyard.config import TlsServerConfig
    from modelyard.graph import GraphDocument, parse_graph
    from modelyard.graphrouter import start_router

    (worker,) = await sim_workers(1)
    spec = {
        "nodes": {
            "root": {"routerType": "Sequence", "steps": [{"serviceUrl": f"{worker.url}/v2/models/m/infer"}]}
        }
    }
    graph, _report = parse_graph(GraphDocument("g", spec, "<test>"))
    server = pki.issue()
    tls = TlsServerConfig(cert_file=str(server.cert), key_file=str(server.key))
    router = await start_router(graph, host="127.0.0.1", port=0, mesh_probe_url=None, tls=tls)
    try:
        assert router.server.url.startswith("https://")
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with (
            aiohttp.ClientSession() as http,
            http.post(router.server.url + "/", json=body, ssl=pki.client_context()) as response,
        ):
            assert response.status == 200
    finally:
        await router.stop()


def test_graph_serve_refuses_a_bad_certificate_in_one_line(pki, tmp_path):
    server = pki.issue()
    missing = tmp_path / "missing.key"
    spec = orjson.dumps(
        {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceUrl": "http://x/"}]}}}
    )
    command = [
        sys.executable,
        "-m",
        "modelyard",
        "graph",
        "serve",
        "--graph-json",
        spec.decode(),
        "--port",
        "0",
    ]
    for flags, expected in (
        (
            ["--tls-cert", str(server.cert), "--tls-key", str(missing)],
            f"error: {missing}: cannot read the key",
        ),
        (["--tls-cert", str(server.cert)], "error: --tls-cert and --tls-key go together"),
    ):
        result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(expected), result.stderr


async def test_with_client_certificates_no_session_resumes_and_tls_1_2_is_refused(
    gateways, sim_workers, pki, tmp_path
):
    """A resumed handshake skips the certificate check: after the client CA is rotated away a
    client would keep its access. So with client certificates checked, no session tickets are
    issued, and TLS 1.2 (which also resumes from the server's session cache) is refused."""
    clients = Pki(tmp_path, "clients")
    gateway = await start(gateways, sim_workers, tls_config(pki.issue(), client_ca_file=str(clients.ca_file)))
    context = pki.client_context(clients.issue("client-a"))

    def handshake(session: ssl.SSLSession | None) -> tuple[bool, ssl.SSLSession | None]:
        import socket

        with (
            socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
        ):
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tls.recv(12).startswith(b"HTTP/1.1 200")
            return tls.session_reused, tls.session

    reused, session = await asyncio.to_thread(handshake, None)
    assert not reused
    reused, _ = await asyncio.to_thread(handshake, session)
    assert not reused
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(handshake, None)


async def test_connections_that_never_shake_hands_are_bounded_and_time_out(gateways, sim_workers, pki):
    """A connection counts against max_connections from accept, handshake included (asyncio
    holds about 300 KiB of buffers for each): past the bound a new one is closed at once, and a
    silent one is let go at the header timeout, its place free again."""
    gateway = await start(
        gateways, sim_workers, tls_config(pki.issue()), max_connections=3, header_timeout=0.5
    )
    port = gateway.server.port
    silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
    try:
        closed = await asyncio.gather(*(asyncio.wait_for(reader.read(), 10) for reader, _ in silent[3:]))
        assert closed == [b""] * 7  # dropped at accept: no handshake spent on them
        assert gateway.server.stats.refused_connections >= 7
        # The three held ones are let go at the handshake timeout; then a client gets in.
        await asyncio.gather(*(asyncio.wait_for(reader.read(), 10) for reader, _ in silent[:3]))
        context = pki.client_context()

        async def served() -> bool:
            try:
                return await chat(gateway.url, context) == 200
            except aiohttp.ClientError:
                return False

        await wait_until(served)
    finally:
        for _, writer in silent:
            writer.close()
