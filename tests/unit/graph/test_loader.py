"""Reading graph files: KServe manifests unchanged, multi-document files, a `graphs:` mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.config import GatewayConfig
from modelyard.errors import ConfigError, GraphInvalid
from modelyard.graph import (
    GraphDocument,
    load_config_graphs,
    load_graph_file,
    load_graph_paths,
    load_graph_text,
    parse_graph,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "graphs"
VALID = FIXTURES / "valid"
INVALID = FIXTURES / "invalid"


def test_kserve_manifest_is_read_unchanged() -> None:
    (document,) = load_graph_file(VALID / "kserve-sequence.yaml")
    assert document.name == "doubler-chain"
    assert document.source == str(VALID / "kserve-sequence.yaml")
    graph, report = parse_graph(document)
    assert report.ok and not report.warnings
    steps = graph.spec.nodes["root"].steps
    assert graph.spec.nodes["root"].router_type == "Sequence"
    assert [s.name for s in steps] == ["first", "second"]
    assert steps[1].data == "$response"
    assert steps[1].map_predictions_to_instances is True
    assert steps[1].hard and not steps[0].hard
    assert steps[0].service_name == "doubler"


def test_json_manifest() -> None:
    (document,) = load_graph_file(VALID / "manifest.json")
    assert document.name == "json-graph"
    graph, _ = parse_graph(document)
    assert graph.spec.nodes["root"].steps[0].service_url.endswith("/v1/models/m:predict")


def test_multi_document_file_gives_every_graph_with_its_document_number() -> None:
    documents = load_graph_file(VALID / "multi.yaml")
    assert [d.name for d in documents] == ["switch-graph", "splitter-graph"]
    assert documents[0].source == f"{VALID / 'multi.yaml'} (document 1)"
    assert documents[1].source == f"{VALID / 'multi.yaml'} (document 2)"
    splitter, _ = parse_graph(documents[1])
    assert [s.weight for s in splitter.spec.nodes["root"].steps] == [70, 30]


def test_graphs_mapping() -> None:
    documents = load_graph_file(VALID / "mapping.yaml")
    assert [d.name for d in documents] == ["ensemble-graph", "nested-graph"]
    nested, report = parse_graph(documents[1])
    assert report.ok
    assert set(nested.spec.nodes) == {"root", "ensemble"}


def test_empty_documents_are_skipped() -> None:
    text = "---\n---\ngraphs:\n  g:\n    nodes:\n      root: {routerType: Ensemble}\n---\n"
    (document,) = load_graph_text(text, "x.yaml")
    assert document == GraphDocument("g", {"nodes": {"root": {"routerType": "Ensemble"}}}, "x.yaml")


def test_directory_loads_yaml_and_json_files_sorted() -> None:
    documents = load_graph_paths([VALID])
    assert [d.name for d in documents] == [
        "doubler-chain",  # kserve-sequence.yaml
        "json-graph",  # manifest.json
        "ensemble-graph",  # mapping.yaml
        "nested-graph",
        "switch-graph",  # multi.yaml
        "splitter-graph",
    ]


def test_directory_ignores_other_suffixes(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a graph")
    (tmp_path / "b.yml").write_text("graphs: {b: {nodes: {root: {routerType: Ensemble}}}}")
    (tmp_path / "a.json").write_text('{"graphs": {"a": {"nodes": {"root": {"routerType": "Ensemble"}}}}}')
    assert [d.name for d in load_graph_paths([tmp_path])] == ["a", "b"]


def _problems(path: Path) -> tuple[str, list[str]]:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_file(path)
    return caught.value.source, caught.value.problems


def test_wrong_api_version_and_kind() -> None:
    source, problems = _problems(INVALID / "wrong-kind.yaml")
    assert source == str(INVALID / "wrong-kind.yaml")
    assert problems == [
        "apiVersion: expected 'serving.kserve.io/v1alpha1', got 'serving.kserve.io/v1beta1'",
        "kind: expected 'InferenceGraph', got 'InferenceService'",
    ]


def test_missing_metadata_name() -> None:
    _, problems = _problems(INVALID / "missing-name.yaml")
    assert problems == ["metadata.name: required"]


def test_manifest_without_spec_or_metadata() -> None:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_text("apiVersion: serving.kserve.io/v1alpha1\nkind: InferenceGraph\n", "m.yaml")
    assert caught.value.problems == ["metadata.name: required", "spec: required"]


def test_yaml_syntax_error_names_the_line() -> None:
    source, (problem,) = _problems(INVALID / "syntax-error.yaml")
    assert source == str(INVALID / "syntax-error.yaml")
    assert problem.startswith("line 8, column 1: invalid YAML: ")


def test_yaml_syntax_error_in_text() -> None:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_text("graphs:\n  g: {nodes: [\n  bad: : :\n", "inline.yaml")
    (problem,) = caught.value.problems
    assert problem.startswith("line ")
    assert "invalid YAML" in problem
    assert str(caught.value).startswith("inline.yaml: line ")


def test_document_that_is_neither_shape() -> None:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_text("models: []\n", "other.yaml")
    assert caught.value.problems == [
        "expected a KServe InferenceGraph manifest (apiVersion: serving.kserve.io/v1alpha1) "
        "or a 'graphs:' mapping of name -> spec"
    ]


def test_document_that_is_not_a_mapping_names_its_document() -> None:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_text("graphs: {}\n---\n- a\n- b\n", "list.yaml")
    assert caught.value.source == "list.yaml (document 2)"
    assert caught.value.problems == ["expected a mapping, got list"]


def test_missing_file() -> None:
    with pytest.raises(GraphInvalid) as caught:
        load_graph_file(FIXTURES / "does-not-exist.yaml")
    assert caught.value.problems == ["cannot read file: No such file or directory"]


def test_parse_graph_lists_every_error_with_the_source() -> None:
    (document,) = load_graph_file(INVALID / "cycle.yaml")
    with pytest.raises(GraphInvalid) as caught:
        parse_graph(document)
    assert caught.value.source == f"{INVALID / 'cycle.yaml'}: graph 'loop'"
    assert caught.value.problems == ["nodes.root: cycle: root -> a -> root"]


def test_parse_graph_returns_warnings() -> None:
    (document,) = load_graph_file(FIXTURES / "warnings.yaml")
    _graph, report = parse_graph(document)
    assert report.ok
    assert [str(w) for w in report.warnings] == [
        "nodes.root.steps[0].condition: missing: this Switch step can never be chosen",
        "nodes.root.steps[0].weight: ignored: only a Splitter uses weights, this is a Switch",
        "nodes.orphan: unreachable from root: it never runs",
    ]


# --- a gateway config's graphs: the `graphs:` mapping and `graph_files:` together -----------------

ONE_STEP = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceUrl": "http://a/"}]}}}


def test_config_graphs_come_from_the_mapping_and_the_files() -> None:
    config = GatewayConfig(graphs={"inline": ONE_STEP}, graph_files=[str(VALID / "mapping.yaml")])
    graphs = load_config_graphs(config, "gw.yaml")
    assert sorted(graphs) == ["ensemble-graph", "inline", "nested-graph"]
    assert graphs["inline"].name == "inline"
    assert graphs["inline"].spec.nodes["root"].steps[0].service_url == "http://a/"


def test_config_graphs_report_every_problem_with_its_path() -> None:
    missing = FIXTURES / "does-not-exist.yaml"
    config = GatewayConfig(
        graphs={"empty": {"nodes": {"root": {"routerType": "Sequence"}}}, "fine": ONE_STEP},
        graph_files=[str(missing)],
    )
    with pytest.raises(ConfigError) as caught:
        load_config_graphs(config, "gw.yaml")
    assert caught.value.source == "gw.yaml"
    assert caught.value.problems == [
        f"graph_files: {missing}: cannot read file: No such file or directory",
        "graphs.empty.nodes.root.steps: a Sequence needs at least one step (KServe drops the connection)",
    ]


def test_a_config_graph_defined_twice_names_the_second_source() -> None:
    config = GatewayConfig(graphs={"ensemble-graph": ONE_STEP}, graph_files=[str(VALID / "mapping.yaml")])
    with pytest.raises(ConfigError) as caught:
        load_config_graphs(config, "gw.yaml")
    assert caught.value.problems == [f"graphs.ensemble-graph: defined twice ({VALID / 'mapping.yaml'})"]
