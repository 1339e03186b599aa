"""TLS to upstreams (issue 28 item 2): https:// backends verified against a CA, SNI and the name
verified when the URL is an IP address, client certificates for backends that require them (one
pool per setting: connections with different certificates are never shared), a client certificate
rotated while the gateway runs, health checks and scrapes over the same TLS, a backend that does
not verify failing as a connect error logged once, and gRPC to a grpcs:// backend through the
gateway with tritonclient. Real certificates (trustme), real handshakes, a real backend that
counts its connections and records what each presented."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from cryptography import x509

from certificates import Issued, Pki, serial_of
from modelyard.config import TlsClientConfig, TlsServerConfig
from modelyard.errors import ConfigError, UpstreamUnreachable
from modelyard.gateway.gateway import GATEWAY
from modelyard.security.tls import ClientTls, TlsError
from modelyard.simworker import SimWorker, SimWorkerConfig
from modelyard.upstream.http1 import Http1Client, TlsUrl
from support import free_ports

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ANSWER = orjson.dumps({"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]})
METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"


@dataclass
class Seen:
    """One connection the backend accepted: the SNI it was sent, the client certificate's serial
    (None: none), and the paths asked on it."""

    sni: str | None
    client_serial: int | None
    paths: list[str] = field(default_factory=list)


class Backend:
    """An HTTPS backend (asyncio): answers any request with a chat.completion (Prometheus text on
    /metrics), keeps connections alive unless `close_each`, and records every connection."""

    def __init__(self, pki: Pki, server: Issued, *, client_ca: Path | None = None, close_each: bool = False):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(server.cert, server.key)
        if client_ca is not None:
            self.context.load_verify_locations(cafile=client_ca)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self._sni: list[str | None] = []
        self.context.sni_callback = lambda _obj, name, _ctx: self._sni.append(name)
        self.close_each = close_each
        self.connections: list[Seen] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def start(self) -> Backend:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        seen = Seen(self._sni[-1] if self._sni else None, serial_of(der) if der else None)
        self.connections.append(seen)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                seen.paths.append(lines[0].split(" ")[1])
                length = next(
                    (
                        int(line.split(":", 1)[1])
                        for line in lines
                        if line.lower().startswith("content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                body = METRICS if seen.paths[-1] == "/metrics" else ANSWER
                close = b"Connection: close\r\n" if self.close_each else b""
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + close
                    + b"Content-Length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()
                if self.close_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
async def backends() -> AsyncIterator[Any]:
    started: list[Backend] = []

    async def start(*args: Any, **kwargs: Any) -> Backend:
        backend = await Backend(*args, **kwargs).start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        await backend.stop()


def model(name: str, *endpoints: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"name": name, "endpoints": list(endpoints), "health_check": {"interval": 0}, **fields}


async def chat(http: aiohttp.ClientSession, gateway: Any, name: str = "m") -> tuple[int, dict[str, Any]]:
    async with http.post(gateway.url + "/v1/chat/completions", json={**CHAT, "model": name}) as response:
        return response.status, await response.json()


async def test_an_https_backend_verified_with_a_ca_keeps_its_connections(gateways, backends, pki, http):
    backend = await backends(pki, pki.issue())
    gateway = await gateways(
        [model("m", {"url": backend.url})], upstream={"tls": {"ca_file": str(pki.ca_file)}}
    )
    for _ in range(30):
        assert (await chat(http, gateway))[0] == 200
    assert len(backend.connections) == 1  # one connection, kept alive over TLS
    assert len(backend.connections[0].paths) == 30
    # Concurrent requests open at most one connection each, and those are kept too.
    statuses = await asyncio.gather(*(chat(http, gateway) for _ in range(40)))
    assert {status for status, _ in statuses} == {200}
    opened = len(backend.connections)
    assert opened <= 1 + 40
    await asyncio.gather(*(chat(http, gateway) for _ in range(40)))
    assert sum(len(c.paths) for c in backend.connections) == 110
    assert len(backend.connections) <= opened + 40 and len(backend.connections) < 110
    # No SNI for an IP address (RFC 6066); the name verified is the address itself.
    assert backend.connections[0].sni is None


async def test_a_backend_that_does_not_verify_fails_as_a_connect_error_logged_once(
    gateways, backends, pki, http, caplog, tmp_path
):
    backend = await backends(pki, pki.issue())
    other = Pki(tmp_path, "other")
    gateway = await gateways(
        [model("m", {"url": backend.url}, tls={"ca_file": str(other.ca_file)})],
    )
    caplog.set_level(logging.INFO, logger="modelyard")
    answers = await asyncio.gather(*(chat(http, gateway) for _ in range(10)))
    answers += [await chat(http, gateway) for _ in range(20)]
    # As for a refused connection: 502, retried (on the same endpoint, the model's only one).
    assert {status for status, _ in answers} == {502}
    assert {"refused the connection" in body["error"]["message"] for _, body in answers} == {True}
    assert {"certificate verify failed" in body["error"]["message"] for _, body in answers} == {True}
    handshake = [r for r in caplog.records if r.name == "modelyard.upstream"]
    assert len(handshake) == 1, [r.getMessage() for r in handshake]
    line = handshake[0].getMessage()
    assert backend.url in line
    assert "certificate verify failed: " in line  # (OpenSSL's words for a chain it cannot build vary)
    assert backend.connections == []  # no handshake completed: nothing reached it
    # Every line that names the reason, the rate-limited warnings of failed requests included.
    naming = [r for r in caplog.records if "certificate verify failed" in r.getMessage()]
    assert len(naming) <= 2


async def test_a_backend_that_fails_verification_is_taken_out_by_its_health_check(
    gateways, backends, pki, http, tmp_path
):
    backend = await backends(pki, pki.issue())
    other = Pki(tmp_path, "other")
    config = model("m", {"name": "b", "url": backend.url}, tls={"ca_file": str(other.ca_file)})
    config["health_check"] = {"interval": "60s"}
    gateway = await gateways([config])
    assert (await chat(http, gateway))[0] == 503
    async with http.get(gateway.url + "/admin/overview") as response:
        overview = await response.json()
    (endpoint,) = overview["models"][0]["endpoints"]
    assert endpoint["health"]["status"] == "unhealthy"
    assert "certificate verify failed" in endpoint["health"]["last_error"]
    assert endpoint["url"] == backend.url  # shown as configured


async def test_server_name_verifies_an_ip_url_and_is_sent_as_sni(gateways, backends, pki, http, caplog):
    backend = await backends(pki, pki.issue("backend.example"))  # no IP address in the certificate
    plain = {"ca_file": str(pki.ca_file)}
    named = {**plain, "server_name": "backend.example"}
    gateway = await gateways(
        [
            model("by-ip", {"url": backend.url, "tls": plain}),
            model("by-name", {"url": backend.url, "tls": named}),
        ]
    )
    caplog.set_level(logging.WARNING, logger="modelyard.upstream")
    assert (await chat(http, gateway, "by-ip"))[0] == 502
    (line,) = [r.getMessage() for r in caplog.records if r.name == "modelyard.upstream"]
    assert "certificate verify failed: IP address mismatch" in line
    assert (await chat(http, gateway, "by-name"))[0] == 200
    assert [c.sni for c in backend.connections] == ["backend.example"]


async def test_client_certificates_for_a_backend_that_requires_them(gateways, backends, pki, http):
    backend = await backends(pki, pki.issue(), client_ca=pki.ca_file)
    first, second = pki.issue("gateway-a", name="a"), pki.issue("gateway-b", name="b")
    ca = {"ca_file": str(pki.ca_file)}
    gateway = await gateways(
        [
            model(
                "a",
                {"url": backend.url},
                tls={**ca, "cert_file": str(first.cert), "key_file": str(first.key)},
            ),
            # The same URL with another certificate: the endpoint's own tls wins over its model's.
            model(
                "b",
                {
                    "url": backend.url,
                    "tls": {**ca, "cert_file": str(second.cert), "key_file": str(second.key)},
                },
                tls={**ca, "cert_file": str(first.cert), "key_file": str(first.key)},
            ),
            model("none", {"url": backend.url}, tls=ca),
        ]
    )
    for _ in range(5):
        assert (await chat(http, gateway, "a"))[0] == 200
        assert (await chat(http, gateway, "b"))[0] == 200
    serials = [c.client_serial for c in backend.connections]
    assert sorted(serials) == sorted([serial_of_file(first), serial_of_file(second)])  # one each, kept
    assert all(len(c.paths) == 5 for c in backend.connections)
    status, body = await chat(http, gateway, "none")
    assert status == 502
    assert "client certificate" in body["error"]["message"]


def serial_of_file(issued: Issued) -> int:
    return x509.load_pem_x509_certificates(issued.cert.read_bytes())[0].serial_number


async def test_health_checks_and_scrapes_use_the_endpoints_tls(gateways, backends, pki, http):
    backend = await backends(pki, pki.issue(), client_ca=pki.ca_file)
    client = pki.issue("gateway")
    tls = {"ca_file": str(pki.ca_file), "cert_file": str(client.cert), "key_file": str(client.key)}
    config = model(
        "m",
        {"name": "b", "url": backend.url},
        tls=tls,
        strategy="resource_aware",
        health_check={"interval": "60s", "path": "/health"},
        resource_aware={"scrape_interval": 0.05},
    )
    gateway = await gateways([config])
    assert (await chat(http, gateway))[0] == 200
    for _ in range(100):
        if any("/metrics" in c.paths for c in backend.connections):
            break
        await asyncio.sleep(0.02)
    paths = {path for c in backend.connections for path in c.paths}
    assert {"/health", "/metrics", "/v1/chat/completions"} <= paths
    assert {c.client_serial for c in backend.connections} == {serial_of_file(client)}
    async with http.get(gateway.url + "/admin/overview") as response:
        (endpoint,) = (await response.json())["models"][0]["endpoints"]
    assert endpoint["health"]["status"] == "healthy"


async def test_a_rotated_client_certificate_is_used_by_new_connections(
    gateways, backends, pki, http, tmp_path
):
    backend = await backends(pki, pki.issue(), client_ca=pki.ca_file, close_each=True)
    first, second = pki.issue("first", name="first"), pki.issue("second", name="second")
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    tls = {"ca_file": str(pki.ca_file), "cert_file": str(cert), "key_file": str(key)}
    gateway = await gateways([model("m", {"url": backend.url}, tls=tls)])
    assert (await chat(http, gateway))[0] == 200
    shutil.copy(second.cert, cert)
    shutil.copy(second.key, key)
    (endpoint,) = gateway.app[GATEWAY].clusters["m"].endpoints
    assert isinstance(endpoint.url, TlsUrl)
    endpoint.url.tls.reload()  # as if its 10 s between looks at the files had passed
    assert (await chat(http, gateway))[0] == 200
    assert [c.client_serial for c in backend.connections] == [serial_of_file(first), serial_of_file(second)]


async def test_tls_files_are_checked_at_start_naming_the_file(gateways, tmp_path):
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(TlsError) as raised:
        await gateways(
            [model("m", {"url": "https://127.0.0.1:1"})], upstream={"tls": {"ca_file": str(missing)}}
        )
    assert raised.value.source == str(missing)
    assert "cannot read the CA certificates" in raised.value.problems[0]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsError) as raised:
        await gateways([model("m", {"url": "https://127.0.0.1:1", "tls": {"ca_file": str(garbage)}})])
    assert raised.value.source == str(garbage)


async def test_an_endpoints_tls_needs_an_https_or_grpcs_url(gateways):
    with pytest.raises(ConfigError, match="nothing uses it"):
        await gateways([model("m", {"url": "http://127.0.0.1:1", "tls": {"server_name": "x"}})])


async def test_grpcs_backend_through_the_gateway_with_tritonclient(gateways, pki, tmp_path):
    import tritonclient.grpc as grpcclient

    server = pki.issue()
    client = pki.issue("gateway", name="gateway")
    tls = TlsServerConfig(
        cert_file=str(server.cert), key_file=str(server.key), client_ca_file=str(pki.ca_file)
    )
    worker = SimWorker(
        SimWorkerConfig(port=0, grpc_port=0, models=("echo",), oip_scale=2.0, decode_ms_per_token=0), tls=tls
    )
    await worker.start()
    try:
        assert worker.url.startswith("https://") and worker.grpc_url.startswith("grpcs://")
        endpoint = {
            "url": worker.url,
            "grpc_url": worker.grpc_url,
            "tls": {"ca_file": str(pki.ca_file), "cert_file": str(client.cert), "key_file": str(client.key)},
        }
        gateway = await gateways(
            [model("echo", endpoint)], listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0}
        )
        x = np.array([1.0, 2.0], dtype=np.float32)

        def over_grpc() -> list[float]:
            triton = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.grpc_port}")
            try:
                tensor = grpcclient.InferInput("x", [2], "FP32")
                tensor.set_data_from_numpy(x)
                return triton.infer("echo", [tensor], client_timeout=30).as_numpy("x").tolist()
            finally:
                triton.close()

        for _ in range(3):
            assert await asyncio.to_thread(over_grpc) == [2.0, 4.0]
        assert worker.stats.requests_by_endpoint.get("oip_infer_grpc") == 3  # relayed as gRPC, over TLS
    finally:
        await worker.stop()


async def test_a_failed_handshake_is_logged_once_until_one_succeeds(backends, pki, tmp_path, caplog):
    backend = await backends(pki, pki.issue(), close_each=True)  # a new connection per request
    other = Pki(tmp_path, "other")
    ca = tmp_path / "trusted.pem"
    shutil.copy(other.ca_file, ca)
    tls = ClientTls(TlsClientConfig(ca_file=str(ca)))
    client = Http1Client(max_connections=4, connect_timeout=5)
    url = TlsUrl(backend.url, tls)
    caplog.set_level(logging.INFO, logger="modelyard.upstream")

    async def status() -> int | str:
        try:
            response = await client.request(url, "GET", "/health", (), None, 5)
        except UpstreamUnreachable as exc:
            return exc.message
        await response.read()
        return response.status

    try:
        failures = [await status() for _ in range(5)]
        assert all("TLS handshake failed: certificate verify failed" in str(f) for f in failures)
        shutil.copy(pki.ca_file, ca)  # the CA file rotated to the right one
        # The next handshake still fails (the files were looked at before), and looks at them: the
        # one after uses the new CA. The same reason is not logged again.
        assert isinstance(await status(), str)
        assert [await status() for _ in range(3)] == [200, 200, 200]
        shutil.copy(other.ca_file, ca)
        tls.reload()  # (a success does not look at the files: as if 10 s had passed)
        assert isinstance(await status(), str)
        lines = [(r.levelname, r.getMessage().split(" failed: ")[0]) for r in caplog.records]
        assert lines == [
            ("WARNING", f"TLS to {backend.url}"),
            ("INFO", f"TLS to {backend.url} works again"),
            ("WARNING", f"TLS to {backend.url}"),
        ]
    finally:
        client.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_a_client_certificate_refused_after_a_tls13_handshake_is_a_tls_failure(pki, caplog):
    """OpenSSL's server (as Envoy, and unlike asyncio's) refuses a missing client certificate with
    an alert after the TLS 1.3 handshake, on the client's first read."""
    server = pki.issue()
    port = free_ports(1)[0]
    command = [
        "openssl",
        "s_server",
        "-accept",
        str(port),
        "-cert",
        str(server.cert),
        "-key",
        str(server.key),
    ]
    command += ["-CAfile", str(pki.ca_file), "-Verify", "1", "-www", "-quiet"]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    client = Http1Client(max_connections=4, connect_timeout=5)
    caplog.set_level(logging.WARNING, logger="modelyard.upstream")
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            await asyncio.sleep(0.05)
        url = TlsUrl(f"https://127.0.0.1:{port}", ClientTls(TlsClientConfig(ca_file=str(pki.ca_file))))
        for _ in range(3):
            with pytest.raises(
                UpstreamUnreachable, match="TLS handshake failed: tlsv13 alert certificate required"
            ):
                await client.request(url, "GET", "/", (), None, 5)
        assert len(caplog.records) == 1
    finally:
        client.close()
        process.kill()
        await process.wait()


def test_sim_worker_serves_tls_from_its_flags_and_refuses_a_bad_key_in_one_line(pki, tmp_path):
    server = pki.issue()
    missing = tmp_path / "missing.key"
    command = [sys.executable, "-m", "modelyard", "sim-worker", "--port", "0"]
    result = subprocess.run(
        [*command, "--tls-cert", str(server.cert), "--tls-key", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {missing}: cannot read the key: No such file or directory"
    ]
    with subprocess.Popen(
        [*command, "--tls-cert", str(server.cert), "--tls-key", str(server.key)],
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("sim-worker listening on https://127.0.0.1:"), line
            url = line.split()[-1]
            context = pki.client_context()
            with urllib.request.urlopen(url + "/health", context=context, timeout=10) as response:
                assert response.status == 200
        finally:
            process.terminate()
