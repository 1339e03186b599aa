"""Model manifests as users write them, read into ModelSpecs: the plain modelyard shape and Seldon's
`Model` custom resource (`mlops.seldon.io/v1alpha1`, compat §11.1), unchanged.

The plain shape is ModelSpec's own fields (`name`, `storage_uri`, `memory`, `replicas`, ...).
A document with an `apiVersion` is a Kubernetes resource and must be a Seldon `Model`:
`metadata.name` is the name, `spec.storageUri` the storage URI, `spec.modelType` is appended to
`spec.requirements` as Seldon's operator does, `spec.parameters` is Seldon's list of `{name, value}`.
Seldon fields the scheduler has no use for (`preloaded`, `dedicated`, `schemaUri`, `secretName`,
`artifactVersion`, `logger`, `explainer`, `llm`, `dataflow`) are accepted and ignored, as the
operator ignores them; any other unknown field is an error, as a strict API server would make it.

`memory` may be bytes or a Kubernetes quantity (`100Ki`, `1M`, `1.5Gi`, `1e6`) in both shapes.
Every problem is reported with the field path as the user wrote it (`spec.minReplicas`, not
`min_replicas`), and with the document's index when a file holds several.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import ROUND_CEILING
from typing import Any

from modelyard.errors import ModelSpecInvalid
from modelyard.placement.spec import ModelSpec, parse_model_spec
from modelyard.types import quantity

SELDON_API_VERSION = "mlops.seldon.io/v1alpha1"

# Seldon field -> ModelSpec field.
_SELDON_FIELDS = {
    "storageUri": "storage_uri",
    "requirements": "requirements",
    "memory": "memory",
    "replicas": "replicas",
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "server": "server",
    "parameters": "parameters",
}
_SELDON_IGNORED = frozenset(
    {
        "modelType",  # read separately: appended to requirements
        "preloaded",
        "dedicated",
        "schemaUri",
        "secretName",
        "artifactVersion",
        "logger",
        "explainer",
        "llm",
        "dataflow",
    }
)
_SELDON_PATHS = {plain: f"spec.{seldon}" for seldon, plain in _SELDON_FIELDS.items()} | {
    "name": "metadata.name"
}


def parse_quantity(value: object) -> int:
    """Bytes from an int or a Kubernetes quantity string, rounded up to a whole byte.
    Raises ValueError for anything else (negative numbers, unknown suffixes, bools)."""
    if isinstance(value, bool):
        raise ValueError(f"expected bytes or a quantity like 100Ki or 1Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must not be negative (got {value})")
        return value
    if isinstance(value, str):
        try:
            return int(quantity(value).to_integral_value(rounding=ROUND_CEILING))
        except ValueError:
            pass
    raise ValueError(f"expected bytes or a quantity like 100Ki or 1Gi, got {value!r}")


def spec_from_manifest(document: object, source: str = "model") -> ModelSpec:
    """One document, plain or a Seldon Model; raises ModelSpecInvalid naming every problem."""
    if not isinstance(document, Mapping):
        raise ModelSpecInvalid(source, [f"(top level): expected a mapping, got {_kind(document)}"])
    if "apiVersion" in document or "kind" in document:
        return _from_seldon(document, source)
    return _from_plain(document, source)


def specs_from_manifests(documents: Sequence[object], source: str = "model") -> list[ModelSpec]:
    """Every document of a file (empty ones skipped), validated before any is returned: one bad
    document fails them all, so nothing is half applied. Problems name `[document N]` (from 1)
    when there are several."""
    present = [(index, doc) for index, doc in enumerate(documents, 1) if doc is not None]
    if not present:
        raise ModelSpecInvalid(source, ["(top level): no model documents"])
    several = len(present) > 1
    specs: list[ModelSpec] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for index, document in present:
        where = f"[document {index}] " if several else ""
        try:
            spec = spec_from_manifest(document, source)
        except ModelSpecInvalid as exc:
            problems.extend(where + problem for problem in exc.problems)
            continue
        if spec.name in seen:
            problems.append(f"{where}name: {spec.name!r} is also defined in document {seen[spec.name]}")
            continue
        seen[spec.name] = index
        specs.append(spec)
    if problems:
        raise ModelSpecInvalid(source, problems)
    return specs


def spec_to_plain(spec: ModelSpec) -> dict[str, Any]:
    """The plain shape of a spec, JSON-ready (what the scheduler's API returns)."""
    return spec.model_dump(mode="json")


def _from_plain(document: Mapping[str, Any], source: str) -> ModelSpec:
    data = dict(document)
    problems: list[str] = []
    if "memory" in data:
        try:
            data["memory"] = parse_quantity(data["memory"])
        except ValueError as exc:
            problems.append(f"memory: {exc}")
            data.pop("memory")
    return _validate(data, source, problems, {})


def _from_seldon(document: Mapping[str, Any], source: str) -> ModelSpec:
    problems: list[str] = []
    if document.get("apiVersion") != SELDON_API_VERSION:
        problems.append(f"apiVersion: expected {SELDON_API_VERSION!r} (got {document.get('apiVersion')!r})")
    if document.get("kind") != "Model":
        problems.append(f"kind: expected 'Model' (got {document.get('kind')!r})")
    metadata = document.get("metadata")
    spec = document.get("spec")
    if not isinstance(metadata, Mapping) or "name" not in metadata:
        problems.append("metadata.name: field required")
        metadata = {}
    if not isinstance(spec, Mapping):
        problems.append(f"spec: expected a mapping, got {_kind(spec)}")
        spec = {}
    data: dict[str, Any] = {"name": metadata.get("name")}
    for key, value in spec.items():
        if key in _SELDON_FIELDS:
            data[_SELDON_FIELDS[key]] = value
        elif key not in _SELDON_IGNORED:
            problems.append(f"spec.{key}: unknown field")
    if "memory" in data:
        try:
            data["memory"] = parse_quantity(data["memory"])
        except ValueError as exc:
            problems.append(f"spec.memory: {exc}")
            data.pop("memory")
    model_type = spec.get("modelType")
    if model_type is not None:
        if isinstance(model_type, str) and isinstance(data.get("requirements", []), list):
            data["requirements"] = [*data.get("requirements", []), model_type]
        else:
            problems.append(f"spec.modelType: expected a string (got {model_type!r})")
    if "parameters" in data:
        data["parameters"] = _seldon_parameters(data["parameters"], problems)
    return _validate(data, source, problems, _SELDON_PATHS)


def _seldon_parameters(value: object, problems: list[str]) -> dict[str, str]:
    if not isinstance(value, list):
        problems.append(f"spec.parameters: expected a list of {{name, value}} (got {_kind(value)})")
        return {}
    parameters: dict[str, str] = {}
    for index, item in enumerate(value):
        if (
            not isinstance(item, Mapping)
            or not isinstance(item.get("name"), str)
            or set(item) - {"name", "value"}
        ):
            problems.append(f"spec.parameters[{index}]: expected {{name, value}} (got {item!r})")
            continue
        parameters[item["name"]] = str(item.get("value", ""))
    return parameters


def _validate(data: dict[str, Any], source: str, problems: list[str], paths: Mapping[str, str]) -> ModelSpec:
    try:
        spec = parse_model_spec(data, source, paths=paths)
    except ModelSpecInvalid as exc:
        problems.extend(exc.problems)
        spec = None
    if problems or spec is None:
        raise ModelSpecInvalid(source, problems)
    return spec


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
