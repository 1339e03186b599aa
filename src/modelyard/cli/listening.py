"""The line a role prints when it cannot listen: `cannot listen on HOST:PORT (WHAT): WHY`, naming
which of its listeners failed, so that "Address already in use" says which address and what for."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import typer

from modelyard.cli.problems import print_error

# What a bind fails with; another OSError (a file, say) is no listener's and is said as it is.
_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


@dataclass(frozen=True)
class Listener:
    """One port a role binds, and what it serves there ("gateway HTTP", "scheduler agent gRPC")."""

    host: str
    port: int
    what: str
    grpc: bool = False  # bound by grpc, whose errors carry no errno (rpc/_server.py)

    @property
    def address(self) -> str:
        host = self.host or "*"  # "": every interface
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def listen_failure(error: OSError, listeners: Sequence[Listener]) -> typer.Exit:
    """Print the one line for an OSError out of starting a role and return the exit to raise. A
    closed stdout is raised again: typer ends the command quietly, as `| head` expects."""
    if isinstance(error, BrokenPipeError):
        raise error
    print_error(cannot_listen(error, listeners))
    return typer.Exit(1)


def cannot_listen(error: OSError, listeners: Sequence[Listener]) -> str:
    """`cannot listen on 127.0.0.1:8000 (gateway HTTP): Address already in use`. The listener is the
    one whose port the error names (asyncio names the address, grpc `host:port`); a plain socket's
    error names none: the first listener, which every role binds first."""
    text = error.strerror or str(error)
    named = [
        listener
        for listener in listeners
        if listener.port and re.search(rf"(?<![\w.]){listener.port}(?![\w.])", text)
    ]
    if error.filename is not None or not (named or error.errno in _BIND_ERRNOS) or not listeners:
        return text
    if len(named) > 1:  # one port given twice: grpc's error is the gRPC listener's
        named = [n for n in named if n.grpc == (error.errno is None)] or named
    listener = (named or list(listeners))[0]
    # grpc says only "address in use or not available", after the address it names.
    why = os.strerror(error.errno) if error.errno else text.rsplit(": ", 1)[-1]
    return f"cannot listen on {listener.address} ({listener.what}): {why}"
