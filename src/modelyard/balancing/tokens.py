"""`PromptTokens`: the token ids a vLLM server hashes into cache blocks, for a request's body.

prefix_aware's precise mode matches a prompt against the blocks each server says it holds
(balancing/kv_events.py), so the gateway must tokenize as the server does: a completion's prompt
with the tokenizer's special tokens added (vLLM's default), a token-id prompt as it is, and a chat
rendered by the model's chat template (Jinja, in a sandbox, as Hugging Face's
`apply_chat_template` renders it, with the generation prompt) and then tokenized without adding
special tokens (the template writes them). A request this cannot tokenize as the server would (a
chat without a template, several prompts in one request) gets None: approximate routing.

Loading reads files (the gateway does it once, at start, and names the model and the file when it
fails: TokenizerError); `ids` is pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# Token ids a prompt given as ids may hold (no vocabulary is near this; the server refuses others).
_TOKEN_IDS = 1 << 32


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be loaded; the message names the file, `field`
    the setting that named it (prefix_aware's `tokenizer` or `chat_template`)."""

    def __init__(self, message: str, field: str = "tokenizer") -> None:
        super().__init__(message)
        self.field = field


def _raise_exception(message: str) -> None:  # what Hugging Face's templates call to refuse input
    raise TemplateError(message)


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None, **specials: str) -> None:
        self.tokenizer = tokenizer
        self._specials = specials  # bos_token, eos_token: the names templates use
        self._template = None
        if chat_template is not None:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = _raise_exception
            self._template = environment.from_string(chat_template)

    @classmethod
    def load(cls, path: str | Path, chat_template: str | Path | None = None) -> PromptTokens:
        """`path`: a tokenizer.json, or a Hugging Face model directory holding one (and its
        tokenizer_config.json, whose chat_template and bos/eos tokens are used). `chat_template`:
        a Jinja file, in place of the directory's."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # (tokenizers raises its own Exception for a bad file)
            raise TokenizerError(f"{file}: cannot load a tokenizer: {exc}") from None
        template: str | None = None
        specials: dict[str, str] = {}
        settings = file.parent / "tokenizer_config.json"
        if settings.is_file():
            try:
                data = json.loads(settings.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{settings}: {exc}") from None
            if isinstance(data, dict):
                found = data.get("chat_template")
                template = found if isinstance(found, str) else None
                for name in ("bos_token", "eos_token"):
                    token = data.get(name)
                    token = token.get("content") if isinstance(token, dict) else token
                    if isinstance(token, str):
                        specials[name] = token
        if chat_template is not None:
            try:
                template = Path(chat_template).read_text()
            except OSError as exc:
                raise TokenizerError(f"{chat_template}: {exc.strerror or exc}", "chat_template") from None
        try:
            return cls(tokenizer, template, **specials)
        except TemplateError as exc:
            where, field = (
                (chat_template, "chat_template") if chat_template is not None else (settings, "tokenizer")
            )
            raise TokenizerError(f"{where}: the chat template does not compile: {exc}", field) from None

    def ids(self, fields: Mapping[str, Any] | None) -> list[int] | None:
        """The prompt's token ids as the server computes them, or None (see the module's doc)."""
        if not fields:
            return None
        messages = fields.get("messages")
        if messages is not None:
            return self._chat(messages)
        prompt = fields.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        if (
            isinstance(prompt, list)
            and prompt
            and all(type(t) is int and 0 <= t < _TOKEN_IDS for t in prompt)
        ):
            return prompt
        return None

    def _chat(self, messages: object) -> list[int] | None:
        template = self._template
        if template is None or not isinstance(messages, list):
            return None
        try:
            text = template.render(messages=messages, add_generation_prompt=True, **self._specials)
        except Exception:  # (a refusal, or a hostile body: nesting that recurses too deep)
            return None  # a chat the template cannot render: routed approximately
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
