"""OpenAI API requests: the fields routing needs, read from one parse of the body."""

from __future__ import annotations

from typing import Any

import orjson

from modelyard.errors import BadRequest, MalformedBody
from modelyard.protocols.tokens import count_tokens
from modelyard.types import RoutingRequest

DEFAULT_MAX_TOKENS = 16  # what OpenAI-compatible servers assume for completions when unset
# How servers say a prompt (with max_tokens) is longer than the model takes, in a 400's body:
# OpenAI's error code; vLLM's "This model's maximum context length is N tokens"; SGLang's "... is
# longer than the model's context length"; llama.cpp's error type. Lower case: compared so.
_CONTEXT_LENGTH_MARKERS = (
    b"context_length_exceeded",
    b"maximum context length",
    b"model's context length",
    b"exceed_context_size",
)
_ERROR_BODY_READ = 65536  # bytes of an error body looked at for those


def context_length_exceeded(status: int, body: bytes) -> bool:
    """Whether an answer says the request is longer than the model's context window."""
    if status != 400:
        return False
    text = body[:_ERROR_BODY_READ].lower()
    return any(marker in text for marker in _CONTEXT_LENGTH_MARKERS)


def body_for_model(fields: dict[str, Any], model: str) -> bytes:
    """The request body (its parsed `fields`) naming `model` instead: what a fallback model is
    sent. (Only then: a request is otherwise forwarded as the bytes it came as.)"""
    return orjson.dumps({**fields, "model": model})


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise MalformedBody("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedBody(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def routing_request(body: bytes, kind: str) -> RoutingRequest:
    """`kind` is "chat", "completions" or "embeddings"."""
    data = parse_json_object(body)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if kind == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' is required and must be a list")
        prompt = _chat_prompt(messages)
    elif kind == "completions":
        prompt = _text_of(data.get("prompt", ""))
    else:
        prompt = _text_of(data.get("input", ""))
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = 0 if kind == "embeddings" else DEFAULT_MAX_TOKENS
    # (made by tuple.__new__: a NamedTuple's own __new__ is a Python function, and this runs per request)
    values = (model or "", prompt, count_tokens(prompt), max_tokens, data.get("stream") is True, data)
    return tuple.__new__(RoutingRequest, values)


def _chat_prompt(messages: list[Any]) -> str:
    parts: list[str] = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content", "")
            text = content if type(content) is str else _text_of(content)  # (most are strings)
            parts.append(f"{message.get('role', '')}: {text}")
    return "\n".join(parts)


def _text_of(value: Any) -> str:
    """Text of a prompt/content field: a string, a list of strings, or a list of content parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        pieces = []
        for item in value:
            if isinstance(item, str):
                pieces.append(item)
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                pieces.append(item["text"])
        return "\n".join(pieces)
    return ""
