"""The TLS flags of the roles configured by flags (graph serve, scheduler, agent): the same
`TlsServerConfig` a gateway's config file has under `listen.tls`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modelyard.cli.problems import print_error
from modelyard.config import TlsServerConfig

TlsCertOption = Annotated[
    Path | None,
    typer.Option(
        "--tls-cert", help="Serve TLS with this certificate chain (PEM, leaf first); with --tls-key."
    ),
]
TlsKeyOption = Annotated[Path | None, typer.Option("--tls-key", help="The certificate's private key (PEM).")]
TlsClientCaOption = Annotated[
    Path | None,
    typer.Option(
        "--tls-client-ca", help="Require client certificates signed by these CAs (PEM): mutual TLS."
    ),
]


def tls_server_config(cert: Path | None, key: Path | None, client_ca: Path | None) -> TlsServerConfig | None:
    """The flags as a TlsServerConfig (None: plain text); half a pair prints one line and exits 1.
    The files themselves are checked when the listener is made (security.tls.TlsError)."""
    if cert is None and key is None:
        if client_ca is not None:
            print_error("--tls-client-ca: needs --tls-cert and --tls-key (mutual TLS is TLS)")
            raise typer.Exit(1)
        return None
    if cert is None or key is None:
        print_error("--tls-cert and --tls-key go together")
        raise typer.Exit(1)
    return TlsServerConfig(cert_file=str(cert), key_file=str(key), client_ca_file=str(client_ca or ""))
