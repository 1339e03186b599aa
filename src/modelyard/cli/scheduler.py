"""`modelyard scheduler`: the placement control plane, until Ctrl-C or SIGTERM.

Security options (docs/placement.md, "Securing the scheduler"): --tls-cert/--tls-key serve both
ports over TLS; --tokens-file and --tls-client-ca guard the REST API; --agent-ca (mutual TLS) and
--agent-tokens-file guard the agent port. On an address other than loopback it refuses to start
without them unless --insecure. A problem with any file is one line naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.telemetry import OtlpEndpointOption, SampleRatioOption, telemetry_config
from modelyard.cli.tls import TlsCertOption, TlsKeyOption, tls_server_config
from modelyard.errors import ConfigError, ModelyardError
from modelyard.scheduler import SchedulerConfig, start_scheduler
from modelyard.scheduler.config import DEFAULT_DB, DEFAULT_RESYNC_TIMEOUT
from modelyard.serving import run, serve_until_signal

TOKENS_ENV = "MODELYARD_SCHEDULER_TOKENS_FILE"


def scheduler(
    host: Annotated[
        str, typer.Option(help="Address of the REST API and the agents' gRPC service.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="REST API and gateway feed port; 0 picks a free one.")] = 9004,
    agent_port: Annotated[int, typer.Option(help="gRPC AgentService port; 0 picks a free one.")] = 9005,
    db: Annotated[str, typer.Option(help="SQLite database file (':memory:' keeps nothing).")] = DEFAULT_DB,
    resync_timeout: Annotated[
        float,
        typer.Option(
            help="After a restart, seconds to wait for the known replicas before placing without them "
            "(it ends as soon as all are back)."
        ),
    ] = DEFAULT_RESYNC_TIMEOUT,
    retry_interval: Annotated[float, typer.Option(help="Seconds between retries of failed models.")] = 10.0,
    autoscaling: Annotated[
        bool,
        typer.Option(
            "--autoscaling/--no-autoscaling",
            help="Scale models that set min_replicas or max_replicas on lag and inactivity.",
        ),
    ] = True,
    scale_up_lag: Annotated[
        float,
        typer.Option(help="Requests in flight or queued per replica above which a model is lagging."),
    ] = 30.0,
    scale_up_window: Annotated[
        float, typer.Option(help="Seconds the lag must stay above --scale-up-lag before adding a replica.")
    ] = 5.0,
    scale_down_inactivity: Annotated[
        float, typer.Option(help="Seconds without a request before removing a replica.")
    ] = 30.0,
    scale_down_cooldown: Annotated[
        float, typer.Option(help="Seconds after any scaling of a model before it may scale down.")
    ] = 60.0,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            "--tls-client-ca",
            help="REST clients may show a certificate signed by these CAs (PEM); its URI SAN "
            "spiffe://modelyard/role/read or spiffe://modelyard/role/write gives its role, an agent's "
            "(spiffe://modelyard/server/...) is refused (required of every client unless --tokens-file).",
        ),
    ] = None,
    agent_ca: Annotated[
        str | None,
        typer.Option(
            help="Agents must show a client certificate signed by these CAs (mutual TLS) whose URI SAN "
            "names them: spiffe://modelyard/server/SERVER/replica/N, or .../server/SERVER for any replica."
        ),
    ] = None,
    tokens_file: Annotated[
        str | None,
        typer.Option(
            envvar=TOKENS_ENV,
            show_default=False,
            help="REST bearer tokens: lines 'ROLE TOKEN', ROLE read or write; # comments.",
        ),
    ] = None,
    agent_tokens_file: Annotated[
        str | None,
        typer.Option(help="Agents' join tokens: lines 'SERVER TOKEN' (sent as authorization: Bearer)."),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Start on an address other than loopback without TLS or credentials (warned).",
        ),
    ] = False,
    max_replica_memory: Annotated[
        str | None,
        typer.Option(
            help="Refuse an agent claiming more memory than this for its replica (e.g. 512Gi); "
            "default: no limit (set it to your largest replica's memory)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    otlp_endpoint: OtlpEndpointOption = None,
    trace_sample_ratio: SampleRatioOption = 1.0,
) -> None:
    """Run the scheduler: keeps models and where they are, tells agents what to load, serves the feed."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = tls_server_config(tls_cert, tls_key, tls_client_ca)
    if agent_ca and tls is None:
        _fail("--agent-ca: needs --tls-cert and --tls-key (mutual TLS is TLS)")
    security: dict[str, object] = {
        "agent_ca_file": agent_ca or "",
        "tokens_file": tokens_file or "",
        "agent_tokens_file": agent_tokens_file or "",
        "insecure": insecure,
    }
    if max_replica_memory is not None:
        security["max_replica_memory"] = max_replica_memory
    if tls is not None:
        # A token is a credential too: a client without a certificate may still send one.
        security["tls"] = tls.model_copy(update={"client_cert": "optional"}) if tokens_file else tls
    try:
        config = SchedulerConfig(
            host=host,
            port=port,
            agent_port=agent_port,
            db=db,
            resync_timeout=resync_timeout,
            retry_interval=retry_interval,
            autoscaling=autoscaling,
            scale_up_lag=scale_up_lag,
            scale_up_window=scale_up_window,
            scale_down_inactivity=scale_down_inactivity,
            scale_down_cooldown=scale_down_cooldown,
            telemetry=telemetry_config(otlp_endpoint, trace_sample_ratio),
            **security,
        )
        run(_serve(config))
    except ValidationError as error:
        problem = error.errors()[0]
        field = "--" + str(problem["loc"][0]).replace("_", "-") if problem["loc"] else "options"
        _fail(f"{field}: {problem['msg']}")
    except ConfigError as error:
        _fail(f"{error.source}: {'; '.join(error.problems)}")
    except ModelyardError as error:
        _fail(error.message)
    except OSError as error:
        listeners = [
            Listener(host, port, "scheduler REST"),
            Listener(host, agent_port, "scheduler agent gRPC", grpc=True),
        ]
        raise listen_failure(error, listeners) from None


def _fail(line: str) -> None:
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(1)


async def _serve(config: SchedulerConfig) -> None:
    running = await start_scheduler(config)
    where = f"REST and feed on {running.url}, agents on {running.agent_address}"
    typer.echo(f"modelyard scheduler: {where}, db {config.db}")
    await serve_until_signal([running.http], running.stop)
