"""TLS for listeners and clients, from certificate files, reloaded when the files change.

`ServerTls` is a listener's. asyncio serves with its `context`, whose every handshake switches to
the newest context built from the files (in the SNI callback, which OpenSSL calls for each
ClientHello, with or without a name), so connections already open keep the certificate they got
and new ones get the new one, as Envoy's SDS rotation does. gRPC takes the same files as PEM
(`ServerTls.material`). `ClientTls` is a client's: `context()` is the newest.

Files are checked at start, each problem a `TlsError` naming the file: unreadable, not PEM, a key
that does not match its certificate, a certificate expired or not yet valid. After start, a
rotation that cannot be loaded (half written, expired) keeps the last good context and is logged
once; the next change of the files is tried again. Files are polled (`reload_interval`), as a
rotated Kubernetes Secret changes a symlink that inotify on the file itself would not see.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509

from modelyard.config import TlsClientConfig, TlsServerConfig
from modelyard.errors import ConfigError

log = logging.getLogger("modelyard.tls")

MIN_VERSION = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
# A file's identity and content as stat sees them: a rotation changes one of these.
Signature = tuple[tuple[int, int, int, int] | None, ...]


class TlsError(ConfigError):
    """A certificate, key or CA file that cannot be used; `source` is the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, [problem])


@dataclass(frozen=True)
class Material:
    """What one context was built from, as PEM bytes (what gRPC takes)."""

    chain: bytes
    key: bytes
    ca: bytes | None
    not_after: datetime


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise TlsError(path, f"cannot read the {what}: {exc.strerror or exc}") from None


def _certificates(path: str, data: bytes, what: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsError(path, f"not a PEM {what} (no certificate could be read)") from None


def _valid_now(path: str, leaf: x509.Certificate, now: datetime) -> None:
    if now > leaf.not_valid_after_utc:
        raise TlsError(path, f"the certificate expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if now < leaf.not_valid_before_utc:
        raise TlsError(
            path, f"the certificate is not valid until {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )


def _load_pair(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise TlsError(key_file, f"the key does not match the certificate in {cert_file}") from None
        raise TlsError(key_file, f"not a usable private key for {cert_file} ({exc.reason or exc})") from None
    except OSError as exc:  # a file that went away between reading and loading it
        raise TlsError(key_file, f"cannot read the key: {exc.strerror or exc}") from None


def signature(*paths: str) -> Signature:
    """The files as stat sees them (following symlinks, as a rotated Secret's are)."""
    seen: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            seen.append(None)
        else:
            seen.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(seen)


def _server_material(config: TlsServerConfig, now: datetime) -> Material:
    chain = _read(config.cert_file, "certificate")
    _valid_now(config.cert_file, _certificates(config.cert_file, chain, "certificate")[0], now)
    key = _read(config.key_file, "key")
    ca = None
    if config.client_ca_file:
        ca = _read(config.client_ca_file, "client CA certificates")
        _certificates(config.client_ca_file, ca, "CA certificate")
    leaf = _certificates(config.cert_file, chain, "certificate")[0]
    return Material(chain, key, ca, leaf.not_valid_after_utc)


def server_context(
    config: TlsServerConfig, alpn: tuple[str, ...], now: datetime
) -> tuple[ssl.SSLContext, Material]:
    """A listener's context from the files, checked, and the PEM it was built from."""
    material = _server_material(config, now)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_VERSION[config.min_version]
    _load_pair(context, config.cert_file, config.key_file)
    if material.ca is not None:
        context.load_verify_locations(cadata=material.ca.decode("ascii", "replace"))
        context.verify_mode = ssl.CERT_REQUIRED if config.client_cert == "required" else ssl.CERT_OPTIONAL
        # A resumed session skips the certificate check: after the client CA is rotated away, a
        # client would keep its access. TLS 1.3 resumes only from tickets, which are not issued;
        # TLS 1.2 also resumes from the server's session cache, which Python cannot turn off.
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.options |= ssl.OP_NO_TICKET
        context.num_tickets = 0
    if alpn:
        context.set_alpn_protocols(list(alpn))
    if _server_material(config, now) != material:  # rotated while it was loaded: not one pair
        raise TlsError(config.cert_file, "the files changed while they were read")
    return context, material


class ServerTls:
    """A listener's TLS. `context` is what the listener serves with; `reload()` (or `watch()`)
    swaps in a context built from the files when they change."""

    def __init__(self, config: TlsServerConfig, *, alpn: tuple[str, ...] = ("http/1.1",)) -> None:
        self.config = config
        self._alpn = alpn
        self._files = tuple(f for f in (config.cert_file, config.key_file, config.client_ca_file) if f)
        self._signature = signature(*self._files)
        self._current, self.material = server_context(config, alpn, datetime.now(UTC))
        self.context, _ = server_context(config, alpn, datetime.now(UTC))
        self.context.sni_callback = self._newest
        self._failed: Signature | None = None
        self.generation = 0
        """How many times the files were reloaded: gRPC's fetcher hands over a new config on a change."""

    def _newest(self, connection: ssl.SSLObject, _name: str | None, _context: ssl.SSLContext) -> None:
        connection.context = self._current

    def reload(self) -> bool:
        """Swap in the files' certificate if they changed and can be used; True if it did."""
        seen = signature(*self._files)
        if seen == self._signature:
            return False
        try:
            context, material = server_context(self.config, self._alpn, datetime.now(UTC))
        except TlsError as exc:
            if seen != self._failed:  # once per change of the files, not every poll
                log.error("%s; still serving the certificate loaded before", exc)
                self._failed = seen
            return False
        self._current, self.material, self._signature = context, material, seen
        self.generation += 1
        log.info(
            "TLS certificate reloaded from %s (valid until %s)", self.config.cert_file, material.not_after
        )
        return True

    async def watch(self) -> None:
        """Reload whenever the files change, until cancelled."""
        while True:
            await asyncio.sleep(self.config.reload_interval)
            self.reload()


class ClientTls:
    """A client's TLS to servers: `context()` is built from the files (the system's CAs when no
    `ca_file`), again after they change; `server_name` is the name to verify and send, if set."""

    def __init__(self, config: TlsClientConfig) -> None:
        self.config = config
        self.server_name = config.server_name or None
        self._files = tuple(f for f in (config.ca_file, config.cert_file, config.key_file) if f)
        self._signature = signature(*self._files)
        self._context = self._build()
        self._checked = time.monotonic()

    def _build(self) -> ssl.SSLContext:
        config = self.config
        ca = None
        if config.ca_file:
            ca = _read(config.ca_file, "CA certificates")
            _certificates(config.ca_file, ca, "CA certificate")
        context = ssl.create_default_context(cadata=ca.decode("ascii", "replace") if ca else None)
        context.minimum_version = MIN_VERSION[config.min_version]
        if not config.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.cert_file:
            chain = _read(config.cert_file, "client certificate")
            _valid_now(
                config.cert_file, _certificates(config.cert_file, chain, "certificate")[0], datetime.now(UTC)
            )
            _load_pair(context, config.cert_file, config.key_file)
        return context

    def material(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The CA, the client key and the client chain as PEM (None where not set): for gRPC."""
        config = self.config
        return (
            _read(config.ca_file, "CA certificates") if config.ca_file else None,
            _read(config.key_file, "key") if config.key_file else None,
            _read(config.cert_file, "client certificate") if config.cert_file else None,
        )

    def context(self) -> ssl.SSLContext:
        """The newest context: the files are looked at again at most every 10 s."""
        if self._files and time.monotonic() - self._checked >= 10.0:
            self.reload()
        return self._context

    def reload(self) -> None:
        """Look at the files now (a client about to connect again), and rebuild if they changed."""
        self._checked = time.monotonic()
        seen = signature(*self._files)
        if seen != self._signature:
            try:
                self._context = self._build()
            except TlsError as exc:
                log.error("%s; still using the files loaded before", exc)
            self._signature = seen
