"""Model-aware routes: which route a request takes, and which subset (endpoint group) serves it.

Routes are tried in order; the first whose `match` holds wins, and a route without `match` is the
default. A route splits traffic over its destinations by weight, per request, or sticky per
session when `hash_on` names a header: the header's value hashes to the same subset on every
gateway while the weights are unchanged. Pure: the RNG and the request come in as arguments.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from modelyard.config import Destination, HeaderMatch, ModelConfig, RouteConfig
from modelyard.errors import RoutesInvalid

ALL_SUBSETS = "*"  # the implicit route of a model without routes: every endpoint
# The route of a model without routes: every endpoint, the default timeouts and retries.
IMPLICIT_ROUTE = RouteConfig(name="default", destinations=[Destination(subset=ALL_SUBSETS)])


@dataclass(frozen=True, slots=True)
class CompiledRoute:
    config: RouteConfig
    regexes: tuple[re.Pattern[str] | None, ...]  # per header match, compiled once

    @property
    def name(self) -> str:
        return self.config.name


def compile_routes(routes: Sequence[RouteConfig]) -> tuple[CompiledRoute, ...]:
    return tuple(
        CompiledRoute(r, tuple(re.compile(h.regex) if h.regex is not None else None for h in _headers(r)))
        for r in routes
    )


def _headers(route: RouteConfig) -> list[HeaderMatch]:
    return route.match.headers if route.match else []


def select_route(
    routes: Sequence[CompiledRoute], headers: Mapping[str, str], model: str, body: Mapping[str, Any] | None
) -> CompiledRoute | None:
    """The first route whose every test holds. `headers` must look names up case-insensitively."""
    for route in routes:
        if _matches(route, headers, model, body):
            return route
    return None


def _matches(
    route: CompiledRoute, headers: Mapping[str, str], model: str, body: Mapping[str, Any] | None
) -> bool:
    match = route.config.match
    if match is None:
        return True
    if match.model is not None and match.model != model:
        return False
    for test, regex in zip(match.headers, route.regexes, strict=True):
        value = headers.get(test.name)
        if value is None:
            return False
        if test.exact is not None and value != test.exact:
            return False
        if test.prefix is not None and not value.startswith(test.prefix):
            return False
        if regex is not None and regex.fullmatch(value) is None:
            return False
    for check in match.body:
        found, value = _field(body, check.field)
        # JSON true is not the number 1 (as Python's True == 1 would have it).
        if not found or value != check.exact or isinstance(value, bool) != isinstance(check.exact, bool):
            return False
    return True


def _field(body: Mapping[str, Any] | None, dotted: str) -> tuple[bool, Any]:
    value: Any = body
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def pick_subset(route: RouteConfig, headers: Mapping[str, str], rng: random.Random) -> str:
    """A destination by weight: sticky by the `hash_on` header's value when present."""
    destinations = route.destinations
    if len(destinations) == 1:  # (most routes, the implicit one too: nothing to draw)
        return destinations[0].subset
    total = sum(d.weight for d in destinations)
    if total <= 0:
        return destinations[0].subset
    key = headers.get(route.hash_on) if route.hash_on else None
    if key is not None:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
        point = int.from_bytes(digest, "big") % total
    else:
        point = rng.randrange(total)
    for destination in destinations:
        point -= destination.weight
        if point < 0:
            return destination.subset
    return destinations[-1].subset  # pragma: no cover - the weights sum to total


def mirrors(route: RouteConfig, rng: random.Random) -> bool:
    """Whether this request is also copied to the route's mirror subset."""
    return route.mirror is not None and rng.random() * 100 < route.mirror.percent


def validate_routes(model: ModelConfig, raw: object) -> ModelConfig:
    """`model` with its routes replaced by `raw` (parsed JSON/YAML), checked against the model
    (subsets, matches, weights); raises RoutesInvalid with every problem."""
    try:
        return ModelConfig.model_validate({**model.model_dump(), "routes": raw})
    except ValidationError as exc:
        unknown = _unknown_subsets(raw, {e.subset for e in model.endpoints})
        problems = list(unknown)
        for err in exc.errors():
            loc, message = err["loc"], err["msg"].removeprefix("Value error, ")
            if loc[:1] == ("routes",):
                problems.append(f"routes{_path(loc[1:])}: {message}")
            elif not unknown:  # the model-level check repeats what `unknown` already says
                problems.append(message)
        raise RoutesInvalid(model.name, problems) from None


def _unknown_subsets(raw: object, subsets: set[str]) -> list[str]:
    """Subsets named by raw routes that no endpoint has; checked beside pydantic's field checks so
    that an update with several problems reports all of them (the model validator would run only
    once every field is valid)."""
    problems = []
    for i, route in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(route, dict):
            continue
        destinations = route.get("destinations")
        listed = destinations if isinstance(destinations, list) else []
        named = [d.get("subset") for d in listed if isinstance(d, dict)]
        mirror = route.get("mirror")
        if isinstance(mirror, dict):
            named.append(mirror.get("subset"))
        for subset in named:
            if isinstance(subset, str) and subset not in subsets:
                problems.append(
                    f"routes[{i}] ({route.get('name')}): no endpoint has subset {subset!r} "
                    f"(subsets: {', '.join(sorted(subsets))})"
                )
    return problems


def _path(loc: Sequence[int | str]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
