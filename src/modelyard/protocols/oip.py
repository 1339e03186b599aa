"""Open Inference Protocol v2 and KServe v1 requests: the model is in the path, the body is JSON.

OIP's binary tensor extension sends a JSON header of `Inference-Header-Content-Length` bytes
followed by raw tensor data; only that header is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping

from modelyard.errors import MalformedBody
from modelyard.protocols.openai import parse_json_object
from modelyard.protocols.tokens import tokens_in_bytes
from modelyard.types import RoutingRequest

BINARY_HEADER = "Inference-Header-Content-Length"


def routing_request(
    model: str, body: bytes, headers: Mapping[str, str], *, affinity_chars: int
) -> RoutingRequest:
    json_part = body
    header_length = headers.get(BINARY_HEADER)
    if header_length is not None:
        try:
            json_part = body[: int(header_length)]
        except ValueError:
            raise MalformedBody(f"{BINARY_HEADER} must be an integer, got {header_length!r}") from None
    fields = parse_json_object(json_part)
    # Tensors have no prompt; the leading bytes of the request stand in for one so that
    # identical inputs share affinity under kv_aware.
    prompt = json_part[:affinity_chars].decode("utf-8", "replace")
    return RoutingRequest(model=model, prompt=prompt, prompt_tokens=tokens_in_bytes(len(body)), fields=fields)
