"""Real certificates for the TLS tests, made with trustme: a CA, server certificates for
127.0.0.1 and localhost, client certificates, written as PEM files a config can name."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Issued:
    """A certificate's files: `cert` (the chain, leaf first) and `key`."""

    cert: Path
    key: Path


class Pki:
    """A CA writing its certificates into `folder`."""

    def __init__(self, folder: Path, name: str = "ca") -> None:
        self.folder = folder
        self.name = name
        self.ca = trustme.CA(organization_name=f"modelyard test {name}")
        self.ca_file = folder / f"{name}.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self._issued = 0

    def issue(
        self,
        *identities: str,
        name: str | None = None,
        not_before: datetime | None = None,
        not_after: datetime | None = None,
    ) -> Issued:
        """A certificate for `identities` (default: 127.0.0.1 and localhost), written to files named
        `name` (default: a new name each time)."""
        self._issued += 1
        name = name or f"{self.name}-leaf{self._issued}"
        leaf = self.ca.issue_cert(
            *(identities or ("127.0.0.1", "localhost")), not_before=not_before, not_after=not_after
        )
        issued = Issued(self.folder / f"{name}.pem", self.folder / f"{name}.key")
        issued.cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        issued.key.write_bytes(leaf.private_key_pem.bytes())
        return issued

    def expired(self) -> Issued:
        now = datetime.now(UTC)
        return self.issue(not_before=now - timedelta(days=30), not_after=now - timedelta(days=1))

    def client_context(self, client: Issued | None = None) -> ssl.SSLContext:
        """A client's context trusting this CA, presenting `client` if given."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context


def serial_of(der: bytes) -> int:
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number
