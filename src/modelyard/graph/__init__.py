"""Inference graphs: KServe InferenceGraph-compatible DAGs of Sequence, Splitter, Ensemble and
Switch nodes. Pure semantics here; service calls go through an `Invoker` supplied by a server."""

from modelyard.errors import GraphInvalid
from modelyard.graph.answer import Answer, answer
from modelyard.graph.engine import (
    MAX_DEPTH,
    Graph,
    GraphFailure,
    Invoker,
    Outcome,
    RunContext,
    StepSpan,
    StepSpans,
    StepTrace,
)
from modelyard.graph.loader import (
    GraphDocument,
    load_config_graphs,
    load_graph_file,
    load_graph_paths,
    load_graph_text,
    parse_graph,
)
from modelyard.graph.model import GraphSpec, InferenceRouter, InferenceStep
from modelyard.graph.validate import Problem, Report, validate_graph

__all__ = [
    "MAX_DEPTH",
    "Answer",
    "Graph",
    "GraphDocument",
    "GraphFailure",
    "GraphInvalid",
    "GraphSpec",
    "InferenceRouter",
    "InferenceStep",
    "Invoker",
    "Outcome",
    "Problem",
    "Report",
    "RunContext",
    "StepSpan",
    "StepSpans",
    "StepTrace",
    "answer",
    "load_config_graphs",
    "load_graph_file",
    "load_graph_paths",
    "load_graph_text",
    "parse_graph",
    "validate_graph",
]
