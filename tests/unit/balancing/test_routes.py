"""Routes: which route a request takes (first match in order, a route without `match` is the
default) and which subset serves it (weights, sticky `hash_on`, mirrors). Pure: the headers,
body and RNG are arguments, so every case runs without a gateway."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from multidict import CIMultiDict

from modelyard.balancing.routes import compile_routes, mirrors, pick_subset, select_route
from modelyard.config import RouteConfig


def route(name: str, match: dict[str, Any] | None = None, **fields: Any) -> RouteConfig:
    fields.setdefault("destinations", [{"subset": name}])
    return RouteConfig.model_validate({"name": name, "match": match, **fields})


def selected(
    routes: list[RouteConfig],
    headers: dict[str, str] | None = None,
    model: str = "llama",
    body: dict[str, Any] | None = None,
) -> str | None:
    # The gateway hands in the request's headers, which look names up case-insensitively.
    chosen = select_route(compile_routes(routes), CIMultiDict(headers or {}), model, body)
    return chosen.name if chosen is not None else None


# --- select_route: order and the default route -------------------------------------------------------


def test_the_first_matching_route_wins_even_before_a_more_specific_one() -> None:
    routes = [
        route("any-beta", {"headers": [{"name": "x-tier"}]}),
        route("exact-beta", {"headers": [{"name": "x-tier", "exact": "beta"}]}),
        route("default"),
    ]
    assert selected(routes, {"x-tier": "beta"}) == "any-beta"
    assert selected(routes[1:], {"x-tier": "beta"}) == "exact-beta"


def test_a_route_without_match_is_the_default_wherever_it_stands() -> None:
    routes = [route("beta", {"headers": [{"name": "x-tier", "exact": "beta"}]}), route("default")]
    assert selected(routes, {"x-tier": "beta"}) == "beta"
    assert selected(routes, {"x-tier": "gold"}) == "default"
    assert selected(routes, {}) == "default"
    # placed first, the default shadows every route after it
    assert selected(routes[::-1], {"x-tier": "beta"}) == "default"


def test_no_route_matches_without_a_default() -> None:
    routes = [route("beta", {"headers": [{"name": "x-tier", "exact": "beta"}]})]
    assert selected(routes, {"x-tier": "gold"}) is None
    assert selected([], {"x-tier": "beta"}) is None


# --- header matches ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("test", "headers", "expected"),
    [
        # exact: the whole value, case-sensitive
        ({"exact": "beta"}, {"X-Tier": "beta"}, True),
        ({"exact": "beta"}, {"x-tier": "Beta"}, False),
        ({"exact": "beta"}, {"x-tier": "beta-2"}, False),
        ({"exact": ""}, {"x-tier": ""}, True),
        # prefix
        ({"prefix": "beta-"}, {"x-tier": "beta-users"}, True),
        ({"prefix": "beta-"}, {"x-tier": "beta-"}, True),
        ({"prefix": "beta-"}, {"x-tier": "old-beta-users"}, False),
        ({"prefix": "beta-"}, {"x-tier": "beta"}, False),
        # regex: a full match, not a search
        ({"regex": "v[0-9]"}, {"x-tier": "v1"}, True),
        ({"regex": "v[0-9]"}, {"x-tier": "v12"}, False),
        ({"regex": "v[0-9]"}, {"x-tier": "xv1"}, False),
        ({"regex": "v[0-9]+|canary"}, {"x-tier": "canary"}, True),
        # presence: any value, the empty one included
        ({}, {"x-tier": "anything"}, True),
        ({}, {"x-tier": ""}, True),
        # a missing header fails every kind of test
        ({}, {"x-other": "beta"}, False),
        ({"exact": "beta"}, {}, False),
        ({"prefix": ""}, {}, False),
        ({"regex": ".*"}, {}, False),
    ],
)
def test_header_match(test: dict[str, str], headers: dict[str, str], expected: bool) -> None:
    routes = [route("matched", {"headers": [{"name": "x-tier", **test}]})]
    assert (selected(routes, headers) == "matched") is expected


def test_every_header_test_must_hold() -> None:
    routes = [
        route(
            "both",
            {"headers": [{"name": "x-tier", "exact": "beta"}, {"name": "x-region", "prefix": "eu-"}]},
        )
    ]
    assert selected(routes, {"x-tier": "beta", "x-region": "eu-west"}) == "both"
    assert selected(routes, {"x-tier": "beta", "x-region": "us-east"}) is None
    assert selected(routes, {"x-tier": "gold", "x-region": "eu-west"}) is None
    assert selected(routes, {"x-tier": "beta"}) is None


# --- model and body matches -------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "expected"), [("llama", True), ("llama-2", False), ("Llama", False)])
def test_model_match(model: str, expected: bool) -> None:
    assert (selected([route("m", {"model": "llama"})], model=model) == "m") is expected


@pytest.mark.parametrize(
    ("field", "exact", "body", "expected"),
    [
        ("tier", "gold", {"tier": "gold"}, True),
        ("tier", "gold", {"tier": "silver"}, False),
        ("tier", "gold", {}, False),
        ("tier", "gold", None, False),  # no JSON body
        # dotted fields go through nested objects only
        ("metadata.tier", "gold", {"metadata": {"tier": "gold"}}, True),
        ("metadata.tier", "gold", {"metadata": {"other": "gold"}}, False),
        ("metadata.tier", "gold", {"metadata": "tier"}, False),
        ("metadata.tier", "gold", {"metadata": [{"tier": "gold"}]}, False),
        ("metadata.tier", "gold", {"metadata.tier": "gold"}, False),
        ("a.b.c", 3, {"a": {"b": {"c": 3}}}, True),
        # JSON types: true is not 1, 0 is not false; 1 and 1.0 are the same number
        ("flag", True, {"flag": True}, True),
        ("flag", True, {"flag": 1}, False),
        ("flag", 1, {"flag": True}, False),
        ("flag", False, {"flag": 0}, False),
        ("flag", 0, {"flag": False}, False),
        ("n", 1, {"n": 1.0}, True),
        ("n", 1, {"n": "1"}, False),
        # exact null matches an explicit null, not a missing field
        ("x", None, {"x": None}, True),
        ("x", None, {}, False),
    ],
)
def test_body_match(field: str, exact: Any, body: dict[str, Any] | None, expected: bool) -> None:
    routes = [route("b", {"body": [{"field": field, "exact": exact}]})]
    assert (selected(routes, body=body) == "b") is expected


def test_model_headers_and_body_must_all_hold() -> None:
    routes = [
        route(
            "all",
            {
                "model": "llama",
                "headers": [{"name": "x-tier", "exact": "beta"}],
                "body": [{"field": "stream", "exact": True}],
            },
        ),
        route("default"),
    ]
    request = {"headers": {"x-tier": "beta"}, "model": "llama", "body": {"stream": True}}
    assert selected(routes, **request) == "all"
    for key, other in (("headers", {"x-tier": "gold"}), ("model", "mistral"), ("body", {"stream": False})):
        assert selected(routes, **{**request, key: other}) == "default"


# --- pick_subset: weights -----------------------------------------------------------------------------


def split(*weights: int, hash_on: str | None = None) -> RouteConfig:
    destinations = [{"subset": f"s{i}", "weight": w} for i, w in enumerate(weights)]
    return route("split", destinations=destinations, hash_on=hash_on)


@pytest.mark.parametrize(
    "weights",
    [(50, 50), (90, 10), (1, 2, 7), (0, 100), (100, 0, 300)],
)
def test_weights_share_traffic(weights: tuple[int, ...]) -> None:
    rng, draws = random.Random(11), 6000
    counts = Counter(pick_subset(split(*weights), {}, rng) for _ in range(draws))
    total = sum(weights)
    for i, weight in enumerate(weights):
        share = counts[f"s{i}"] / draws
        assert abs(share - weight / total) < 0.025, (weights, counts)
        if weight == 0:
            assert counts[f"s{i}"] == 0


def test_zero_total_weight_sends_everything_to_the_first_destination() -> None:
    rng = random.Random(3)
    assert {pick_subset(split(0, 0, 0), {}, rng) for _ in range(200)} == {"s0"}


def test_a_single_destination_takes_everything() -> None:
    rng = random.Random(3)
    assert {pick_subset(split(5), {}, rng) for _ in range(200)} == {"s0"}


# --- pick_subset: hash_on stickiness ------------------------------------------------------------------


def test_the_same_hash_on_value_always_gets_the_same_subset() -> None:
    config = split(50, 50, hash_on="x-session")
    for session in (f"user-{i}" for i in range(100)):
        picks = {
            pick_subset(config, CIMultiDict({"X-Session": session}), random.Random(seed))
            for seed in range(10)
        }
        assert len(picks) == 1, session


def test_hash_on_values_spread_by_weight() -> None:
    config, sessions = split(30, 70, hash_on="x-session"), 4000
    rng = random.Random(0)
    counts = Counter(pick_subset(config, {"x-session": f"session-{i}"}, rng) for i in range(sessions))
    assert abs(counts["s0"] / sessions - 0.3) < 0.03, counts


def test_without_the_hash_on_header_the_pick_is_random_by_weight() -> None:
    config = split(50, 50, hash_on="x-session")
    rng, draws = random.Random(5), 2000
    counts = Counter(pick_subset(config, {"x-other": "same-every-time"}, rng) for _ in range(draws))
    assert abs(counts["s0"] / draws - 0.5) < 0.04, counts


def test_hash_on_is_the_same_in_another_process() -> None:
    # every gateway must send a session to the same subset; Python's own hash() is salted per process
    config = split(25, 25, 25, 25, hash_on="x-session")
    sessions = [f"user-{i}" for i in range(40)]
    here = [pick_subset(config, {"x-session": s}, random.Random(0)) for s in sessions]
    program = (
        "import random, sys\n"
        "from modelyard.balancing.routes import pick_subset\n"
        "from modelyard.config import RouteConfig\n"
        f"config = RouteConfig.model_validate({config.model_dump()!r})\n"
        f"for s in {sessions!r}:\n"
        "    print(pick_subset(config, {'x-session': s}, random.Random(1)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert there == here
    assert len(set(here)) > 1  # the sessions do spread


# --- mirrors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("percent", "expected_share"), [(0, 0.0), (100, 1.0), (25, 0.25), (2.5, 0.025)])
def test_mirror_percent(percent: float, expected_share: float) -> None:
    config = route("m", mirror={"subset": "shadow", "percent": percent})
    rng, draws = random.Random(9), 8000
    share = sum(mirrors(config, rng) for _ in range(draws)) / draws
    assert abs(share - expected_share) < 0.015
    if percent in (0, 100):
        assert share == expected_share


def test_no_mirror_never_mirrors() -> None:
    rng = random.Random(9)
    assert not any(mirrors(route("plain"), rng) for _ in range(100))
