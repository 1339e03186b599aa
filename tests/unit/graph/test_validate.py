"""Graph validation: KServe's five webhook checks with its messages (compat spec 7.2), all problems at
once, and what KServe accepts but cannot run (cycles, dangling nodeName, empty Sequence...)."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.graph import validate_graph

URL = "http://model.default.svc.cluster.local/v1/models/m:predict"


def _errors(raw: Any, name: str = "g") -> list[tuple[str, str]]:
    _spec, report = validate_graph(name, raw)
    return [(p.path, p.message) for p in report.errors]


def _warnings(raw: Any, name: str = "g") -> list[tuple[str, str]]:
    _spec, report = validate_graph(name, raw)
    assert report.ok, report.errors
    return [(p.path, p.message) for p in report.warnings]


def _seq(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"routerType": "Sequence", "steps": list(steps)}


def test_valid_graph_has_no_problems() -> None:
    spec, report = validate_graph("my-graph-1", {"nodes": {"root": _seq({"serviceUrl": URL})}})
    assert spec is not None
    assert report.ok and not report.errors and not report.warnings
    assert spec.nodes["root"].steps[0].service_url == URL


# "name\n": Python's `$` matches before a final newline; Go's (KServe's) does not.
@pytest.mark.parametrize("name", ["Bad_Name", "1graph", "graph-", "UPPER", "", "a.b", "name\n"])
def test_check_1_name(name: str) -> None:
    assert _errors({"nodes": {"root": _seq({"serviceUrl": URL})}}, name) == [
        (
            "metadata.name",
            f'The InferenceGraph "{name}" is invalid: a InferenceGraph name must consist of lower case '
            "alphanumeric characters or '-', and must start with alphabetical character. "
            '(e.g. "my-name" or "abc-123", regex used for validation is \'[a-z]([-a-z0-9]*[a-z0-9])?\')',
        )
    ]


@pytest.mark.parametrize("name", ["a", "abc-123", "my-name", "x1"])
def test_check_1_name_accepts_dns_labels(name: str) -> None:
    assert _errors({"nodes": {"root": _seq({"serviceUrl": URL})}}, name) == []


def test_check_2_root() -> None:
    assert _errors({"nodes": {"start": _seq({"serviceUrl": URL})}}) == [
        (
            "nodes",
            "root node not found, InferenceGraph needs a node with name 'root' as the root node of the graph",
        )
    ]


def test_check_3_unique_step_names_within_a_node() -> None:
    raw = {
        "nodes": {
            "root": _seq(
                {"name": "a", "serviceUrl": URL},
                {"name": "", "serviceUrl": URL},
                {"name": "", "serviceUrl": URL},  # empty names are not checked
                {"name": "a", "nodeName": "other"},
            ),
            "other": _seq({"name": "a", "serviceUrl": URL}),  # the same name in another node is fine
        }
    }
    assert _errors(raw, "ig") == [
        (
            "nodes.root.steps[3].name",
            'Node "root" of InferenceGraph "ig" contains more than one step with name "a"',
        )
    ]


def test_check_4_no_target() -> None:
    raw = {"nodes": {"root": _seq({"serviceUrl": URL}, {"name": "empty"}, {})}}
    assert _errors(raw, "ig") == [
        (
            "nodes.root.steps[1]",
            'Step 1 ("empty") in node "root" of InferenceGraph "ig" does not specify an inference target',
        ),
        (
            "nodes.root.steps[2]",
            'Step 2 ("") in node "root" of InferenceGraph "ig" does not specify an inference target',
        ),
    ]


@pytest.mark.parametrize(
    "targets",
    [
        {"nodeName": "root", "serviceUrl": URL},
        {"serviceName": "m", "serviceUrl": URL},
        {"nodeName": "root", "serviceName": "m"},
        {"nodeName": "root", "serviceName": "m", "serviceUrl": URL},
    ],
)
def test_check_4_more_than_one_target(targets: dict[str, str]) -> None:
    raw = {"nodes": {"root": {"routerType": "Ensemble", "steps": [{"name": "s", **targets}]}}}
    problems = _errors(raw, "ig")
    assert (
        "nodes.root.steps[0]",
        'Step 0 ("s") in node "root" of InferenceGraph "ig" specifies more than one of '
        "nodeName, serviceName, serviceUrl",
    ) in problems


def test_check_5_missing_weight_names_the_service_name() -> None:
    raw = {
        "nodes": {
            "root": {
                "routerType": "Splitter",
                "steps": [
                    {"serviceName": "model-a", "weight": 100},
                    {"serviceName": "model-b"},
                    {"serviceUrl": URL},
                ],
            }
        }
    }
    assert _errors(raw, "ig") == [
        ("nodes.root.steps[1].weight", "InferenceGraph[ig] Node[root] Route[model-b] missing the 'Weight'"),
        ("nodes.root.steps[2].weight", "InferenceGraph[ig] Node[root] Route[] missing the 'Weight'"),
    ]


@pytest.mark.parametrize("weights", [[50, 40], [60, 60], [], [150, -50, 1]])
def test_check_5_weights_must_sum_to_100(weights: list[int]) -> None:
    raw = {
        "nodes": {
            "root": {"routerType": "Splitter", "steps": [{"serviceUrl": URL, "weight": w} for w in weights]}
        }
    }
    assert _errors(raw, "ig") == [
        (
            "nodes.root.steps",
            "InferenceGraph[ig] Node[root] splitter node: the sum of traffic weights for all routing targets "
            "should be 100",
        )
    ]


def test_check_5_out_of_range_weights_that_sum_to_100_pass() -> None:
    raw = {
        "nodes": {
            "root": {
                "routerType": "Splitter",
                "steps": [{"serviceUrl": URL, "weight": w} for w in (150, -50)],
            }
        }
    }
    assert _errors(raw) == []


def test_every_problem_is_reported_at_once() -> None:
    raw = {
        "nodes": {
            "start": _seq(
                {"name": "dup", "serviceUrl": URL},
                {"name": "dup", "serviceUrl": URL, "serviceName": "b"},
                {"name": ""},
            ),
            "split": {
                "routerType": "Splitter",
                "steps": [{"serviceName": "model-a", "weight": 60}, {"serviceName": "model-b"}],
            },
        }
    }
    problems = _errors(raw, "Bad_Graph")
    assert [path for path, _ in problems] == [
        "metadata.name",
        "nodes",
        "nodes.start.steps[1].name",
        "nodes.start.steps[1]",
        "nodes.start.steps[2]",
        "nodes.split.steps[1].weight",
    ]


@pytest.mark.parametrize(
    ("nodes", "cycle"),
    [
        ({"root": _seq({"nodeName": "root"})}, "cycle: root -> root"),
        ({"root": _seq({"nodeName": "a"}), "a": _seq({"nodeName": "root"})}, "cycle: root -> a -> root"),
        (
            {
                "root": _seq({"serviceUrl": URL}, {"nodeName": "a"}),
                "a": {"routerType": "Switch", "steps": [{"nodeName": "b", "condition": "@this"}]},
                "b": {"routerType": "Ensemble", "steps": [{"serviceUrl": URL}, {"nodeName": "a"}]},
            },
            "cycle: a -> b -> a",
        ),
    ],
)
def test_cycles_are_rejected_with_their_path(nodes: dict[str, Any], cycle: str) -> None:
    problems = _errors({"nodes": nodes})
    assert problems == [(f"nodes.{cycle.split()[1]}", cycle)]


def test_a_diamond_is_not_a_cycle() -> None:
    raw = {
        "nodes": {
            "root": {"routerType": "Ensemble", "steps": [{"nodeName": "a"}, {"nodeName": "b"}]},
            "a": _seq({"nodeName": "c"}),
            "b": _seq({"nodeName": "c"}),
            "c": _seq({"serviceUrl": URL}),
        }
    }
    assert _errors(raw) == []


def test_node_name_to_a_missing_node() -> None:
    raw = {
        "nodes": {
            "root": _seq({"serviceUrl": URL}, {"nodeName": "ghost"}),
            "zeta": _seq({"nodeName": "root"}),
        }
    }
    problems = _errors(raw)
    assert ("nodes.root.steps[1].nodeName", "no node named 'ghost'; nodes: root, zeta") in problems


def test_unreachable_node_is_a_warning() -> None:
    raw = {"nodes": {"root": _seq({"serviceUrl": URL}), "orphan": _seq({"serviceUrl": URL})}}
    assert _warnings(raw) == [("nodes.orphan", "unreachable from root: it never runs")]


def test_sequence_with_no_steps_is_an_error() -> None:
    assert _errors({"nodes": {"root": {"routerType": "Sequence"}}}) == [
        ("nodes.root.steps", "a Sequence needs at least one step (KServe drops the connection)")
    ]
    assert _errors({"nodes": {"root": {"routerType": "Sequence", "steps": []}}}) != []


def test_ensemble_with_no_steps_is_fine() -> None:
    assert _warnings({"nodes": {"root": {"routerType": "Ensemble"}}}) == []


def test_switch_with_no_steps_is_a_warning() -> None:
    assert _warnings({"nodes": {"root": {"routerType": "Switch", "steps": []}}}) == [
        ("nodes.root.steps", "a Switch with no steps never matches: every request fails")
    ]


def test_switch_step_without_condition_is_a_warning() -> None:
    raw = {
        "nodes": {
            "root": {
                "routerType": "Switch",
                "steps": [{"serviceUrl": URL, "condition": "@this"}, {"serviceUrl": URL}],
            }
        }
    }
    assert _warnings(raw) == [
        ("nodes.root.steps[1].condition", "missing: this Switch step can never be chosen")
    ]


@pytest.mark.parametrize("router_type", ["Splitter", "Ensemble"])
def test_condition_on_splitter_or_ensemble_is_a_warning(router_type: str) -> None:
    raw = {
        "nodes": {
            "root": {
                "routerType": router_type,
                "steps": [{"serviceUrl": URL, "weight": 100, "condition": "a"}],
            }
        }
    }
    warnings = _warnings(raw)
    assert ("nodes.root.steps[0].condition", f"ignored: a {router_type} does not test conditions") in warnings


@pytest.mark.parametrize(
    "condition",
    [
        'instances.#(modelId=="1")',
        "[@this].#(decision_picker==ERROR)",
        'predictions.#(label=="dog")',
        "instances.#(strval%*red-server*)",
        "{ .input.userId == 1 }",  # the Go doc pseudo-syntax is a (useless) gjson multipath
        "@this",
    ],
)
def test_kserve_conditions_parse(condition: str) -> None:
    raw = {
        "nodes": {"root": {"routerType": "Switch", "steps": [{"serviceUrl": URL, "condition": condition}]}}
    }
    assert _errors(raw) == []


def test_condition_that_does_not_parse_is_an_error() -> None:
    raw = {
        "nodes": {
            "root": {
                "routerType": "Switch",
                "steps": [{"serviceUrl": URL, "condition": "instances.#(modelId==1"}],
            }
        }
    }
    ((path, message),) = _errors(raw)
    assert path == "nodes.root.steps[0].condition"
    assert message.startswith("does not parse: ")


def test_weights_on_a_non_splitter_are_a_warning() -> None:
    raw = {"nodes": {"root": _seq({"serviceUrl": URL, "weight": 30})}}
    assert _warnings(raw) == [
        ("nodes.root.steps[0].weight", "ignored: only a Splitter uses weights, this is a Sequence")
    ]


def test_data_other_than_response_is_a_warning() -> None:
    raw = {"nodes": {"root": _seq({"serviceUrl": URL}, {"serviceUrl": URL, "data": "$response.predictions"})}}
    assert _warnings(raw) == [
        (
            "nodes.root.steps[1].data",
            "'$response.predictions' means the node input; only '$response' changes it",
        )
    ]


def test_missing_router_type_is_an_error() -> None:
    assert _errors({"nodes": {"root": {}}}) == [
        ("nodes.root.routerType", "required: one of Sequence, Splitter, Ensemble, Switch")
    ]


def test_unknown_fields_are_ignored_like_kserve() -> None:
    raw = {
        "nodes": {
            "root": {"routerType": "Sequence", "routes": [], "steps": [{"serviceUrl": URL, "extra": 1}]}
        },
        "resources": {"requests": {"cpu": "1"}},
        "minReplicas": 0,
    }
    assert _errors(raw) == []


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (
            {"nodes": {"root": _seq({"serviceUrl": URL, "dependency": "Maybe"})}},
            "nodes.root.steps[0].dependency",
        ),
        ({"nodes": {"root": _seq({"serviceUrl": URL, "weight": "heavy"})}}, "nodes.root.steps[0].weight"),
        (
            {"nodes": {"root": _seq({"serviceUrl": URL}, {"serviceUrl": ["x"]})}},
            "nodes.root.steps[1].serviceUrl",
        ),
        ({"nodes": {"root": {"routerType": "Sequence", "steps": {"a": 1}}}}, "nodes.root.steps"),
        ({"nodes": {"root": "Sequence"}}, "nodes.root"),
        ({"nodes": []}, "nodes"),
        ({}, "nodes"),
        (
            {"nodes": {"root": _seq({"serviceUrl": URL})}, "routerTimeouts": {"serviceClient": "soon"}},
            "routerTimeouts.serviceClient",
        ),
    ],
)
def test_schema_errors_carry_their_path(raw: dict[str, Any], path: str) -> None:
    spec, report = validate_graph("g", raw)
    assert spec is None
    assert [p.path for p in report.errors] == [path]


def test_unsupported_dependency_names_the_allowed_values() -> None:
    ((path, message),) = _errors({"nodes": {"root": _seq({"serviceUrl": URL, "dependency": "Maybe"})}})
    assert path == "nodes.root.steps[0].dependency"
    assert "'Soft'" in message and "'Hard'" in message and "'Maybe'" in message


def test_unsupported_router_type_is_one_error_at_its_path() -> None:
    ((path, message),) = _errors(
        {"nodes": {"root": {"routerType": "Fanout", "steps": [{"serviceUrl": URL}]}}}
    )
    assert path == "nodes.root.routerType"
    assert "'Sequence'" in message and "'Switch'" in message and "'Fanout'" in message


def test_schema_error_still_reports_a_bad_name() -> None:
    problems = _errors({"nodes": []}, "Bad")
    assert [path for path, _ in problems] == ["metadata.name", "nodes"]


@pytest.mark.parametrize("timeout", [0, -5])
def test_a_graph_timeout_that_is_not_positive_is_a_warning(timeout: int) -> None:
    # KServe's webhook accepts it (and its router ignores the field): a warning, not an error.
    assert _warnings({"nodes": {"root": _seq({"serviceUrl": URL})}, "timeout": timeout}) == [
        ("timeout", f"not a positive number of seconds ({timeout}): no graph timeout applies")
    ]


def test_the_router_input_may_keep_service_name_beside_its_resolved_url() -> None:
    # KServe's controller adds serviceUrl and keeps serviceName in the JSON it gives the router.
    step = {"serviceName": "model-a", "serviceUrl": URL}
    spec = {"nodes": {"root": _seq(step)}}
    assert any("more than one of" in message for _path, message in _errors(spec))
    _spec, report = validate_graph("g", spec, resolved=True)
    assert report.ok
