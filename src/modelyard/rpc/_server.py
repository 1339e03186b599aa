"""Starting a grpc.aio server on one address, shared by the agent and OIP servers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grpc import aio


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
) -> tuple[aio.Server, int]:
    """A started server on `host:port` (port 0: any free port) and the port it bound. gRPC sets
    SO_REUSEPORT by default: a second server on a port in use would share it and take half the
    calls, silently; off unless `reuse_port`, a port in use is refused: OSError naming `what`."""
    server = aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0), *options])
    add_servicer(server)
    address = grpc_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address"
        bound = 0
    if bound == 0:
        await server.stop(None)  # it holds a completion queue and threads until stopped
        raise OSError(f"{address} ({what}): address in use or not available")
    await server.start()
    return server, bound
