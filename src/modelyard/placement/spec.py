"""A model to place: what it is (the versioned part) and how many replicas (the scaling part).

Scaling follows Seldon's operator (compat §11.1): replicas default to 1, or to min_replicas when
only that is given; min_replicas defaults to 0 and max_replicas to no limit; replicas must lie in
[min_replicas, max_replicas] and min_replicas <= max_replicas. A max_replicas of 0 also means no
limit, as in Seldon (its autoscaler reads 0 as "no maximum"), so it is stored as None; it still
requires min_replicas to be 0. Every problem is reported at once, each with its field path.

`spec_change` is Seldon's version rule (compat §6.1): a change to what the model is makes a new
version, a change of the scaling fields alone changes the latest version in place.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from modelyard.errors import ModelSpecInvalid

# Seldon's model-name rule: one DNS label, lowercase, no dots (compat §6.1). Its length is not
# limited there, so it is not here either.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# scheme://user[:password]@host...: userinfo, a credential in the URL itself
_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@")
_CREDENTIALS = "credentials_in_uri"


def _capability(value: str) -> str:
    # Seldon trims requirements and capabilities before it compares them; trimming once here
    # means a stored spec shows what is compared. An empty one could never match anything.
    trimmed = value.strip()
    if not trimmed:
        raise ValueError("must not be empty")
    return trimmed


Capability = Annotated[str, AfterValidator(_capability)]

SCALING_FIELDS: frozenset[str] = frozenset({"replicas", "min_replicas", "max_replicas"})
"""The fields a change of which keeps the version (Seldon's DeploymentSpec)."""


class ModelSpec(BaseModel):
    """One model as the user asked for it.

    `memory` is bytes per instance (0: unknown, always fits); `requirements` are capabilities every
    replica that hosts it must offer; `server` pins it to that server (otherwise only shared
    servers take it); `parameters` are passed to the agent as they are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    storage_uri: str = Field(min_length=1)
    requirements: tuple[Capability, ...] = ()
    memory: StrictInt = Field(0, ge=0)
    server: str | None = None
    parameters: dict[str, str] = Field(default_factory=dict)
    # Declared in this order so that each validator below sees the fields it compares with.
    min_replicas: StrictInt = Field(0, ge=0)
    max_replicas: StrictInt | None = Field(None, ge=0)
    replicas: StrictInt = Field(1, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_replicas(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("replicas") is None:
            minimum = data.get("min_replicas")
            usable = isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 0
            data = {**data, "replicas": minimum if usable else 1}
        return data

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                "must be lowercase letters, digits and '-', starting and ending with a letter or digit"
            )
        return name

    @field_validator("storage_uri")
    @classmethod
    def _no_credentials(cls, uri: str) -> str:
        # A spec is shown (model status, `modelyard model status`) and sent to agents: credentials
        # stay in the agents' own files (--fetch-bearer-token, --fetch-basic-auth) or environment.
        if _USERINFO.match(uri):
            raise PydanticCustomError(  # a type of its own: the value is not echoed back (_describe)
                _CREDENTIALS,
                "must not carry credentials (user:password@): give them to the agents as files "
                "(modelyard agent --fetch-basic-auth HOST=FILE, --fetch-bearer-token HOST=FILE)",
            )
        return uri

    @field_validator("server")
    @classmethod
    def _no_empty_pin(cls, server: str | None) -> str | None:
        return server or None  # Seldon's empty server name means "not pinned"

    @field_validator("max_replicas")
    @classmethod
    def _max_not_below_min(cls, maximum: int | None, info: ValidationInfo) -> int | None:
        if maximum is None:
            return None
        minimum = info.data.get("min_replicas")
        if minimum is not None and minimum > maximum:
            raise ValueError(f"must be at least min_replicas ({minimum})")
        return maximum or None

    @field_validator("replicas")
    @classmethod
    def _replicas_in_range(cls, replicas: int, info: ValidationInfo) -> int:
        minimum = info.data.get("min_replicas")
        if minimum is not None and replicas < minimum:
            raise ValueError(f"must be at least min_replicas ({minimum})")
        maximum = info.data.get("max_replicas")
        if maximum is not None and replicas > maximum:
            raise ValueError(f"must be at most max_replicas ({maximum})")
        return replicas


def parse_model_spec(
    data: object, source: str = "model", *, paths: Mapping[str, str] | None = None
) -> ModelSpec:
    """Validate a plain mapping into a ModelSpec; raises ModelSpecInvalid naming every problem's
    field path (`replicas: must be at least min_replicas (2) (got 1)`). `paths` renames top-level
    fields in those paths, for a manifest whose fields are spelled otherwise (`spec.minReplicas`)."""
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        raise ModelSpecInvalid(source, [_describe(err, paths or {}) for err in exc.errors()]) from None


def _describe(err: Mapping[str, Any], paths: Mapping[str, str]) -> str:
    path = ""
    loc = list(err["loc"])
    if loc and isinstance(loc[0], str) and loc[0] in paths:
        path = paths[loc.pop(0)]
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    kind = err["type"]
    message = "unknown field" if kind == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = (
        ""
        if kind in ("missing", "extra_forbidden", _CREDENTIALS) or isinstance(got, dict | list)
        else f" (got {got!r})"
    )
    return f"{path or '(top level)'}: {message}{shown}"


class SpecChange(enum.StrEnum):
    """What applying a spec does to a model that already has a latest version."""

    UNCHANGED = "unchanged"
    NEW_VERSION = "new_version"  # what the model is changed: a new version, rolled out beside the old
    SCALING = "scaling"  # only replicas/min/max changed: the latest version changes in place


def spec_change(latest: ModelSpec, new: ModelSpec) -> SpecChange:
    """Seldon's version rule (compat §6.1) for the latest version's spec and a newly applied one.

    A change to any field outside SCALING_FIELDS makes a new version (which carries the new
    scaling with it). Requirements compare as a set: listing the same capabilities in another
    order asks for the same placement, so it should not roll the model out again."""
    if latest.name != new.name:
        raise ValueError(f"specs of different models: {latest.name!r} and {new.name!r}")
    if _versioned(latest) != _versioned(new):
        return SpecChange.NEW_VERSION
    if any(getattr(latest, field) != getattr(new, field) for field in SCALING_FIELDS):
        return SpecChange.SCALING
    return SpecChange.UNCHANGED


def _versioned(spec: ModelSpec) -> dict[str, Any]:
    fields = spec.model_dump(exclude=set(SCALING_FIELDS))
    fields["requirements"] = frozenset(spec.requirements)
    return fields
