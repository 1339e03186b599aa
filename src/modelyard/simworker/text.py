"""Prompts, tokens and generated content: pure and deterministic across processes.

Tokens are approximated as whitespace-separated words. Seeds come from blake2b, never from
`hash()`, so the same prompt gives the same completion and embedding in every process.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

_VOCABULARY = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber birch cedar dune ember fjord "
    "granite harbor island jade kelp lagoon meadow nebula orchid prairie quartz river summit tundra umber "
    "valley willow xenon yarrow zephyr atlas beacon comet drift eddy flint glacier horizon ion jetty kestrel "
    "lumen"
)
_WORDS = tuple(_VOCABULARY.split())
_MASK64 = (1 << 64) - 1


def tokenize(text: str) -> list[str]:
    return text.split()


def chat_prompt(messages: Sequence[object]) -> str:
    """Join the messages as `role content` lines. Raises ValueError on a non-object message."""
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("each message must be an object")
        lines.append(f"{message.get('role', '')} {_content_text(message.get('content'))}")
    return "\n".join(lines)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return " ".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def completion_prompts(prompt: object) -> list[str]:
    """OpenAI's `prompt`: a string, a list of strings, a token array or a list of token arrays."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_array(p) for p in prompt):
            return [" ".join(map(str, p)) for p in prompt]
        if _is_token_array(prompt):
            return [" ".join(map(str, prompt))]
    raise ValueError("prompt must be a string, a list of strings or token arrays")


def embedding_inputs(value: object) -> list[str]:
    """OpenAI's embeddings `input`, in the same shapes as a completions prompt."""
    return completion_prompts(value)


def _is_token_array(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def generate_words(prompt: str, n: int, variant: int = 0) -> list[str]:
    """`n` words drawn from a fixed list by a 64-bit LCG seeded from the prompt (and the variant,
    so a "canary" worker can answer the same prompt differently)."""
    x = _seed(prompt if not variant else f"{variant}\0{prompt}")
    words = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & _MASK64
        words.append(_WORDS[(x >> 33) % len(_WORDS)])
    return words


def embed(text: str, dim: int) -> list[float]:
    """A unit-length vector of `dim` floats drawn from shake_256(text)."""
    raw = hashlib.shake_256(text.encode()).digest(4 * dim)
    ints = struct.unpack_from(f"<{dim}I", raw)
    vec = [i / 2147483647.5 - 1.0 for i in ints]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]
