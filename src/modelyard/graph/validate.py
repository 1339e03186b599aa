"""Validation of a graph before it may run: every problem at once, each with its path.

KServe's admission webhook makes five checks and returns the first failure; modelyard makes the
same five, with KServe's messages, and reports all of them. It then checks what KServe lets
through and later crashes, hangs or misroutes on: cycles, `nodeName`s that name no node, a
Sequence with no steps, conditions that do not parse, and a missing `routerType` (KServe's CRD
schema catches that one). Warnings flag what is legal but surely unintended.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from modelyard.graph.condition import ConditionSyntaxError, compile_condition
from modelyard.graph.model import ROOT, GraphSpec, InferenceRouter

_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # fullmatch: `$` would let a final newline through


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(slots=True)
class Report:
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, path: str, message: str) -> None:
        self.errors.append(Problem(path, message))

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(Problem(path, message, "warning"))


def validate_graph(name: str, raw: Any, *, resolved: bool = False) -> tuple[GraphSpec | None, Report]:
    """Check a graph spec (the `spec` of an InferenceGraph, as parsed JSON/YAML). `resolved`: the
    spec KServe's controller hands its router, where a step keeps its `serviceName` beside the
    `serviceUrl` resolved from it; that pair counts as one target."""
    report = Report()
    if not _NAME.fullmatch(name):
        report.error(
            "metadata.name",
            f'The InferenceGraph "{name}" is invalid: a InferenceGraph name must consist of lower case '
            "alphanumeric characters or '-', and must start with alphabetical character. "
            '(e.g. "my-name" or "abc-123", regex used for validation is \'[a-z]([-a-z0-9]*[a-z0-9])?\')',
        )
    try:
        spec = GraphSpec.model_validate(raw)
    except ValidationError as exc:
        for err in exc.errors():
            report.error(_loc(err["loc"]) or "spec", _message(err))
        return None, report
    _kserve_checks(name, spec, report, resolved)
    _structure_checks(spec, report)
    if spec.timeout is not None and spec.timeout <= 0:
        report.warn("timeout", f"not a positive number of seconds ({spec.timeout}): no graph timeout applies")
    return spec, report


def _kserve_checks(graph: str, spec: GraphSpec, report: Report, resolved: bool = False) -> None:
    """The webhook's checks 2-5, with its messages."""
    if ROOT not in spec.nodes:
        report.error(
            "nodes",
            "root node not found, InferenceGraph needs a node with name 'root' as the root node of the graph",
        )
    for node_name, node in spec.nodes.items():
        base = f"nodes.{node_name}"
        seen: set[str] = set()
        for i, step in enumerate(node.steps):
            if step.name and step.name in seen:
                report.error(
                    f"{base}.steps[{i}].name",
                    f'Node "{node_name}" of InferenceGraph "{graph}" contains more than one step '
                    f'with name "{step.name}"',
                )
            seen.add(step.name)
        for i, step in enumerate(node.steps):
            named = step.service_name if not (resolved and step.service_url) else ""
            targets = sum(1 for t in (step.node_name, named, step.service_url) if t)
            where = f'Step {i} ("{step.name}") in node "{node_name}" of InferenceGraph "{graph}"'
            if targets == 0:
                report.error(f"{base}.steps[{i}]", f"{where} does not specify an inference target")
            elif targets > 1:
                report.error(
                    f"{base}.steps[{i}]",
                    f"{where} specifies more than one of nodeName, serviceName, serviceUrl",
                )
        if node.router_type == "Splitter":
            missing = [i for i, s in enumerate(node.steps) if s.weight is None]
            for i in missing:
                report.error(
                    f"{base}.steps[{i}].weight",
                    f"InferenceGraph[{graph}] Node[{node_name}] Route[{node.steps[i].service_name}] "
                    "missing the 'Weight'",
                )
            if not missing and sum(s.weight or 0 for s in node.steps) != 100:
                report.error(
                    f"{base}.steps",
                    f"InferenceGraph[{graph}] Node[{node_name}] splitter node: the sum of traffic weights "
                    "for all routing targets should be 100",
                )


def _structure_checks(spec: GraphSpec, report: Report) -> None:
    """What KServe accepts but cannot run well."""
    for node_name, node in spec.nodes.items():
        base = f"nodes.{node_name}"
        if not node.router_type:
            report.error(f"{base}.routerType", "required: one of Sequence, Splitter, Ensemble, Switch")
        if node.router_type == "Sequence" and not node.steps:
            report.error(f"{base}.steps", "a Sequence needs at least one step (KServe drops the connection)")
        if node.router_type == "Switch" and not node.steps:
            report.warn(f"{base}.steps", "a Switch with no steps never matches: every request fails")
        for i, step in enumerate(node.steps):
            path = f"{base}.steps[{i}]"
            if step.node_name and step.node_name not in spec.nodes:
                known = ", ".join(sorted(spec.nodes))
                report.error(f"{path}.nodeName", f"no node named {step.node_name!r}; nodes: {known}")
            if step.condition:
                try:
                    compile_condition(step.condition)
                except ConditionSyntaxError as exc:
                    report.error(f"{path}.condition", f"does not parse: {exc}")
                if node.router_type in ("Splitter", "Ensemble"):
                    report.warn(
                        f"{path}.condition", f"ignored: a {node.router_type} does not test conditions"
                    )
            elif node.router_type == "Switch":
                report.warn(f"{path}.condition", "missing: this Switch step can never be chosen")
            if step.weight is not None and node.router_type != "Splitter":
                report.warn(
                    f"{path}.weight", f"ignored: only a Splitter uses weights, this is a {node.router_type}"
                )
            if step.data not in ("", "$request", "$response"):
                report.warn(
                    f"{path}.data", f"{step.data!r} means the node input; only '$response' changes it"
                )
    for cycle in _cycles(spec.nodes):
        report.error(f"nodes.{cycle[0]}", "cycle: " + " -> ".join(cycle))
    reachable = _reachable(spec.nodes)
    for node_name in spec.nodes:
        if node_name not in reachable and ROOT in spec.nodes:
            report.warn(f"nodes.{node_name}", "unreachable from root: it never runs")


def _edges(node: InferenceRouter) -> list[str]:
    return [s.node_name for s in node.steps if s.node_name]


def _reachable(nodes: dict[str, InferenceRouter]) -> set[str]:
    seen: set[str] = set()
    stack = [ROOT] if ROOT in nodes else []
    while stack:
        name = stack.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        stack.extend(_edges(nodes[name]))
    return seen


def _cycles(nodes: dict[str, InferenceRouter]) -> list[list[str]]:
    """Each elementary cycle found by depth-first search, once, as the path that closes it."""
    found: list[list[str]] = []
    seen_sets: set[frozenset[str]] = set()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            key = frozenset(cycle)
            if key not in seen_sets:
                seen_sets.add(key)
                found.append(cycle)
            return
        if name in done or name not in nodes:
            return
        path.append(name)
        for child in _edges(nodes[name]):
            visit(child, path)
        path.pop()
        done.add(name)

    for start in ([ROOT] if ROOT in nodes else []) + sorted(nodes):
        visit(start, [])
    return found


def _loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _message(err: Any) -> str:
    if err["type"] == "literal_error":
        return f"expected one of {err['ctx']['expected']} (got {err.get('input')!r})"
    return str(err["msg"])
