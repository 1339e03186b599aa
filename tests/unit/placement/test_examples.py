"""The model files in examples/placement/ validate as `modelyard model apply` reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.documents import parse_documents
from modelyard.placement.manifest import parse_quantity, specs_from_manifests

EXAMPLES = Path(__file__).parents[3] / "examples" / "placement"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_validates(path):
    assert specs_from_manifests(parse_documents(path.read_text(), untrusted=False), str(path))


def test_the_demo_models_fit_both_replicas_one_and_none():
    specs = {s.name: s for s in specs_from_manifests(parse_documents((EXAMPLES / "models.yaml").read_text()))}
    assert specs["chat-small"].replicas == 2 and specs["chat-small"].memory <= parse_quantity("2Gi")
    assert parse_quantity("2Gi") < specs["chat-large"].memory <= parse_quantity("8Gi")  # the Seldon CR
    assert specs["chat-huge"].memory > parse_quantity("8Gi")
