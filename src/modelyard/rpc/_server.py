"""Starting a grpc.aio server on one address, shared by the agent and OIP servers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio

from modelyard.security.tls import Material, ServerTls


def grpc_address(host: str, port: int) -> str:
    """`host:port` as gRPC takes it: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_server(
    host: str,
    port: int,
    add_servicer: Callable[[aio.Server], None],
    *,
    what: str,
    reuse_port: bool = False,
    options: Sequence[tuple[str, Any]] = (),
    tls: ServerTls | None = None,
) -> tuple[aio.Server, int]:
    """A started server on `host:port` (port 0: any free port) and the port it bound. gRPC sets
    SO_REUSEPORT by default: a second server on a port in use would share it and take half the
    calls, silently; off unless `reuse_port`, a port in use is refused: OSError naming `what`.
    With `tls`, over TLS with its certificate, the newest at each handshake (`watch_tls` reloads)."""
    server = aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0), *options])
    add_servicer(server)
    address = grpc_address(host, port)
    try:
        if tls is not None:
            bound = server.add_secure_port(address, _credentials(tls))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address"
        bound = 0
    if bound == 0:
        await server.stop(None)  # it holds a completion queue and threads until stopped
        raise OSError(f"{address} ({what}): address in use or not available")
    await server.start()
    return server, bound


def _configuration(material: Material) -> Any:
    return grpc.ssl_server_certificate_configuration([(material.key, material.chain)], material.ca)


def _credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """gRPC's credentials from `tls`: gRPC asks the fetcher at each handshake (on its own threads),
    which hands over the files' newest certificate once after each reload."""
    handed = [tls.generation]

    def newest() -> Any:
        if tls.generation == handed[0]:
            return None  # keep the one it has
        handed[0] = tls.generation
        return _configuration(tls.material)

    required = bool(tls.config.client_ca_file) and tls.config.client_cert == "required"
    return grpc.dynamic_ssl_server_credentials(_configuration(tls.material), newest, required)


def watch_tls(tls: ServerTls | None) -> asyncio.Task[None] | None:
    """The task that reloads `tls`'s files while a server runs (cancel it when the server stops)."""
    return asyncio.create_task(tls.watch()) if tls is not None else None
