"""Agents' client certificates for the mutual-TLS tests: signed by a test CA (`certificates.Pki`),
naming an agent by a URI SAN (`spiffe://modelyard/server/<server>[/replica/<n>]`), which trustme
cannot write; made with `cryptography` from the CA's own key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certificates import Issued, Pki


def agent_uri(server: str, replica: int | None = None) -> str:
    base = f"spiffe://modelyard/server/{server}"
    return base if replica is None else f"{base}/replica/{replica}"


def issue_uri(pki: Pki, *uris: str, name: str) -> Issued:
    """A client certificate signed by `pki`'s CA whose SANs are `uris` (none: no SAN at all)."""
    ca_key = serialization.load_pem_private_key(pki.ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if uris:
        names = [x509.UniformResourceIdentifier(uri) for uri in uris]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    certificate = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    issued = Issued(pki.folder / f"{name}.pem", pki.folder / f"{name}.key")
    issued.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    issued.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return issued


def agent_certificate(pki: Pki, server: str, replica: int | None = None) -> Issued:
    """The certificate an agent of `server` (`replica`: that one only) shows."""
    name = f"agent-{server}" + ("" if replica is None else f"-{replica}")
    return issue_uri(pki, agent_uri(server, replica), name=name)
