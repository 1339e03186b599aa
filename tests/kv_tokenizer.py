"""A small real tokenizer for the KV-cache events tests (the sim-worker's and the gateway's).

`make_tokenizer(folder)` writes a `tokenizers` word-level tokenizer (`WORDS` and the chat role
markers, whitespace pre-tokenized) as folder/tokenizer.json and a tokenizer_config.json with a
chat template (`TEMPLATE`) beside it: a folder `PromptTokens.load` (and `--tokenizer`) takes.
Deterministic: a word's id is its place in `WORDS` plus one; `ids(text)` says them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = tuple(f"word{i}" for i in range(500))
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
UNKNOWN = "[UNK]"


def vocabulary() -> dict[str, int]:
    """[UNK] is 0, WORDS[i] is i + 1, then the role markers."""
    vocab = {UNKNOWN: 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    for role in ROLES:
        vocab[role] = len(vocab)
    return vocab


def make_tokenizer(folder: Path) -> Path:
    """Write the tokenizer and its config into `folder` (made if missing); returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token=UNKNOWN))
    tokenizer.add_special_tokens(list(ROLES))  # whole tokens, before the pre-tokenizer splits "<|"
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def ids(text: str) -> list[int]:
    """The ids of `text` under this tokenizer, without loading it (words of WORDS, role markers)."""
    vocab = vocabulary()
    out: list[int] = []
    for piece in text.replace("|>", "|> ").replace("<|", " <|").split():
        out.append(vocab.get(piece, 0))
    return out


def words(start: int, count: int) -> str:
    """`count` consecutive words of WORDS from `start` (wrapping), as prompt text."""
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(count))
