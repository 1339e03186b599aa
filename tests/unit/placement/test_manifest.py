"""Manifests: the plain shape and Seldon's Model resource, read into ModelSpecs with field paths."""

from __future__ import annotations

import pytest
import yaml

from modelyard.errors import ModelSpecInvalid
from modelyard.placement import ModelSpec
from modelyard.placement.manifest import (
    parse_quantity,
    spec_from_manifest,
    spec_to_plain,
    specs_from_manifests,
)

SELDON_IRIS = """
apiVersion: mlops.seldon.io/v1alpha1
kind: Model
metadata:
  name: iris
  namespace: seldon-mesh
  generation: 3
spec:
  storageUri: "gs://seldon-models/scv2/samples/mlserver_1.3.5/iris-sklearn"
  requirements: [sklearn]
  modelType: mlflow
  memory: 100Ki
  replicas: 2
  minReplicas: 1
  maxReplicas: 3
  server: mlserver
  parameters:
    - {name: batch, value: "8"}
  preloaded: true
  dedicated: false
  schemaUri: gs://x/schema.json
  secretName: creds
  artifactVersion: 1
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (1000, 1000),
        ("1000", 1000),
        ("100Ki", 102_400),
        ("1Mi", 1_048_576),
        ("1.5Gi", 1_610_612_736),
        ("1M", 1_000_000),
        ("2G", 2_000_000_000),
        ("1e6", 1_000_000),
        ("1500m", 2),  # 1.5 bytes rounds up
        (" 3k ", 3000),
    ],
)
def test_quantities_become_bytes(text: object, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("bad", [-1, "-1Ki", "1Xi", "lots", "", True, 1.5, None, "1.2.3"])
def test_bad_quantities_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"quantity|negative"):
        parse_quantity(bad)


def test_seldon_model_resource_maps_field_by_field() -> None:
    spec = spec_from_manifest(yaml.safe_load(SELDON_IRIS))
    assert spec == ModelSpec(
        name="iris",
        storage_uri="gs://seldon-models/scv2/samples/mlserver_1.3.5/iris-sklearn",
        requirements=("sklearn", "mlflow"),  # modelType is appended, as Seldon's operator does
        memory=102_400,
        replicas=2,
        min_replicas=1,
        max_replicas=3,
        server="mlserver",
        parameters={"batch": "8"},
    )


def test_seldon_defaults_follow_the_operator() -> None:
    doc = {"apiVersion": "mlops.seldon.io/v1alpha1", "kind": "Model", "metadata": {"name": "m"}}
    doc["spec"] = {"storageUri": "/models/m", "minReplicas": 2}
    spec = spec_from_manifest(doc)
    assert (spec.replicas, spec.min_replicas, spec.max_replicas) == (2, 2, None)


def test_plain_shape_with_a_quantity() -> None:
    spec = spec_from_manifest({"name": "iris", "storage_uri": "./iris", "memory": "1Mi"})
    assert spec.memory == 1_048_576
    assert spec_to_plain(spec)["memory"] == 1_048_576
    assert spec_to_plain(spec)["requirements"] == []


@pytest.mark.parametrize(
    ("document", "problems"),
    [
        (
            {"name": "iris", "storage_uri": "./iris", "replica": 2},
            ["replica: unknown field"],
        ),
        (
            {"name": "iris", "storage_uri": "./iris", "memory": -5},
            ["memory: must not be negative (got -5)"],
        ),
        (
            {"name": "Iris", "storage_uri": "./iris"},
            ["name: must be lowercase letters, digits and '-', starting and ending with a letter or digit"],
        ),
        (
            {
                "apiVersion": "mlops.seldon.io/v1alpha1",
                "kind": "Model",
                "metadata": {"name": "iris"},
                "spec": {"storageUri": "./iris", "minReplicas": 3, "maxReplicas": 2, "colour": "red"},
            },
            ["spec.colour: unknown field", "spec.maxReplicas: must be at least min_replicas (3)"],
        ),
        (
            {"apiVersion": "mlops.seldon.io/v1alpha1", "kind": "Server", "metadata": {"name": "s"}},
            ["kind: expected 'Model'"],
        ),
        (
            {"apiVersion": "v1", "kind": "Model", "metadata": {}, "spec": {"storageUri": "x"}},
            ["apiVersion: expected", "metadata.name: field required"],
        ),
        (
            {
                "apiVersion": "mlops.seldon.io/v1alpha1",
                "kind": "Model",
                "metadata": {"name": "iris"},
                "spec": {"storageUri": "x", "memory": "lots", "parameters": {"a": "b"}},
            },
            [
                "spec.memory: expected bytes or a quantity",
                "spec.parameters: expected a list of {name, value}",
            ],
        ),
        (["not", "a", "mapping"], ["(top level): expected a mapping, got list"]),
    ],
)
def test_bad_manifests_name_each_field_path(document: object, problems: list[str]) -> None:
    with pytest.raises(ModelSpecInvalid) as caught:
        spec_from_manifest(document, "iris.yaml")
    message = caught.value.message
    assert message.startswith("iris.yaml: ")
    for problem in problems:
        assert problem in message, message
    assert caught.value.status == 400


def test_many_documents_fail_together_and_name_the_document() -> None:
    docs = list(
        yaml.safe_load_all(
            """
name: a
storage_uri: ./a
---
name: b
storage_uri: ./b
memory: -1
---
---
name: a
storage_uri: ./a2
"""
        )
    )
    with pytest.raises(ModelSpecInvalid) as caught:
        specs_from_manifests(docs, "models.yaml")
    assert caught.value.problems == [
        "[document 2] memory: must not be negative (got -1)",
        "[document 4] name: 'a' is also defined in document 1",
    ]


def test_many_good_documents_in_order() -> None:
    docs = list(yaml.safe_load_all(SELDON_IRIS + "\n---\nname: other\nstorage_uri: ./o\n"))
    assert [spec.name for spec in specs_from_manifests(docs)] == ["iris", "other"]


def test_an_empty_file_is_an_error() -> None:
    with pytest.raises(ModelSpecInvalid, match="no model documents"):
        specs_from_manifests([None], "empty.yaml")
