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
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from hashlib import blake2b as _blake2b
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (imported when a tokenizer is loaded: most gateways load none)
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
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:  # (Llama 3's templates write today's date)
    return datetime.now().strftime(format)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own: Jinja's escapes <, > and & for HTML and sorts keys, which would change
    # the text (and the blocks) of every prompt that shows tools as JSON
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _flattened(messages: list[Any]) -> list[Any]:
    """Messages whose content is a list of text parts get it as one string, parts joined by
    newlines, as vLLM gives templates that expect a string."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
        out.append(message)
    return out


# The token cache: prompts are cut into chunks of this many characters, and a chunk's tokens are
# kept once they end this many characters before the chunk's end (what follows a chunk can only
# change how its last characters are tokenized: pre-tokenizers split at spaces and punctuation).
_CHUNK_CHARS = 256
_SETTLED_MARGIN = 32
_CACHED_CHUNKS = 65536


def _end(offset: tuple[int, int]) -> int:
    return offset[1]


class TokenCache:
    """The tokens of prompts' leading text, so that a prompt that starts like one seen before (a
    system prompt, a conversation's earlier turns, an agent's instructions) is tokenized only
    from where it differs (llm-d's tokenization prefix cache does the same). Keyed by a chained
    hash of the text up to each chunk's end; each entry holds the tokens settled in that chunk and
    where the text goes on after them. Bounded: the least recently used chunks go first."""

    def __init__(self, capacity: int = _CACHED_CHUNKS) -> None:
        self.capacity = capacity
        # (ids as array('I'): a tenth of a list of ints' memory; 65,536 chunks of about 60 tokens
        # are then about 25 MB, not 170)
        self._chunks: OrderedDict[bytes, tuple[array[int], int]] = OrderedDict()
        self.found = 0  # chunks found, over every prompt (how much tokenizing it saved)

    @classmethod
    def agrees_with(cls, tokenizer: Tokenizer) -> bool:
        """Whether the cache gives exactly `tokenizer`'s ids on prompts cut mid-word, mid-character
        and at punctuation. A tokenizer that marks where a text starts (SentencePiece's "▁" put in
        front, a byte-level one's add_prefix_space) tokenizes a prompt's rest differently from the
        same text inside the prompt: it gets no cache, rather than wrong ids."""
        cache = cls(capacity=4096)
        words = ["alpha", "be-ta", "gam.ma", "日本語", "naïve", "x", "(delta)", "42,7", "éé", "\n", "  "]
        base = "".join(words[(i * 7) % len(words)] + " " * (i % 3 != 0) for i in range(400))
        for cut in (100, 257, 300, 515, 600, 777, 1100):
            for special in (True, False):
                for text in (base, base[:cut] + "zeta omega 語 " + base[cut:]):
                    if (
                        cache.encode(tokenizer, text, special)
                        != tokenizer.encode(text, add_special_tokens=special).ids
                    ):
                        return False
        return cache.found > 0

    def encode(self, tokenizer: Tokenizer, text: str, special: bool) -> list[int]:
        chunks = self._chunks
        names = []
        previous = b"\x01" if special else b"\x00"
        for start in range(0, len(text) - _CHUNK_CHARS + 1, _CHUNK_CHARS):
            previous = _blake2b(
                previous + text[start : start + _CHUNK_CHARS].encode(), digest_size=16
            ).digest()
            names.append(previous)
        ids: list[int] = []
        resume = 0  # where the text goes on after the tokens found
        found = 0
        for name in names:
            entry = chunks.get(name)
            if entry is None:
                break
            chunks.move_to_end(name)
            ids.extend(entry[0])
            resume = entry[1]
            found += 1
        self.found += found
        rest = tokenizer.encode(text[resume:] if resume else text, add_special_tokens=special and not resume)
        new = rest.ids
        ids.extend(new)
        if found < len(names):  # keep the chunks not found, as far as their tokens are settled
            offsets = rest.offsets
            taken = 0
            end = resume
            for index in range(found, len(names)):
                limit = (index + 1) * _CHUNK_CHARS - _SETTLED_MARGIN - resume
                first = taken
                # (token ends only grow: a bisection, not a loop over every token)
                taken = bisect_right(offsets, limit, lo=taken, key=_end)
                # never between two tokens that share a character (a byte-level token holding the
                # end of one character and the start of the next)
                while taken > first and taken < len(offsets) and offsets[taken][0] < offsets[taken - 1][1]:
                    taken -= 1
                if taken > first:
                    end = resume + offsets[taken - 1][1]
                chunks[names[index]] = (array("I", new[first:taken]), end)
            while len(chunks) > self.capacity:  # bounded: one removal per round
                chunks.popitem(last=False)
        return ids


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None, **specials: str) -> None:
        self.tokenizer = tokenizer
        self.cache = TokenCache() if TokenCache.agrees_with(tokenizer) else None
        self._specials = specials  # bos_token, eos_token: the names templates use
        self._template = None
        if chat_template is not None:
            # As transformers renders chat templates (so the text, and its blocks, are vLLM's):
            # loop controls, its tojson, raise_exception and strftime_now.
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            environment = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = _strftime_now
            self._template = environment.from_string(chat_template)

    @classmethod
    def load(cls, path: str | Path, chat_template: str | Path | None = None) -> PromptTokens:
        """`path`: a tokenizer.json, or a Hugging Face model directory holding one (and its
        tokenizer_config.json, whose chat_template and bos/eos tokens are used). `chat_template`:
        a Jinja file, in place of the directory's."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # (tokenizers raises its own Exception for a bad file)
            raise TokenizerError(f"{file}: cannot load a tokenizer: {exc}") from None
        # The whole prompt, as the server tokenizes it, not cut or padded to a training length.
        tokenizer.no_truncation()
        tokenizer.no_padding()
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
                if isinstance(found, list):  # named templates: the default one
                    found = next(
                        (
                            t.get("template")
                            for t in found
                            if isinstance(t, dict) and t.get("name") == "default"
                        ),
                        None,
                    )
                template = found if isinstance(found, str) else None
                for name in ("bos_token", "eos_token"):
                    token = data.get(name)
                    token = token.get("content") if isinstance(token, dict) else token
                    if isinstance(token, str):
                        specials[name] = token
        beside = file.parent / "chat_template.jinja"  # (where newer Hugging Face models keep it)
        if template is None and beside.is_file():
            chat_template = chat_template or beside
        if chat_template is not None:
            try:
                template = Path(chat_template).read_text()
            except OSError as exc:
                raise TokenizerError(f"{chat_template}: {exc.strerror or exc}", "chat_template") from None
        from jinja2 import TemplateError

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
        prompt = fields.get("prompt")
        if prompt is None and (messages := fields.get("messages")) is not None:
            return self._chat(messages, fields)
        if isinstance(prompt, str):
            return self._encode(prompt, True)
        if (
            isinstance(prompt, list)
            and prompt
            and all(type(t) is int and 0 <= t < _TOKEN_IDS for t in prompt)
        ):
            return prompt
        return None

    def _chat(self, messages: object, fields: Mapping[str, Any]) -> list[int] | None:
        template = self._template
        if template is None or not isinstance(messages, list):
            return None
        # What vLLM gives the template from the body: tools, documents, its chat_template_kwargs.
        extra = fields.get("chat_template_kwargs")
        values = {
            **self._specials,
            **(extra if isinstance(extra, dict) else {}),
            "messages": _flattened(messages),
            "tools": fields.get("tools"),
            "documents": fields.get("documents"),
            "add_generation_prompt": fields.get("add_generation_prompt", True) is not False,
            "continue_final_message": fields.get("continue_final_message") is True,
        }
        try:
            text = template.render(**values)
        except Exception:  # (a refusal, or a hostile body: nesting that recurses too deep)
            return None  # a chat the template cannot render: routed approximately
        return self._encode(text, False)

    def _encode(self, text: str, special: bool) -> list[int]:
        if self.cache is not None:
            return self.cache.encode(self.tokenizer, text, special)
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)
