"""`modelyard agent`: run the agent beside one inference-server replica until interrupted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.agent import Agent, AgentConfig
from modelyard.agent.artefacts import fetch_policy
from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.telemetry import OtlpEndpointOption, SampleRatioOption, telemetry_config
from modelyard.errors import ConfigError, ModelyardError
from modelyard.kube.podinfo import PodInfoError, capabilities_from_labels, labels_from_file_text
from modelyard.serving import run, serve_until_signal

_FLAGS = {
    "fetch_roots": "--fetch-root",
    "fetch_networks": "--fetch-network",
    "fetch_credentials": "--fetch-bearer-token/--fetch-basic-auth",
    "server_name": "--server",
    "replica_idx": "--replica",
    "memory_bytes": "--memory",
    "unload_grace": "--unload-grace",
}


def agent(
    scheduler: Annotated[str, typer.Option(help="The scheduler's agent port, HOST:PORT.")],
    server: Annotated[str, typer.Option(help="Name of the server (group of replicas) this replica is in.")],
    inference_url: Annotated[str, typer.Option(help="The inference server, http://HOST:PORT.")],
    memory: Annotated[
        str,
        typer.Option(
            help="Memory this replica offers for models: bytes or a quantity such as 1Gi or 500M "
            "(placement reserves each model's memory against it)."
        ),
    ],
    replica: Annotated[int, typer.Option(help="This replica's index in its server.")] = 0,
    capabilities: Annotated[
        str, typer.Option(help="Comma-separated capabilities, matched against model requirements.")
    ] = "",
    capabilities_from: Annotated[
        Path | None,
        typer.Option(
            help="A Downward API labels file (Kubernetes): each label capability.modelyard.io/NAME "
            'set to "true" adds capability NAME.'
        ),
    ] = None,
    overcommit_percent: Annotated[
        int, typer.Option(help="How far beyond --memory the scheduler may place models, percent.")
    ] = 0,
    repository: Annotated[
        Path | None,
        typer.Option(help="The server's model repository dir; each model's storageUri is fetched into it."),
    ] = None,
    unload_grace: Annotated[
        float, typer.Option(help="Seconds to wait before an unload, so routes drain first.")
    ] = 2.0,
    keep_existing: Annotated[
        bool,
        typer.Option(
            "--keep-existing", help="Leave models the server serves at start (default: unload them)."
        ),
    ] = False,
    host: Annotated[str, typer.Option(help="Where the agent's data plane listens.")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            help="The data plane's port: the gateway sends this replica's requests here and the agent "
            "forwards them to the server (0: any free port, printed at start)."
        ),
    ] = 9999,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="The data plane's URL as gateways reach it, when not http://HOST:PORT "
            "(e.g. the pod's address when listening on 0.0.0.0)."
        ),
    ] = None,
    room_timeout: Annotated[
        float,
        typer.Option(
            help="How long a load, or a request for an evicted model, waits for models serving "
            "requests to free memory before it fails, seconds."
        ),
    ] = 60.0,
    drain_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM or SIGINT: seconds to wait for the scheduler to move this replica's "
            "models elsewhere before stopping (a second signal stops at once)."
        ),
    ] = 60.0,
    fetch_root: Annotated[
        list[Path] | None,
        typer.Option(
            help="A directory a local storageUri may name, beside --repository (repeatable). Default: "
            "only the repository; links and .. are resolved before the check."
        ),
    ] = None,
    fetch_schemes: Annotated[
        str,
        typer.Option(help="storageUri schemes fetched, comma-separated (file: local paths too)."),
    ] = "file,http,https,s3,gs",
    max_artefact_bytes: Annotated[
        str,
        typer.Option(
            help="Bound on one model's files (downloaded, copied or unpacked), counted as they arrive: "
            "bytes or a quantity such as 40Gi."
        ),
    ] = "4Gi",
    fetch_timeout: Annotated[float, typer.Option(help="Bound on one model's fetch, seconds.")] = 1800.0,
    allow_private_fetch: Annotated[
        bool,
        typer.Option(
            "--allow-private-fetch",
            help="Let downloads reach loopback, private and link-local addresses (never cloud metadata "
            "endpoints, which only --fetch-network allows).",
        ),
    ] = False,
    fetch_network: Annotated[
        list[str] | None,
        typer.Option(help="A network downloads may reach although it is not global, CIDR (repeatable)."),
    ] = None,
    fetch_ca_file: Annotated[
        Path | None,
        typer.Option(
            help="CA certificates (PEM) https downloads are verified with, instead of the system's; "
            "reloaded when the file changes."
        ),
    ] = None,
    fetch_bearer_token: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST=FILE: send the token in FILE (read at each download) to HOST[:PORT], over https "
            "only (repeatable)."
        ),
    ] = None,
    fetch_basic_auth: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST=FILE: send USER:PASSWORD from FILE as basic auth to HOST[:PORT], over https only "
            "(repeatable)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    otlp_endpoint: OtlpEndpointOption = None,
    trace_sample_ratio: SampleRatioOption = 1.0,
) -> None:
    """Load and unload models on one inference server (MLServer, Triton, sim-worker) as the scheduler says.

    The agent waits for the server to be live, unloads what it serves (unless --keep-existing),
    subscribes to the scheduler and reconnects with backoff whenever the stream breaks. Requests
    reach the server through the agent (--port), which counts them per model; with
    --overcommit-percent it keeps models beyond --memory registered but evicted, and loads one
    again (evicting the least recently used idle ones) when a request needs it. On SIGTERM
    or SIGINT it drains: the scheduler moves its models elsewhere, and it exits once they serve
    there (at most --drain-timeout seconds).

    With --repository, each model's storageUri is fetched into it: a local path only inside the
    repository or a --fetch-root (regular files and directories only), a download only from
    global addresses unless --allow-private-fetch or --fetch-network says otherwise, at most
    --max-artefact-bytes per model; an unload stops a fetch under way. Credentials come from
    the flags' files (https) or fsspec's environment (s3, gs), never from a model.
    """
    if not drain_timeout > 0:
        typer.echo(f"error: agent options: --drain-timeout: must be above 0, got {drain_timeout:g}", err=True)
        raise typer.Exit(1)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if capabilities_from is not None:
        try:
            labelled = capabilities_from_labels(labels_from_file_text(capabilities_from.read_text()))
        except (OSError, PodInfoError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            typer.echo(f"error: agent options: --capabilities-from: {capabilities_from}: {why}", err=True)
            raise typer.Exit(1) from None
        capabilities = ",".join([c for c in capabilities.split(",") if c.strip()] + labelled)
    try:
        config = AgentConfig(
            scheduler=scheduler,
            server_name=server,
            replica_idx=replica,
            inference_url=inference_url,
            memory_bytes=memory,  # a quantity string: AgentConfig parses it
            capabilities=capabilities,  # comma-separated: AgentConfig splits it
            overcommit_percent=overcommit_percent,
            repository=repository,
            unload_grace=unload_grace,
            keep_existing=keep_existing,
            host=host,
            port=port,
            advertise_url=advertise_url,
            room_timeout=room_timeout,
            telemetry=telemetry_config(otlp_endpoint, trace_sample_ratio),
            fetch_roots=tuple(fetch_root or ()),
            fetch_schemes=fetch_schemes,  # comma-separated: AgentConfig splits it
            max_artefact_bytes=max_artefact_bytes,  # a quantity string: AgentConfig parses it
            fetch_timeout=fetch_timeout,
            allow_private_fetch=allow_private_fetch,
            fetch_networks=tuple(fetch_network or ()),
            fetch_ca_file=fetch_ca_file,
            fetch_credentials=_credentials(fetch_bearer_token, fetch_basic_auth),
        )
        fetch_policy(config)  # the credential and CA files are there and readable
    except ValidationError as exc:
        problems = "; ".join(
            f"{_flag(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        )
        typer.echo(f"error: agent options: {problems}", err=True)
        raise typer.Exit(1) from None
    except ConfigError as error:
        typer.echo(f"error: agent options: {'; '.join(error.problems)}", err=True)
        raise typer.Exit(1) from None
    try:
        run(_run(config, drain_timeout))
    except ModelyardError as error:
        typer.echo(f"error: agent: {error.message}", err=True)
        raise typer.Exit(1) from None
    except OSError as error:
        raise listen_failure(error, [Listener(host, port, "agent data plane")]) from None


def _credentials(bearer: list[str] | None, basic: list[str] | None) -> list[dict[str, str]]:
    """--fetch-bearer-token and --fetch-basic-auth (HOST=FILE) as AgentConfig's fetch_credentials."""
    credentials = []
    for flag, field, pairs in (
        ("--fetch-bearer-token", "bearer_token_file", bearer),
        ("--fetch-basic-auth", "basic_auth_file", basic),
    ):
        for pair in pairs or []:
            host, sep, file = pair.partition("=")
            if not sep or not host or not file:
                typer.echo(f"error: agent options: {flag}: expected HOST=FILE, got {pair!r}", err=True)
                raise typer.Exit(1)
            credentials.append({"host": host, field: file})
    return credentials


def _flag(loc: tuple[int | str, ...]) -> str:
    field = str(loc[0]) if loc else "?"
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


async def _run(config: AgentConfig, drain_timeout: float) -> None:
    agent = Agent(config)
    await agent.start()
    typer.echo(
        f"agent for {config.server_name}-{config.replica_idx} ({config.inference_url}) "
        f"serving on {agent.url}, subscribing to {config.scheduler}"
    )

    async def drain() -> None:
        try:
            await agent.drain(deadline=drain_timeout)
        except ModelyardError as error:  # the scheduler refused it: stop anyway, the pod is going
            logging.getLogger("modelyard.agent").warning("drain: %s", error.message)

    await serve_until_signal([], agent.stop, drain)
