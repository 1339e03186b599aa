"""The agent's capabilities from the pod's Downward API labels file."""

from __future__ import annotations

import pytest

from modelyard.kube.podinfo import PodInfoError, capabilities_from_labels, labels_from_file_text

# What the kubelet writes for metadata.labels (one key="value" per line, Go's %q quoting).
LABELS_FILE = (
    'app.kubernetes.io/component="server"\n'
    'apps.kubernetes.io/pod-index="2"\n'
    'capability.modelyard.io/sklearn="true"\n'
    'capability.modelyard.io/gpu="true"\n'
    'capability.modelyard.io/xgboost="false"\n'
    'note="a \\"quoted\\" value"\n'
)


def test_labels_are_read_with_their_quoting():
    labels = labels_from_file_text(LABELS_FILE)
    assert labels["apps.kubernetes.io/pod-index"] == "2"
    assert labels["note"] == 'a "quoted" value'


def test_capabilities_are_the_labels_set_to_true():
    assert capabilities_from_labels(labels_from_file_text(LABELS_FILE)) == ["gpu", "sklearn"]
    assert capabilities_from_labels({"capability.modelyard.io/": "true", "other/gpu": "true"}) == []


@pytest.mark.parametrize("line", ["no-equals-sign", "key=unquoted", 'key="\\q"'])
def test_a_malformed_line_is_named(line):
    with pytest.raises(PodInfoError, match="line 2: "):
        labels_from_file_text('ok="1"\n' + line + "\n")
