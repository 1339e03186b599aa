"""What a pod says of itself through the Downward API: its labels file names the agent's capabilities.

Kubernetes writes a pod's labels to a mounted file, one `key="value"` per line (the value quoted as
Go's %q does). A server's pods carry `capability.modelyard.io/<name>: "true"` for each capability,
so the same label that lets `kubectl get pods -l capability.modelyard.io/gpu` find them tells the
scheduler what they can run.
"""

from __future__ import annotations

import json
import re

CAPABILITY_LABEL = "capability.modelyard.io/"
_LINE = re.compile(r'^([^=\s]+)=(".*")$')


class PodInfoError(ValueError):
    pass


def labels_from_file_text(text: str) -> dict[str, str]:
    labels = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line.strip())
        if match is None:
            raise PodInfoError(f'line {number}: expected key="value", got {line.strip()!r}')
        try:
            labels[match.group(1)] = str(json.loads(match.group(2)))  # %q's escapes are JSON's for labels
        except json.JSONDecodeError:
            raise PodInfoError(f"line {number}: cannot read the quoted value {match.group(2)!r}") from None
    return labels


def capabilities_from_labels(labels: dict[str, str]) -> list[str]:
    """The capability names the labels switch on ("true"), sorted."""
    return sorted(
        key.removeprefix(CAPABILITY_LABEL)
        for key, value in labels.items()
        if key.startswith(CAPABILITY_LABEL) and value.lower() == "true" and len(key) > len(CAPABILITY_LABEL)
    )
