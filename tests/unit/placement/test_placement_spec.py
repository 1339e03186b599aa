"""Model specs: Seldon's name and scaling rules with field paths, and the version rule (compat §6.1)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from modelyard.errors import BadRequest, ModelSpecInvalid
from modelyard.placement import ModelSpec, SpecChange, parse_model_spec, spec_change

BASE: dict[str, Any] = {"name": "iris", "storage_uri": "gs://models/iris"}


def parse(**fields: Any) -> ModelSpec:
    return parse_model_spec({**BASE, **fields})


def problems(**fields: Any) -> list[str]:
    with pytest.raises(ModelSpecInvalid) as caught:
        parse(**fields)
    return caught.value.problems


@pytest.mark.parametrize(
    ("fields", "replicas", "min_replicas", "max_replicas"),
    [
        ({}, 1, 0, None),
        ({"replicas": None}, 1, 0, None),
        ({"min_replicas": 3}, 3, 3, None),  # replicas unset and min > 0: replicas = min
        ({"min_replicas": 2, "max_replicas": 5}, 2, 2, 5),
        ({"replicas": 4, "min_replicas": 2}, 4, 2, None),
        ({"replicas": 0}, 0, 0, None),
        ({"replicas": 5, "max_replicas": 5}, 5, 0, 5),
        ({"replicas": 7, "max_replicas": 0}, 7, 0, None),  # max 0 means no limit, as in Seldon
        ({"max_replicas": 3}, 1, 0, 3),
    ],
)
def test_scaling_defaults(
    fields: dict[str, Any], replicas: int, min_replicas: int, max_replicas: int | None
) -> None:
    spec = parse(**fields)
    assert (spec.replicas, spec.min_replicas, spec.max_replicas) == (replicas, min_replicas, max_replicas)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"replicas": 1, "min_replicas": 2}, "replicas: must be at least min_replicas (2) (got 1)"),
        ({"replicas": 6, "max_replicas": 5}, "replicas: must be at most max_replicas (5) (got 6)"),
        ({"min_replicas": 4, "max_replicas": 3}, "max_replicas: must be at least min_replicas (4) (got 3)"),
        ({"min_replicas": 1, "max_replicas": 0}, "max_replicas: must be at least min_replicas (1) (got 0)"),
        ({"replicas": -1}, "replicas: Input should be greater than or equal to 0 (got -1)"),
        ({"min_replicas": -2}, "min_replicas: Input should be greater than or equal to 0 (got -2)"),
        ({"max_replicas": -1}, "max_replicas: Input should be greater than or equal to 0 (got -1)"),
        ({"memory": -5}, "memory: Input should be greater than or equal to 0 (got -5)"),
        ({"memory": "1Gi"}, "memory: Input should be a valid integer (got '1Gi')"),
        ({"replicas": True}, "replicas: Input should be a valid integer (got True)"),
        ({"replicas": 2.5}, "replicas: Input should be a valid integer (got 2.5)"),
        ({"storage_uri": ""}, "storage_uri: String should have at least 1 character (got '')"),
        ({"requirements": ["sklearn", "  "]}, "requirements[1]: must not be empty (got '  ')"),
        ({"parameters": {"a": 1}}, "parameters.a: Input should be a valid string (got 1)"),
        ({"replica": 2}, "replica: unknown field"),
    ],
)
def test_problems_name_the_field_path(fields: dict[str, Any], expected: str) -> None:
    assert problems(**fields) == [expected]


def test_a_missing_field_is_named() -> None:
    with pytest.raises(ModelSpecInvalid) as caught:
        parse_model_spec({"name": "iris"})
    assert caught.value.problems == ["storage_uri: Field required"]


def test_every_problem_is_reported_at_once() -> None:
    found = problems(name="Iris", memory=-1, replicas=9, max_replicas=3, bogus=True)
    assert [problem.split(":")[0] for problem in found] == ["name", "memory", "replicas", "bogus"]


def test_the_error_is_a_400_naming_the_source() -> None:
    with pytest.raises(ModelSpecInvalid) as caught:
        parse_model_spec({**BASE, "replicas": -1}, source="models/iris.yaml")
    assert isinstance(caught.value, BadRequest)
    assert caught.value.status == 400
    assert str(caught.value).startswith("models/iris.yaml: replicas: ")


def test_not_a_mapping() -> None:
    with pytest.raises(ModelSpecInvalid, match=r"\(top level\)"):
        parse_model_spec(["iris"])


@pytest.mark.parametrize("name", ["a", "iris", "iris-v2", "0abc", "a1-b2-c3", "x" * 100])
def test_valid_names(name: str) -> None:
    assert parse(name=name).name == name


@pytest.mark.parametrize("name", ["", "Iris", "iris.v2", "-iris", "iris-", "iris_v2", "iris\n", "ír", "a b"])
def test_names_that_are_not_dns_labels(name: str) -> None:
    assert [problem.split(":")[0] for problem in problems(name=name)] == ["name"]


def test_requirements_are_trimmed() -> None:
    assert parse(requirements=[" sklearn", "gpu "]).requirements == ("sklearn", "gpu")


def test_an_empty_server_is_no_pin() -> None:
    assert parse(server="").server is None
    assert parse(server="triton").server == "triton"


def test_a_spec_is_frozen_and_checked_when_built_directly() -> None:
    spec = parse()
    with pytest.raises(ValidationError):
        spec.replicas = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="min_replicas"):
        ModelSpec(name="iris", storage_uri="x", replicas=1, min_replicas=2)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, SpecChange.UNCHANGED),
        ({"requirements": ["b", "a"]}, SpecChange.UNCHANGED),  # same set, same placement
        ({"replicas": 3}, SpecChange.SCALING),
        ({"min_replicas": 1}, SpecChange.SCALING),
        ({"max_replicas": 9}, SpecChange.SCALING),
        ({"storage_uri": "gs://models/iris-2"}, SpecChange.NEW_VERSION),
        ({"memory": 2048}, SpecChange.NEW_VERSION),
        ({"requirements": ["a"]}, SpecChange.NEW_VERSION),
        ({"requirements": ["a", "b", "c"]}, SpecChange.NEW_VERSION),
        ({"server": "mlserver"}, SpecChange.NEW_VERSION),
        ({"parameters": {"k": "v2"}}, SpecChange.NEW_VERSION),
        ({"memory": 2048, "replicas": 5}, SpecChange.NEW_VERSION),  # a new version carries the scaling
    ],
)
def test_version_rule(changes: dict[str, Any], expected: SpecChange) -> None:
    latest = parse(requirements=["a", "b"], memory=1024, parameters={"k": "v"})
    new = parse(
        **{"requirements": ["a", "b"], "memory": 1024, "parameters": {"k": "v"}, **changes},
    )
    assert spec_change(latest, new) is expected


def test_version_rule_needs_the_same_model() -> None:
    with pytest.raises(ValueError, match="different models"):
        spec_change(parse(), parse(name="other"))
