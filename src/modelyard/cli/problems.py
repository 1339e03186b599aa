"""How a command reports a ModelyardError: one `error:` line per problem, then exit 1."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from modelyard.errors import ConfigError, ModelyardError

err = Console(stderr=True, highlight=False)


def fail(error: ModelyardError) -> typer.Exit:
    """Print the error (a ConfigError: each problem with its source) and return the exit to raise."""
    if isinstance(error, ConfigError):
        for problem in error.problems:
            print_error(f"{error.source}: {problem}")
    else:
        print_error(error.message)
    return typer.Exit(1)


def print_error(line: str) -> None:
    """`error: <line>` on stderr, on one line however long."""
    err.print("[red]error:[/red] " + escape(line), soft_wrap=True)
