"""`modelyard agent`: run the agent beside one inference-server replica until interrupted.

Security options (docs/placement.md, "Securing agents"): --scheduler-ca (TLS to the scheduler,
verified with it), --cert/--key (the agent's client certificate: mutual TLS), --scheduler-name, a
join token from --token-file or MODELYARD_AGENT_TOKEN (never logged), --tls-cert/--tls-key/
--tls-client-ca for the data plane. Plain text only on loopback unless --insecure. A problem with
any file is one line naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.agent import Agent, AgentConfig
from modelyard.agent.artefacts import fetch_policy
from modelyard.agent.config import check_exposure
from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.telemetry import OtlpEndpointOption, SampleRatioOption, telemetry_config
from modelyard.cli.tls import TlsCertOption, TlsClientCaOption, TlsKeyOption, tls_server_config
from modelyard.config import TlsClientConfig
from modelyard.errors import ConfigError, ModelyardError
from modelyard.kube.podinfo import PodInfoError, capabilities_from_labels, labels_from_file_text
from modelyard.serving import run, serve_until_signal

TOKEN_ENV = "MODELYARD_AGENT_TOKEN"
_FLAGS = {
    "fetch_roots": "--fetch-root",
    "fetch_networks": "--fetch-network",
    "fetch_credentials": "--fetch-bearer-token/--fetch-basic-auth",
    "server_name": "--server",
    "replica_idx": "--replica",
    "memory_bytes": "--memory",
    "unload_grace": "--unload-grace",
    "scheduler_token": TOKEN_ENV,
    "scheduler_token_file": "--token-file",
    "tls": "--tls-cert",
    "scheduler_tls": "--scheduler-ca/--cert/--key",
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
    scheduler_ca: Annotated[
        Path | None,
        typer.Option(
            help="Connect to the scheduler over TLS, verifying it with these CA certificates (PEM)."
        ),
    ] = None,
    cert: Annotated[
        Path | None,
        typer.Option(
            help="This agent's client certificate (PEM) for mutual TLS to the scheduler (implies TLS); "
            "its URI SAN names it: spiffe://modelyard/server/SERVER/replica/N (or .../server/SERVER). "
            "With --key; read again when it changes."
        ),
    ] = None,
    key: Annotated[Path | None, typer.Option(help="The client certificate's private key (PEM).")] = None,
    scheduler_name: Annotated[
        str | None,
        typer.Option(
            help="The name the scheduler's certificate must have, when --scheduler's host is not it "
            "(an IP address)."
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help=f"A file holding the join token sent to the scheduler (default: ${TOKEN_ENV}); read "
            "again when it changes. Never logged."
        ),
    ] = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: TlsClientCaOption = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Start although the data plane listens on an address other than loopback without TLS, "
            "or the scheduler is elsewhere and reached without TLS and a credential (warned).",
        ),
    ] = False,
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

    To a scheduler on another machine the agent connects over TLS (--scheduler-ca) with a
    credential: its client certificate (--cert, --key) or a join token (--token-file, or the
    environment variable MODELYARD_AGENT_TOKEN). Its data plane serves TLS with --tls-cert and
    --tls-key, and forwards inference requests only: the server's repository and admin paths are
    not reachable through it. Without TLS it starts on loopback only, unless --insecure.
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
    tls = tls_server_config(tls_cert, tls_key, tls_client_ca)
    scheduler_tls = _scheduler_tls(scheduler_ca, cert, key, scheduler_name)
    token = os.environ.get(TOKEN_ENV, "").strip() if token_file is None else ""
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
            tls=tls,
            scheduler_tls=scheduler_tls,
            scheduler_token=token or None,
            scheduler_token_file=token_file,
            insecure=insecure,
        )
        fetch_policy(config)  # the credential and CA files are there and readable
        check_exposure(config)  # plain text only on loopback
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


def _scheduler_tls(
    ca: Path | None, cert: Path | None, key: Path | None, name: str | None
) -> TlsClientConfig | None:
    """The scheduler flags as a TlsClientConfig (None: plain text); half a pair is one line."""
    if (cert is None) != (key is None):
        typer.echo("error: agent options: --cert and --key go together", err=True)
        raise typer.Exit(1)
    if ca is None and cert is None:
        if name is not None:
            typer.echo(
                "error: agent options: --scheduler-name: needs --scheduler-ca or --cert (TLS)", err=True
            )
            raise typer.Exit(1)
        return None
    return TlsClientConfig(
        ca_file=str(ca or ""), cert_file=str(cert or ""), key_file=str(key or ""), server_name=name or ""
    )


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
        + (" over TLS" if config.scheduler_tls is not None else "")
    )

    async def drain() -> None:
        try:
            await agent.drain(deadline=drain_timeout)
        except ModelyardError as error:  # the scheduler refused it: stop anyway, the pod is going
            logging.getLogger("modelyard.agent").warning("drain: %s", error.message)

    await serve_until_signal([], agent.stop, drain)
