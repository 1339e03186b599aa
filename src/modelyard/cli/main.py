"""`modelyard`: serve, config validate, sim-worker. Errors print one clear line and exit 1."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from modelyard import __version__
from modelyard.cli.agent import agent
from modelyard.cli.bench import bench
from modelyard.cli.demo import demo_banner, demo_config, start_demo_workers
from modelyard.cli.demo_placement import AGENT_PORT, SCHEDULER_PORT, start_demo_placement
from modelyard.cli.deploy import deploy_app
from modelyard.cli.graph import app as graph_app
from modelyard.cli.key import key_app
from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.model import SCHEDULER_ENV, from_variable, model_app, server_app
from modelyard.cli.problems import fail
from modelyard.cli.scheduler import scheduler
from modelyard.cli.sim_worker import sim_worker
from modelyard.config import (
    GatewayConfig,
    Origins,
    check_admin_exposure,
    load_config,
    merged_data,
    validate_config,
)
from modelyard.errors import ConfigError, ModelyardError
from modelyard.gateway import GATEWAY, start_gateway
from modelyard.gateway.access_log import install_handler
from modelyard.gateway.workers import serve_workers, worker_count
from modelyard.graph import Graph, load_config_graphs
from modelyard.serving import run, serve_until_signal
from modelyard.simworker import SimWorker

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="modelyard: route, compose and place models."
)
config_app = typer.Typer(no_args_is_help=True, help="Work with gateway config files.")
app.add_typer(config_app, name="config")
app.add_typer(graph_app, name="graph")
app.add_typer(deploy_app, name="deploy")
app.add_typer(model_app, name="model")
app.add_typer(server_app, name="server")
app.add_typer(key_app, name="key")
app.command("sim-worker")(sim_worker)
app.command("scheduler")(scheduler)
app.command("agent")(agent)
app.command("bench")(bench)

# The field each of serve's flags sets, to name the flag in a problem with its value.
SERVE_FLAGS = {
    "listen.host": "--host",
    "listen.port": "--port",
    "listen.workers": "--workers",
    "placement.scheduler": "--scheduler",
}


def _cli_overrides(
    host: str | None, port: int | None, scheduler: str | None = None, workers: str | None = None
) -> dict[str, Any]:
    listen: dict[str, Any] = {}
    if host is not None:
        listen["host"] = host
    if port is not None:
        listen["port"] = port
    if workers is not None:
        listen["workers"] = int(workers) if workers.isdigit() else workers
    overrides: dict[str, Any] = {"listen": listen} if listen else {}
    if scheduler:
        overrides["placement"] = {"scheduler": scheduler}
    return overrides


@app.command()
def serve(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("-c", "--config", help="Gateway YAML config. Without it: the embedded demo."),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address (overrides listen.host).")] = None,
    port: Annotated[
        int | None, typer.Option(help="Listen port (overrides listen.port; 0 = any free port).")
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            envvar=SCHEDULER_ENV,
            help="Follow this scheduler (host:port or URL; overrides placement.scheduler): "
            "the models it places become routable.",
        ),
    ] = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the merged config and exit.")
    ] = False,
    workers: Annotated[
        str | None,
        typer.Option(
            help="Gateway processes on the port (overrides listen.workers; default auto: one per CPU, at "
            "most 8, on Linux): a number, or auto. They route as one gateway: in-flight counts, health "
            "checks, ejections, affinities, the routing log, admin changes and /metrics are shared.",
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error (default: logging.level, info).")
    ] = None,
) -> None:
    """Run the gateway. With no -c FILE and no --scheduler, start the embedded demo: three simulated
    workers and two models, and a scheduler (127.0.0.1:9004) placing models on two more."""
    logging.basicConfig(
        level=(log_level or "info").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = _cli_overrides(host, port, scheduler, workers)
    variables = {"placement.scheduler": SCHEDULER_ENV} if from_variable(ctx, "scheduler") else {}
    embedded = config is None and not scheduler
    try:
        if embedded:
            base = merged_data(None, overrides=overrides)
            parts = {k: base[k] for k in ("listen", "logging", "admin") if k in base}  # the rest: the demo's
            origins = Origins(os.environ, overrides, SERVE_FLAGS, variables)
            demo = validate_config(parts, "the embedded demo", origins)
            if not print_config:
                check_admin_exposure(demo, "the embedded demo")
            if demo.listen.workers not in (1, "auto"):  # validated: "1" from the environment is one worker
                problem = "listen.workers: the demo runs one worker; use -c FILE"
                raise ConfigError("the embedded demo", [problem])
        else:
            loaded = load_config(config, overrides=overrides, flags=SERVE_FLAGS, variables=variables)
            source = str(config) if config is not None else "<defaults>"
            if not print_config:
                check_admin_exposure(loaded, source)
            graphs = load_config_graphs(loaded, source)
            count = worker_count(loaded)
    except ModelyardError as error:
        raise fail(error) from None
    # A closed stdout (`--print-config | head`) ends the command quietly, as typer does for any
    # command: it is no listen error.
    if print_config and embedded:
        typer.echo(
            yaml.safe_dump(base, sort_keys=False)
            + "# models: built at start from the demo workers\n"
            + f"# placement: follows the demo's scheduler on 127.0.0.1:{SCHEDULER_PORT}"
        )
        return
    if print_config:
        typer.echo(yaml.safe_dump(loaded.model_dump(mode="json"), sort_keys=False), nl=False)
        typer.echo(f"# listen.workers: {count} process{'es' if count > 1 else ''} here")
        return
    try:
        if embedded:
            output = install_handler() if demo.logging.access_log else None
            try:
                run(_serve_demo(base))
            finally:
                if output is not None:
                    output.stop()
            return
        level = log_level or loaded.logging.level  # the flag wins over the file
        logging.getLogger().setLevel(level.upper())
        if count > 1:
            announce = _announce(loaded, graphs, count)
            code = serve_workers(loaded, source, count, announce, level)
            if code:
                raise typer.Exit(code)
            return
        output = install_handler() if loaded.logging.access_log else None  # workers: one each
        try:
            run(_serve(loaded, graphs))
        finally:
            if output is not None:
                output.stop()
    except ModelyardError as error:
        raise fail(error) from None
    except OSError as error:
        raise listen_failure(error, _listeners(demo if embedded else loaded)) from None


def _listeners(config: GatewayConfig) -> list[Listener]:
    listen = config.listen
    listeners = [Listener(listen.host, listen.port, "gateway HTTP")]
    if listen.grpc_port is not None:
        listeners.append(Listener(listen.host, listen.grpc_port, "gateway OIP gRPC", grpc=True))
    return listeners


def _announce(
    config: GatewayConfig, graphs: dict[str, Graph], count: int
) -> Callable[[str, int | None], None]:
    counts = _counts(config, graphs)

    def announce(url: str, grpc_port: int | None) -> None:
        typer.echo(f"modelyard gateway listening on {url} ({counts}, {count} workers)")
        _echo_grpc(config.listen.host, grpc_port)

    return announce


async def _serve(config: GatewayConfig, graphs: dict[str, Graph]) -> None:
    gateway = await start_gateway(config, graphs=graphs)
    counts = _counts(config, graphs)
    if config.placement.scheduler:
        placed = len(gateway.app[GATEWAY].placed.models)
        counts += f", following {config.placement.scheduler}: {_count(placed, 'placed model')}"
    typer.echo(f"modelyard gateway listening on {gateway.url} ({counts})")
    _echo_grpc(gateway.host, gateway.grpc_port)
    await serve_until_signal([gateway.server], gateway.stop)


def _counts(config: GatewayConfig, graphs: dict[str, Graph]) -> str:
    """What a gateway serves, for the line that says it listens: "2 models, 1 graph"."""
    return f"{_count(len(config.models), 'model')}, {_count(len(graphs), 'graph')}"


def _echo_grpc(host: str, grpc_port: int | None) -> None:
    if grpc_port is not None:
        typer.echo(f"OIP v2 over gRPC (inference.GRPCInferenceService) on {host}:{grpc_port}")


async def _serve_demo(base: dict[str, Any]) -> None:
    # With --port 0 (tests, a second demo) the scheduler takes free ports too; its banner says which.
    any_port = base.get("listen", {}).get("port") == 0
    placement = await start_demo_placement(
        port=0 if any_port else SCHEDULER_PORT, agent_port=0 if any_port else AGENT_PORT
    )
    workers: list[tuple[str, SimWorker]] = []

    async def stop_workers() -> None:
        await placement.stop()  # agents, then the scheduler, then its workers
        for _name, worker in workers:
            await worker.stop()

    try:
        workers = await start_demo_workers()
        gateway = await start_gateway(demo_config(workers, base, placement))
    except BaseException:
        await stop_workers()
        raise
    typer.echo(demo_banner(gateway.url, workers, placement))
    _echo_grpc(gateway.host, gateway.grpc_port)

    async def stop() -> None:
        await gateway.stop()
        await stop_workers()

    await serve_until_signal([gateway.server], stop)


@config_app.command("validate")
def validate(files: Annotated[list[Path], typer.Argument(help="Config files to check.")]) -> None:
    """Check config files; print every error with its field path. Exit 1 if any file is invalid."""
    failed = False
    for file in files:
        try:
            config = load_config(file)  # with the MODELYARD_* variables, as serve reads it
            graphs = load_config_graphs(config, str(file))
        except ConfigError as error:
            failed = True
            fail(error)  # the file's problems name the file; a variable's, the variable
        else:
            typer.echo(f"{file}: ok ({_count(len(config.models), 'model')}, {_count(len(graphs), 'graph')})")
    if failed:
        raise typer.Exit(1)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
