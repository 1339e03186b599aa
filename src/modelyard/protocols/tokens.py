"""Token estimates, the same everywhere (the gateway's routing costs, the sim worker's latency):
without the model's tokenizer, text is counted in whitespace-separated words and binary tensor
bodies at about four bytes a token."""

from __future__ import annotations

BYTES_PER_TOKEN = 4


def count_tokens(text: str) -> int:
    return len(text.split())


def tokens_in_bytes(size: int) -> int:
    return size // BYTES_PER_TOKEN
