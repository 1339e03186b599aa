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

from modelyard.config import HeaderMatch, RouteConfig

ALL_SUBSETS = "*"  # the implicit route of a model without routes: every endpoint


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
    total = sum(d.weight for d in route.destinations)
    if total <= 0:
        return route.destinations[0].subset
    key = headers.get(route.hash_on) if route.hash_on else None
    if key is not None:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
        point = int.from_bytes(digest, "big") % total
    else:
        point = rng.randrange(total)
    for destination in route.destinations:
        point -= destination.weight
        if point < 0:
            return destination.subset
    return route.destinations[-1].subset  # pragma: no cover - the weights sum to total


def mirrors(route: RouteConfig, rng: random.Random) -> bool:
    """Whether this request is also copied to the route's mirror subset."""
    return route.mirror is not None and rng.random() * 100 < route.mirror.percent
