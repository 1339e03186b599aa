"""OpenAI API requests: the fields routing needs, read from one parse of the body."""

from __future__ import annotations

import re
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


def asks_usage(fields: dict[str, Any] | None) -> bool:
    """Whether a streamed request asks for its usage event itself (stream_options.include_usage)."""
    options = fields.get("stream_options") if fields is not None else None
    return isinstance(options, dict) and options.get("include_usage") is True


def with_usage_asked(fields: dict[str, Any]) -> bytes:
    """The request's body asking for the stream's usage event, its other stream options kept.
    `fields` (the parsed body) is changed too: a body made again from it (a fallback's) asks too."""
    options = fields.get("stream_options")
    fields["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return orjson.dumps(fields)


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


def usage_tokens(answer: bytes) -> int:
    """Prompt + completion tokens an answer's `usage` reports (0 when it reports none). Read from
    the usage object alone (its last one: the answer's own comes after its choices), not the
    whole answer: a parse of every answer would cost more than the rest of the request."""
    at = answer.rfind(b'"usage"')
    if at < 0:
        return 0
    found = _USAGE_OBJECT.match(answer, at)
    if found is None:
        return 0
    try:
        return _total(orjson.loads(found.group(1)))
    except orjson.JSONDecodeError:
        return 0


def _total(usage: object) -> int:
    """The usage's tokens, at most MAX_USAGE_TOKENS: a server's word, not to be trusted with an
    integer no counter holds."""
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if type(total) is not int or total < 0:
        counts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        total = sum(c for c in counts if type(c) is int and c >= 0)
    return min(total, MAX_USAGE_TOKENS)


MAX_USAGE_TOKENS = 1 << 32  # more than any context window: past it an answer's usage is not believed


class StreamUsage:
    """A server-sent event stream's usage, read as its events pass (`feed` each chunk, relay what
    it returns, `rest` at the end). Whole events only are passed on (a client acts on whole events
    only, so this delays nothing it could use); with `strip`, the usage event itself (no choices,
    a usage) is left out: the gateway asked for it, the client did not."""

    __slots__ = ("_pending", "_strip", "events", "tokens")

    def __init__(self, strip: bool) -> None:
        self._strip = strip
        self._pending = b""
        self.tokens = 0  # what the usage event said
        self.events = 0  # events relayed: about one token each, for a stream that ended without usage

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0 and len(data) < _MAX_EVENT:
            self._pending = data
            return b""
        if end == 0:  # no event ends in this much: not events to read, relay it as it is
            end = len(data)
        whole, self._pending = data[:end], data[end:]
        if b'"usage"' in whole:
            whole = b"".join(event for event in _EVENT_END.split(whole) if self._keep(event))
        self.events += whole.count(b"data:")
        return whole

    def rest(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                data = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(data, dict) and isinstance(data.get("usage"), dict):
                self.tokens = _total(data["usage"])
                if self._strip and not data.get("choices"):
                    return False
        return True


# `"usage": {...}` with no object nested in it (OpenAI's usage has *_details objects: allowed one deep)
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')
_MAX_EVENT = 1 << 20  # bytes without an event's end after which a stream is relayed as it comes
_EVENT_END = re.compile(rb"(?<=\n\n)|(?<=\r\n\r\n)")
