"""An artefact server for the fetch tests: a real aiohttp server on an ephemeral port that can
send a sized file, an endless body, a 403 with a secret body, redirects anywhere; it records
every request (path and headers) and how much of an endless body it sent before the client
went away, and when. `tls_files` makes a CA and a certificate for it (cryptography)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

SECRET_BODY = "the-secret-the-server-read-for-us-7f3a"


@dataclass
class Endless:
    """One endless body sent: bytes sent, and when the client went away (monotonic)."""

    sent: int = 0
    closed_at: float | None = None


@dataclass
class ArtefactServer:
    host: str = "127.0.0.1"
    ssl_context: ssl.SSLContext | None = None
    port: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    endless: list[Endless] = field(default_factory=list)
    payloads: dict[str, bytes] = field(default_factory=dict)  # path -> body served
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> ArtefactServer:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path_qs, dict(request.headers)))
        path = request.path
        if path in self.payloads:
            return web.Response(body=self.payloads[path])
        if path.startswith("/endless"):
            return await self._endless(request)
        if path.startswith("/forbidden"):
            return web.Response(status=403, text=f"denied; by the way the key is {SECRET_BODY}")
        if path.startswith("/redirect"):
            raise web.HTTPFound(request.query["to"])
        if path.startswith("/auth"):
            if request.headers.get("Authorization") is None:
                return web.Response(status=401, text=SECRET_BODY)
            return web.Response(body=b"authorised")
        return web.Response(status=404, text="no such object")

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        record = Endless()
        self.endless.append(record)
        response = web.StreamResponse()  # chunked: no length to judge by
        await response.prepare(request)
        chunk = b"\0" * (256 << 10)
        try:
            while True:
                await response.write(chunk)
                record.sent += len(chunk)
        except (ConnectionError, OSError, asyncio.CancelledError):
            record.closed_at = time.monotonic()
            raise
        return response

    def seen(self, prefix: str) -> list[tuple[str, dict[str, str]]]:
        return [r for r in self.requests if r[0].startswith(prefix)]


async def endless_closed(server: ArtefactServer, within: float) -> Endless:
    """The first endless body, once its client has gone away (fails after `within` seconds)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.endless and server.endless[0].closed_at is not None:
            return server.endless[0]
        await asyncio.sleep(0.01)
    sent = server.endless[0].sent if server.endless else 0
    raise AssertionError(f"the endless body was still being read after {within}s ({sent} bytes sent)")


async def endless_started(server: ArtefactServer, at_least: int = 1 << 20, within: float = 10) -> Endless:
    """The first endless body once `at_least` bytes of it were sent."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.endless and server.endless[0].sent >= at_least:
            return server.endless[0]
        await asyncio.sleep(0.01)
    raise AssertionError("the endless body did not start")


def tls_files(directory: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> dict[str, Any]:
    """A CA (ca.pem) and a server certificate for `names` signed by it (server.pem, server.key),
    made with `cryptography`; returns their paths and a server SSLContext."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modelyard test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "context": context}
