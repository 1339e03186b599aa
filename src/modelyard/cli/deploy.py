"""`modelyard deploy render`: the Kubernetes manifests for every role, filled from values files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from modelyard.cli.problems import fail
from modelyard.errors import ConfigError
from modelyard.kube.render import dump, render
from modelyard.kube.values import load_values

deploy_app = typer.Typer(no_args_is_help=True, help="Kubernetes manifests for every role.")
err = Console(stderr=True, highlight=False)


@deploy_app.command("render")
def render_command(
    values: Annotated[
        list[Path] | None,
        typer.Option(
            "--values",
            "-f",
            help="Values file (repeatable: later files override earlier ones). "
            "Without one: the defaults, as deploy/values.yaml writes them out.",
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of standard output.")
    ] = None,
) -> None:
    """Print the gateway, Redis, scheduler and inference-server manifests, ready for kubectl apply -f -."""
    paths = values or []
    try:
        documents = render(load_values(paths), source=", ".join(map(str, paths)) or "<defaults>")
    except ConfigError as error:
        raise fail(error) from None
    text = dump(documents)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        err.print("[red]error:[/red] " + escape(f"{output}: {exc.strerror}"))
        raise typer.Exit(1) from None
    err.print(escape(f"wrote {len(documents)} manifests to {output}"))
