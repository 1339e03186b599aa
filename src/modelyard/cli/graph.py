"""`modelyard graph validate | run | serve | deploy`."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from pathlib import Path
from typing import Annotated

import orjson
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelyard import __version__
from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.problems import fail
from modelyard.cli.telemetry import OtlpEndpointOption, SampleRatioOption, telemetry_config
from modelyard.cli.tls import TlsCertOption, TlsClientCaOption, TlsKeyOption, tls_server_config
from modelyard.documents import DocumentError, parse_documents
from modelyard.errors import ConfigError, GraphInvalid, ModelyardError
from modelyard.graph import (
    Graph,
    GraphFailure,
    RunContext,
    StepTrace,
    answer,
    load_graph_paths,
    parse_graph,
)
from modelyard.graph.headers import compile_patterns
from modelyard.graph.loader import graphs_in_documents, load_graph_text
from modelyard.graphrouter import start_router
from modelyard.kube.graph import graph_manifests, resolve_services
from modelyard.kube.render import dump
from modelyard.serving import run as run_loop
from modelyard.serving import serve_until_signal
from modelyard.telemetry import build_tracer
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client

app = typer.Typer(no_args_is_help=True, help="Inference graphs (KServe InferenceGraph compatible).")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

ServiceOption = Annotated[
    list[str] | None,
    typer.Option(
        "--service", help="Resolve a step's serviceName: NAME=URL (repeatable), as KServe's controller does."
    ),
]


def _services(pairs: list[str] | None) -> dict[str, str]:
    services = {}
    for pair in pairs or []:
        name, sep, url = pair.partition("=")
        if not sep or not name or not url:
            err.print("[red]error:[/red] " + escape(f"--service expects NAME=URL, got {pair!r}"))
            raise typer.Exit(2)
        services[name] = url
    return services


def _fail(error: GraphInvalid) -> typer.Exit:
    for problem in error.problems:
        err.print("[red]error:[/red] " + escape(f"{error.source}: {problem}"), soft_wrap=True)
    return typer.Exit(1)


def _unresolved(graph: Graph, services: dict[str, str]) -> list[str]:
    return sorted(
        {
            step.service_name
            for node in graph.spec.nodes.values()
            for step in node.steps
            if step.service_name and not step.service_url and step.service_name not in services
        }
    )


@app.command("validate")
def validate(files: Annotated[list[Path], typer.Argument(help="Graph files or directories.")]) -> None:
    """Check graphs (KServe manifests or a `graphs:` mapping); print every error and warning with its path."""
    failed = False
    for file in files:
        try:
            documents = load_graph_paths([file])
        except GraphInvalid as error:
            failed = True
            _fail(error)
            continue
        for document in documents:
            try:
                _graph, report = parse_graph(document)
            except GraphInvalid as error:
                failed = True
                _fail(error)
                continue
            for warning in report.warnings:
                err.print(
                    "[yellow]warning:[/yellow] "
                    + escape(f"{document.source}: graph {document.name!r}: {warning}"),
                    soft_wrap=True,
                )
            out.print(escape(f"{document.source}: graph {document.name!r}: ok"))
    if failed:
        raise typer.Exit(1)


@app.command("run")
def run(
    file: Annotated[Path, typer.Argument(help="Graph file.")],
    data: Annotated[str, typer.Option("--data", "-d", help="The request body (JSON text, or @FILE).")],
    name: Annotated[str | None, typer.Option(help="Which graph, when the file holds several.")] = None,
    service: ServiceOption = None,
) -> None:
    """Run a graph once against real services; print the answer and the trace of every step."""
    services = _services(service)
    try:
        body = Path(data[1:]).read_bytes() if data.startswith("@") else data.encode()
    except OSError as exc:
        err.print("[red]error:[/red] " + escape(f"--data {data}: {exc.strerror}"))
        raise typer.Exit(1) from None
    try:
        documents = load_graph_paths([file])
        chosen = [d for d in documents if name is None or d.name == name]
        if len(chosen) != 1:
            names = ", ".join(d.name for d in documents)
            err.print("[red]error:[/red] " + escape(f"{file}: choose one graph with --name ({names})"))
            raise typer.Exit(2)
        graph, _ = parse_graph(chosen[0])
        missing = _unresolved(graph, services)
    except GraphInvalid as error:
        raise _fail(error) from None
    if missing:
        err.print(
            "[red]error:[/red] "
            + escape(f"serviceName without a URL: {', '.join(missing)}; pass --service NAME=URL")
        )
        raise typer.Exit(1)

    async def once() -> tuple[int, bytes, list[StepTrace]]:
        client = Http1Client(max_connections=64, connect_timeout=10.0)
        trace: list[StepTrace] = []
        ctx = RunContext(UrlInvoker(client, services=services), [], random.SystemRandom(), trace)
        try:
            written = answer(await graph.run(body, ctx))
        except GraphFailure as failure:
            written = answer(failure)
        finally:
            client.close()
        return written.status, written.body, trace

    status, reply, trace = asyncio.run(once())
    table = Table("node", "step", "target", "status", "ms", title=f"graph {graph.name!r}: {status}")
    for step in trace:
        table.add_row(step.node, step.step, step.target, str(step.status), f"{step.ms:.2f}")
    err.print(table)
    typer.echo(reply.decode("utf-8", "replace"))
    if not 200 <= status < 300:
        raise typer.Exit(1)


@app.command("serve")
def serve(
    graph_json: Annotated[
        str, typer.Option("--graph-json", help="The InferenceGraph spec as JSON (KServe's router flag).")
    ],
    port: Annotated[int, typer.Option(min=0, max=65535, help="Listen port (KServe's router: 8080).")] = 8080,
    host: Annotated[str, typer.Option(help="Listen address.")] = "0.0.0.0",
    name: Annotated[
        str, typer.Option("--inferencegraph-name", help="The graph's name (for messages).")
    ] = "graph",
    service: ServiceOption = None,
    drain_seconds: Annotated[
        float, typer.Option(help="After SIGTERM: seconds /readyz answers 503 before exit.")
    ] = 30.0,
    otlp_endpoint: OtlpEndpointOption = None,
    trace_sample_ratio: SampleRatioOption = 1.0,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: TlsClientCaOption = None,
) -> None:
    """KServe's router container, as a drop-in: any path runs the graph; /readyz; PROPAGATE_HEADERS."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    telemetry = telemetry_config(otlp_endpoint, trace_sample_ratio)
    services = _services(service)
    try:
        spec = orjson.loads(graph_json)
    except orjson.JSONDecodeError as exc:
        err.print("[red]error:[/red] " + escape(f"--graph-json is not valid JSON: {exc}"))
        raise typer.Exit(1) from None
    # KServe passes the spec; a whole InferenceGraph manifest is taken too (its spec is used).
    wrapped = spec if isinstance(spec, dict) and "kind" in spec else {"graphs": {name: spec}}
    try:
        (document,) = load_graph_text(orjson.dumps(wrapped).decode(), "--graph-json")
        graph, report = parse_graph(document, resolved=True)
        missing = _unresolved(graph, services)
    except GraphInvalid as error:
        raise _fail(error) from None
    for warning in report.warnings:
        err.print("[yellow]warning:[/yellow] " + escape(f"{warning}"), soft_wrap=True)
    if missing:
        err.print(
            "[red]error:[/red] "
            + escape(f"serviceName without a URL: {', '.join(missing)}; pass --service NAME=URL")
        )
        raise typer.Exit(1)
    patterns = compile_patterns(os.environ.get("PROPAGATE_HEADERS"))
    tls = tls_server_config(tls_cert, tls_key, tls_client_ca)

    async def main() -> None:
        router = await start_router(
            graph,
            host=host,
            port=port,
            services=services,
            patterns=patterns,
            drain_seconds=drain_seconds,
            tracer=build_tracer(telemetry, "modelyard-graph-router"),
            tls=tls,
        )
        typer.echo(f"graph router listening on {router.url} (graph {graph.name!r})")
        await serve_until_signal([router.server], router.stop)

    try:
        run_loop(main())
    except ModelyardError as error:  # a certificate file that cannot be used
        raise fail(error) from None
    except OSError as exc:
        raise listen_failure(exc, [Listener(host, port, "graph router")]) from None


@app.command("deploy")
def deploy(
    file: Annotated[Path, typer.Argument(help="InferenceGraph manifest(s), as given to KServe.")],
    image: Annotated[
        str, typer.Option(help="The router image: modelyard's.")
    ] = f"ghcr.io/modelyard/modelyard:{__version__}",
    namespace: Annotated[
        str | None, typer.Option(help="Namespace (default: the manifest's, else 'default').")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Only this graph, when the file holds several.")] = None,
    service: ServiceOption = None,
    protocol: Annotated[
        str,
        typer.Option(
            help="Path for a serviceName step with no --service: v1 (/v1/models/N:predict) or v2 "
            "(/v2/models/N/infer), as the InferenceService speaks."
        ),
    ] = "v1",
    propagate_header: Annotated[
        list[str] | None,
        typer.Option(help="A header (regex) every step gets: the router's PROPAGATE_HEADERS (repeatable)."),
    ] = None,
    otlp_endpoint: Annotated[
        str | None, typer.Option(help="The router traces to this OTLP/HTTP endpoint (default: off).")
    ] = None,
) -> None:
    """Print the Deployment, Service and HPA KServe's raw deployment mode makes for each graph,
    with `modelyard graph serve` as the router: kubectl apply -f - runs it on any cluster."""
    if protocol not in ("v1", "v2"):
        err.print("[red]error:[/red] " + escape(f"--protocol: expected v1 or v2, got {protocol!r}"))
        raise typer.Exit(2)
    services = _services(service)
    tracing = telemetry_config(otlp_endpoint, 1.0).otlp_endpoint  # checked before anything is printed
    try:
        documents = parse_documents(file.read_text())
    except OSError as exc:
        err.print("[red]error:[/red] " + escape(f"{file}: cannot read file: {exc.strerror}"))
        raise typer.Exit(1) from None
    except DocumentError as exc:
        err.print("[red]error:[/red] " + escape(f"{file}: {exc}"))
        raise typer.Exit(1) from None
    manifests = []
    try:
        for index, document in enumerate(documents):
            where = str(file) if len(documents) == 1 else f"{file} (document {index + 1})"
            metadata = document.get("metadata") if isinstance(document, dict) and "kind" in document else None
            for graph_document in graphs_in_documents([document], where):
                if name is not None and graph_document.name != name:
                    continue
                parse_graph(graph_document)  # every problem reported before anything is printed
                meta = metadata if isinstance(metadata, dict) else {}
                graph_namespace = namespace or str(meta.get("namespace") or "default")
                spec, guessed = resolve_services(graph_document.spec, graph_namespace, services, protocol)
                for guess in guessed:
                    err.print(
                        "[yellow]warning:[/yellow] "
                        + escape(
                            f"{where}: graph {graph_document.name!r}: serviceName {guess!r} goes to its "
                            f"InferenceService's predictor in {graph_namespace!r} (KServe's raw-mode "
                            f"address); pass --service {guess}=URL for another"
                        ),
                        soft_wrap=True,
                    )
                manifests += graph_manifests(
                    graph_document.name,
                    spec,
                    meta,
                    image=image,
                    namespace=graph_namespace,
                    propagate_headers=propagate_header,
                    otlp_endpoint=tracing,
                    source=where,
                )
    except GraphInvalid as error:
        raise _fail(error) from None
    except ConfigError as error:
        raise fail(error) from None
    if not manifests:
        err.print("[red]error:[/red] " + escape(f"{file}: no graph" + (f" named {name!r}" if name else "")))
        raise typer.Exit(1)
    typer.echo(dump(manifests), nl=False)
