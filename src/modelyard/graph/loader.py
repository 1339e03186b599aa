"""Reading graphs: KServe InferenceGraph manifests unchanged (one or many YAML/JSON documents),
modelyard's own `graphs:` mapping of name -> spec (the same spec shape), and a gateway config's
`graphs:` and `graph_files:` together."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.config import GatewayConfig
from modelyard.documents import DocumentError, parse_documents
from modelyard.errors import ConfigError, GraphInvalid
from modelyard.graph.engine import Graph
from modelyard.graph.validate import Report, validate_graph

API_VERSION = "serving.kserve.io/v1alpha1"
KIND = "InferenceGraph"
SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class GraphDocument:
    name: str
    spec: Any
    source: str  # file name and where in it, for messages


def load_graph_text(text: str | bytes, source: str, *, untrusted: bool = False) -> list[GraphDocument]:
    """The graphs of a file's or a request's text; `untrusted`: it came over the network."""
    try:
        documents = parse_documents(text, untrusted=untrusted)
    except DocumentError as exc:
        raise GraphInvalid(source, [str(exc)]) from None
    return graphs_in_documents(documents, source)


def graphs_in_documents(documents: list[Any], source: str) -> list[GraphDocument]:
    """The graphs of parsed documents: KServe manifests, or `graphs:` mappings."""
    found: list[GraphDocument] = []
    for index, document in enumerate(documents):
        where = source if len(documents) == 1 else f"{source} (document {index + 1})"
        found.extend(_graphs_in(document, where))
    return found


def load_graph_file(path: str | Path) -> list[GraphDocument]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise GraphInvalid(str(path), [f"cannot read file: {exc.strerror}"]) from None
    return load_graph_text(text, str(path))


def load_graph_paths(paths: Iterable[str | Path]) -> list[GraphDocument]:
    """Files, and directories (their *.yaml, *.yml and *.json files, sorted)."""
    found: list[GraphDocument] = []
    for path in map(Path, paths):
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES) if path.is_dir() else [path]
        for file in files:
            found.extend(load_graph_file(file))
    return found


def parse_graph(document: GraphDocument, *, resolved: bool = False) -> tuple[Graph, Report]:
    """Validate and compile; raises GraphInvalid listing every error (warnings come back).
    `resolved`: the spec as KServe's controller passes it to the router (see validate_graph)."""
    spec, report = validate_graph(document.name, document.spec, resolved=resolved)
    if spec is None or not report.ok:
        raise GraphInvalid(f"{document.source}: graph {document.name!r}", [str(p) for p in report.errors])
    return Graph(document.name, spec), report


def load_config_graphs(config: GatewayConfig, source: str) -> dict[str, Graph]:
    """The graphs of a gateway config (`graphs:` and `graph_files:`), each validated; every
    problem is reported in one ConfigError naming its path."""
    documents = [
        GraphDocument(name, spec, f"{source}: graphs.{name}") for name, spec in config.graphs.items()
    ]
    problems: list[str] = []
    try:
        documents += load_graph_paths(config.graph_files)
    except GraphInvalid as error:
        problems += [f"graph_files: {error.source}: {p}" for p in error.problems]
    graphs: dict[str, Graph] = {}
    for document in documents:
        try:
            graph, _report = parse_graph(document)
        except GraphInvalid as error:
            problems += [f"graphs.{document.name}.{p}" for p in error.problems]
            continue
        if graph.name in graphs:
            problems.append(f"graphs.{graph.name}: defined twice ({document.source})")
        graphs[graph.name] = graph
    if problems:
        raise ConfigError(source, problems)
    return graphs


def _graphs_in(document: Any, where: str) -> list[GraphDocument]:
    if not isinstance(document, dict):
        raise GraphInvalid(where, [f"expected a mapping, got {type(document).__name__}"])
    if "kind" in document or "apiVersion" in document:
        problems = []
        if document.get("apiVersion") != API_VERSION:
            problems.append(f"apiVersion: expected {API_VERSION!r}, got {document.get('apiVersion')!r}")
        if document.get("kind") != KIND:
            problems.append(f"kind: expected {KIND!r}, got {document.get('kind')!r}")
        metadata = document.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if not isinstance(name, str) or not name:
            problems.append("metadata.name: required")
        if "spec" not in document:
            problems.append("spec: required")
        if problems:
            raise GraphInvalid(where, problems)
        return [GraphDocument(str(name), document["spec"], where)]
    graphs = document.get("graphs")
    if not isinstance(graphs, dict):
        raise GraphInvalid(
            where,
            [
                f"expected a KServe InferenceGraph manifest (apiVersion: {API_VERSION})"
                " or a 'graphs:' mapping of name -> spec"
            ],
        )
    return [GraphDocument(str(name), spec, where) for name, spec in graphs.items()]
