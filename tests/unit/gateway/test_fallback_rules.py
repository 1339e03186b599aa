"""Fallback models' rules, without servers: which failures stand for which fallback_on condition,
how a server says a prompt is too long, how the request names the fallback, and which fallbacks
a request may go to (gateway/fallback.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from modelyard.config import ModelConfig
from modelyard.errors import (
    BadRequest,
    ModelNotAllowed,
    NoHealthyEndpoint,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.fallback import Candidate, Fallbacks, over_window, reason_for_error
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.protocols import oip, openai
from modelyard.security.api_keys import Caller
from modelyard.types import RoutingRequest


def cluster(name: str, **fields: Any) -> Cluster:
    config = ModelConfig.model_validate(
        {"name": name, "endpoints": [{"url": "http://127.0.0.1:9000"}], **fields}
    )
    return Cluster(config, {}, lambda *_: None, lambda *_: None)


def routing(words: int, **body: Any) -> RoutingRequest:
    return RoutingRequest(model="main", prompt="x " * words, prompt_tokens=words, fields=body)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Overloaded("full"), "saturated"),
        (NoHealthyEndpoint("none"), "no_endpoint"),
        (UpstreamTimeout("late"), "timeout"),
        (UpstreamUnreachable("refused"), "server_error"),
        (UpstreamError("reset"), "server_error"),
        (BadRequest("bad"), None),
        (ModelNotAllowed("no"), None),
    ],
)
def test_each_failure_stands_for_one_condition_or_none(error: Exception, reason: str | None) -> None:
    assert reason_for_error(error) == reason  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body",
    [
        b'{"error": {"message": "too long", "type": "invalid_request_error", '
        b'"code": "context_length_exceeded"}}',
        b'{"object": "error", "message": "This model\'s maximum context length is 4096 tokens. However, '
        b'you requested 5000 tokens", "type": "BadRequestError", "code": 400}',
        b'{"error": {"message": "The input (9000 tokens) is longer than the model\'s context length '
        b'(8192 tokens).", "code": 400}}',
        b'{"error": {"code": 400, "type": "exceed_context_size_error", "message": "..."}}',
    ],
)
def test_the_servers_ways_of_saying_the_prompt_is_too_long(body: bytes) -> None:
    assert openai.context_length_exceeded(400, body)
    assert not openai.context_length_exceeded(500, body)  # a 400 only


def test_other_400s_are_not_about_the_context() -> None:
    assert not openai.context_length_exceeded(400, b'{"error": {"code": "invalid_max_tokens"}}')


def test_the_fallback_is_named_in_the_path_or_else_the_body() -> None:
    assert oip.path_for_model("/v2/models/main/infer", "spare") == "/v2/models/spare/infer"
    assert oip.path_for_model("/v2/models/main/versions/3/infer?x=1", "b c") == "/v2/models/b%20c/infer?x=1"
    assert oip.path_for_model("/v1/models/main:predict", "a/b") == "/v1/models/a%2Fb:predict"
    assert oip.path_for_model("/v1/chat/completions", "spare") is None
    fields = {"model": "main", "messages": [], "max_tokens": 3}
    assert orjson.loads(openai.body_for_model(fields, "spare")) == {**fields, "model": "spare"}
    assert fields["model"] == "main"  # the asked model's request is left as it was
    spare = cluster("spare")
    path, body, renamed = Fallbacks.request_for(spare, "/v1/chat/completions", b"{}", routing(2, **fields))
    assert path == "/v1/chat/completions" and orjson.loads(body or b"")["model"] == "spare"
    assert renamed.model == "spare" and renamed.fields is not None and renamed.fields["model"] == "spare"


def test_the_context_window_counts_the_prompt_and_the_max_tokens_asked_for() -> None:
    windowed = cluster("main", context_window=10)
    assert not over_window(windowed, routing(8))  # no max_tokens asked: the prompt alone
    assert over_window(windowed, routing(8, max_tokens=3))
    assert over_window(windowed, routing(8, max_completion_tokens=3))
    assert not over_window(cluster("main"), routing(10_000, max_tokens=10_000))  # no window: the server says


def test_a_fallback_is_chosen_by_the_callers_key_what_is_served_its_window_and_routes() -> None:
    gold = [
        {
            "name": "gold",
            "match": {"headers": [{"name": "x-tier", "exact": "gold"}]},
            "destinations": [{"subset": "default"}],
        }
    ]
    clusters = {
        "main": cluster("main", fallbacks=["closed", "gone", "small", "picky", "open"]),
        "closed": cluster("closed"),
        "small": cluster("small", context_window=5),
        "picky": cluster("picky", routes=gold),
        "open": cluster("open"),
    }
    fallbacks = Fallbacks(clusters, GatewayMetrics(lambda: []))
    caller = Caller("a", "a-app", frozenset({"main", "gone", "small", "picky", "open"}))
    chosen = fallbacks.candidates(clusters["main"], {}, routing(8), caller)
    assert chosen == [
        Candidate("closed", None, None, "not_allowed"),
        Candidate("gone", None, None, "not_served"),
        Candidate("small", None, None, "context_window"),
        Candidate("picky", None, None, "no_route"),
        Candidate("open", clusters["open"], clusters["open"].route_for({}, None)),
    ]
    # auth off: every fallback served here whose window and routes take the request
    usable = fallbacks.candidates(clusters["main"], {"x-tier": "gold"}, routing(1), None)
    assert [(c.name, c.route.name if c.route else None) for c in usable if c.cluster] == [
        ("closed", "default"),
        ("small", "default"),
        ("picky", "gold"),
        ("open", "default"),
    ]
