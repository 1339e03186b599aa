"""Wire formats: what routing reads from each protocol's body, and each protocol's error envelope."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from modelyard.errors import (
    BadRequest,
    MalformedBody,
    ModelNotFound,
    ModelyardError,
    RoutesInvalid,
    UpstreamTimeout,
)
from modelyard.protocols import envelope, oip, openai
from modelyard.protocols.tokens import count_tokens, tokens_in_bytes
from modelyard.types import Protocol


def body(data: Any) -> bytes:
    return orjson.dumps(data)


# OpenAI


def test_chat_prompt_joins_messages_including_content_parts() -> None:
    request = openai.routing_request(
        body(
            {
                "model": "llama",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hello"},
                            {"type": "image_url", "image_url": {"url": "data:..."}},
                            {"type": "text", "text": "world"},
                        ],
                    },
                ],
            }
        ),
        "chat",
    )
    assert request.model == "llama"
    assert request.prompt == "system: be brief\nuser: hello\nworld"
    assert request.prompt_tokens == 6


@pytest.mark.parametrize(
    ("prompt", "text"),
    [("Once upon a time", "Once upon a time"), (["first one", "second"], "first one\nsecond"), (None, "")],
)
def test_completions_prompt(prompt: Any, text: str) -> None:
    request = openai.routing_request(body({"model": "m", "prompt": prompt}), "completions")
    assert request.prompt == text
    assert request.prompt_tokens == len(text.split())


@pytest.mark.parametrize(("value", "text"), [("embed me", "embed me"), (["a b", "c"], "a b\nc")])
def test_embeddings_input(value: Any, text: str) -> None:
    request = openai.routing_request(body({"model": "e", "input": value}), "embeddings")
    assert request.prompt == text


@pytest.mark.parametrize(("kind", "default"), [("chat", 16), ("completions", 16), ("embeddings", 0)])
def test_max_tokens_default(kind: str, default: int) -> None:
    data = {"model": "m", "messages": [], "prompt": "x", "input": "x"}
    assert openai.routing_request(body(data), kind).max_tokens == default


def test_max_tokens_given() -> None:
    request = openai.routing_request(body({"model": "m", "prompt": "x", "max_tokens": 100}), "completions")
    assert request.max_tokens == 100


def test_max_completion_tokens_preferred_over_max_tokens() -> None:
    data = {"model": "m", "messages": [], "max_tokens": 100, "max_completion_tokens": 50}
    assert openai.routing_request(body(data), "chat").max_tokens == 50


@pytest.mark.parametrize("bad", ["100", 1.5, True, None])
def test_non_integer_max_tokens_falls_back_to_default(bad: Any) -> None:
    data = {"model": "m", "messages": [], "max_tokens": bad}
    assert openai.routing_request(body(data), "chat").max_tokens == 16


@pytest.mark.parametrize(
    ("stream", "expected"), [(True, True), (False, False), ("true", False), (None, False)]
)
def test_stream_flag(stream: Any, expected: bool) -> None:
    data = {"model": "m", "messages": [], "stream": stream}
    assert openai.routing_request(body(data), "chat").stream is expected


def test_missing_model_is_empty() -> None:
    assert openai.routing_request(body({"prompt": "x"}), "completions").model == ""


@pytest.mark.parametrize("raw", [b'{"model": "m", ', b"not json", b"", b"\xff\xfe"])
def test_malformed_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(MalformedBody) as info:
        openai.routing_request(raw, "chat")
    assert info.value.status == 400
    assert info.value.code == "invalid_json"


@pytest.mark.parametrize(("raw", "kind"), [(b"[1, 2]", "list"), (b'"text"', "str"), (b"3", "int")])
def test_non_object_body_is_a_400(raw: bytes, kind: str) -> None:
    with pytest.raises(MalformedBody) as info:
        openai.routing_request(raw, "completions")
    assert info.value.status == 400
    assert kind in info.value.message


@pytest.mark.parametrize(
    "data", [{"model": "m"}, {"model": "m", "messages": "hi"}, {"model": "m", "messages": {}}]
)
def test_chat_without_messages_list_is_a_bad_request(data: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as info:
        openai.routing_request(body(data), "chat")
    assert info.value.status == 400
    assert "'messages'" in info.value.message


@pytest.mark.parametrize("model", [3, ["m"], {"name": "m"}, True])
def test_non_string_model_is_a_bad_request(model: Any) -> None:
    with pytest.raises(BadRequest) as info:
        openai.routing_request(body({"model": model, "prompt": "x"}), "completions")
    assert info.value.status == 400
    assert "'model' must be a string" in info.value.message


# Open Inference Protocol v2 / KServe v1

INFER = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


def test_oip_json_body() -> None:
    raw = body(INFER)
    request = oip.routing_request("mnist", raw, {}, affinity_chars=1000)
    assert request.model == "mnist"
    assert request.prompt == raw.decode()
    assert request.prompt_tokens == len(raw) // 4


def test_oip_prompt_is_the_leading_bytes_up_to_affinity_chars() -> None:
    raw = body(INFER)
    assert oip.routing_request("m", raw, {}, affinity_chars=10).prompt == raw[:10].decode()


def test_oip_binary_extension_parses_only_the_json_head() -> None:
    head = body(
        {"inputs": [{"name": "x", "shape": [4], "datatype": "BYTES", "parameters": {"binary_data_size": 4}}]}
    )
    raw = head + b"\xff\x00\x80\x01"
    headers = CIMultiDict({"inference-header-content-length": str(len(head))})
    request = oip.routing_request("m", raw, headers, affinity_chars=4096)
    assert request.prompt == head.decode()
    assert request.prompt_tokens == len(raw) // 4

    with pytest.raises(MalformedBody):
        oip.routing_request("m", raw, {}, affinity_chars=4096)


@pytest.mark.parametrize("value", ["abc", "", "1.5"])
def test_oip_bad_binary_header_value_is_a_400(value: str) -> None:
    with pytest.raises(MalformedBody) as info:
        oip.routing_request("m", body(INFER), {oip.BINARY_HEADER: value}, affinity_chars=100)
    assert info.value.status == 400
    assert oip.BINARY_HEADER in info.value.message


def test_oip_binary_header_that_cuts_the_json_is_a_400() -> None:
    raw = body(INFER)
    with pytest.raises(MalformedBody):
        oip.routing_request("m", raw, {oip.BINARY_HEADER: "5"}, affinity_chars=100)


# Envelopes


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("/v1/chat/completions", Protocol.OPENAI),
        ("/v1/completions", Protocol.OPENAI),
        ("/v1/embeddings", Protocol.OPENAI),
        ("/v1/models", Protocol.OPENAI),
        ("/v1/models/x:predict", Protocol.KSERVE_V1),
        ("/v1/models/x", Protocol.KSERVE_V1),
        ("/v2/models/x/infer", Protocol.OIP),
        ("/v2/health/ready", Protocol.OIP),
        ("/v2", Protocol.OIP),
        ("/healthz", Protocol.PLAIN),
        ("/admin/strategy", Protocol.PLAIN),
    ],
)
def test_protocol_for_path(path: str, protocol: Protocol) -> None:
    assert envelope.protocol_for_path(path) is protocol


@pytest.mark.parametrize("protocol", [Protocol.OPENAI, Protocol.PLAIN])
def test_openai_envelope(protocol: Protocol) -> None:
    error = ModelNotFound("gpt-x", ["llama", "mistral"])
    assert orjson.loads(envelope.error_body(protocol, error)) == {
        "error": {
            "message": error.message,
            "type": "not_found_error",
            "param": None,
            "code": "model_not_found",
        }
    }


def test_openai_envelope_code_defaults_to_type() -> None:
    assert orjson.loads(envelope.error_body(Protocol.OPENAI, ModelyardError("boom"))) == {
        "error": {"message": "boom", "type": "internal_error", "param": None, "code": "internal_error"}
    }
    assert orjson.loads(envelope.error_body(Protocol.OPENAI, BadRequest("no")))["error"]["code"] == (
        "invalid_request_error"
    )


@pytest.mark.parametrize("protocol", [Protocol.OIP, Protocol.KSERVE_V1])
def test_oip_and_kserve_envelope_is_the_message_only(protocol: Protocol) -> None:
    error = UpstreamTimeout("upstream did not answer within 600s")
    assert orjson.loads(envelope.error_body(protocol, error)) == {
        "error": "upstream did not answer within 600s"
    }


@pytest.mark.parametrize("protocol", list(Protocol))
def test_envelope_of_a_message_quoting_a_lone_surrogate(protocol: Protocol) -> None:
    # A JSON or YAML "\ud800" escape decodes to a lone surrogate that UTF-8 cannot encode; the
    # envelope renders it as the escape instead of failing (found by the schemathesis run).
    error = RoutesInvalid("m", ["routes[0].name: bad \ud800"])
    body = orjson.loads(envelope.error_body(protocol, error))
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    assert message.endswith("bad \\ud800")
    if protocol not in (Protocol.OIP, Protocol.KSERVE_V1):
        assert body["error"]["problems"] == ["routes[0].name: bad \\ud800"]


def test_model_not_found_names_known_models() -> None:
    error = ModelNotFound("gpt-x", ["mistral", "llama"])
    assert error.status == 404
    assert error.message == "model 'gpt-x' not found; known models: llama, mistral"


def test_model_not_found_without_model_or_known_models() -> None:
    assert ModelNotFound("", []).message == "no model given; known models: (none)"


def test_tokens_are_words_and_tensor_bytes_are_four_a_token() -> None:
    assert count_tokens("") == 0
    assert count_tokens("  one two\nthree\t") == 3
    assert tokens_in_bytes(0) == 0 and tokens_in_bytes(4096) == 1024


def test_a_routing_requests_repr_leaves_the_body_out() -> None:
    routing = openai.routing_request(b'{"model": "m", "messages": [], "api_key": "secret"}', "chat")
    assert routing.fields == {"model": "m", "messages": [], "api_key": "secret"}
    assert "secret" not in repr(routing) and "model='m'" in repr(routing)
