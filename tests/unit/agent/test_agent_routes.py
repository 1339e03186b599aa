"""What the agent's data plane forwards to the server: inference paths only (issue 28 item 3)."""

from __future__ import annotations

import pytest

from modelyard.agent.dataplane import Route, inference_route, model_in_body


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("GET", "/v2", Route(None)),
        ("GET", "/v2/health/live", Route(None)),
        ("HEAD", "/v2/health/ready", Route(None)),
        ("GET", "/v2/models/iris", Route("iris")),
        ("GET", "/v2/models/iris/ready", Route("iris")),
        ("GET", "/v2/models/iris/versions/2", Route("iris")),
        ("GET", "/v2/models/iris/versions/2/ready", Route("iris")),
        ("POST", "/v2/models/iris/infer", Route("iris")),
        ("POST", "/v2/models/iris/infer?trace=1", Route("iris")),
        ("POST", "/v2/models/iris/versions/2/infer", Route("iris")),
        ("POST", "/v2/models/llm/generate", Route("llm")),
        ("POST", "/v2/models/llm/generate_stream", Route("llm")),
        ("POST", "/v2/models/my%20model/infer", Route("my model")),
        ("GET", "/v1/models/iris", Route("iris")),
        ("POST", "/v1/models/iris:predict", Route("iris")),
        ("POST", "/v1/models/iris:explain", Route("iris")),
        ("POST", "/v1/chat/completions", Route(None, openai=True)),
        ("POST", "/v1/completions", Route(None, openai=True)),
        ("POST", "/v1/embeddings", Route(None, openai=True)),
    ],
)
def test_inference_paths_are_forwarded(method, path, route):
    assert inference_route(method, path) == route


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/repository/models/iris/unload"),
        ("POST", "/v2/repository/models/iris/load"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/models/iris/../../repository/models/iris/unload"),
        ("POST", "/v2/models/iris/./infer"),
        ("POST", "/v2/models/%2E%2E/infer"),
        ("POST", "/v2/models/a%2Fb/infer"),
        ("POST", "/v2/models/a%5Cb/infer"),
        ("POST", "/v2/models//infer"),
        ("POST", "/v2/models/iris/infer/"),
        ("POST", "/v2/models/iris/versions/infer"),
        ("POST", "/v2/models/iris/versions/1/2/infer"),
        ("POST", "/v2/models/iris/unload"),
        ("POST", "/v2/models/iris"),
        ("PUT", "/v2/models/iris/infer"),
        ("GET", "/v2/models/iris/infer"),
        ("GET", "/v2/models/iris/stats"),
        ("POST", "/v2/models/iris/trace/setting"),
        ("POST", "/v2/trace/setting"),
        ("POST", "/v2/logging"),
        ("POST", "/v2/systemsharedmemory/region/r/register"),
        ("POST", "/v2/health/live"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/iris:predict"),
        ("POST", "/v1/models/iris:unload"),
        ("POST", "/v1/models/:predict"),
        ("GET", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", ""),
        ("POST", "http://server/v2/models/iris/infer"),
        ("GET", "/sim/repository"),
    ],
)
def test_anything_else_is_not(method, path):
    assert inference_route(method, path) is None


def test_the_openai_model_comes_from_the_body():
    assert model_in_body(b'{"model": "llm", "messages": []}') == "llm"
    for body in (b"", b"{", b"[]", b'{"model": 3}', b'{"model": ""}'):
        assert model_in_body(body) is None
