"""PromptTokens: a request's tokens as vLLM computes them (the chat template rendered as
transformers renders it, then tokenized), or None where the gateway cannot know them."""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kv_tokenizer import ids, make_tokenizer, words
from modelyard.balancing.tokens import PromptTokens, TokenCache, TokenizerError


def with_template(folder: Path, template: object) -> PromptTokens:
    make_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return PromptTokens.load(folder)


def test_a_chat_is_rendered_by_its_template_then_tokenized(tmp_path: Path) -> None:
    tokens = PromptTokens.load(make_tokenizer(tmp_path))
    body = {
        "messages": [{"role": "system", "content": words(0, 5)}, {"role": "user", "content": words(9, 3)}]
    }
    expected = f"<|system|>{words(0, 5)}\n<|user|>{words(9, 3)}\n<|assistant|>"
    assert tokens.ids(body) == ids(expected)
    # content parts are one string, joined by newlines, as vLLM gives them to a template
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "word1"}, {"type": "text", "text": "word2"}],
            }
        ]
    }
    assert tokens.ids(parts) == ids("<|user|>word1\nword2\n<|assistant|>")


def test_a_completion_is_its_prompt_and_token_ids_are_themselves(tmp_path: Path) -> None:
    tokens = PromptTokens.load(make_tokenizer(tmp_path))
    assert tokens.ids({"prompt": words(3, 4), "messages": [{"role": "user", "content": "word0"}]}) == ids(
        words(3, 4)
    )
    assert tokens.ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    for refused in (
        {"prompt": ["a", "b"]},
        {"prompt": [1, -1]},
        {"prompt": [1, 1 << 40]},
        {"messages": "x"},
        {},
    ):
        assert tokens.ids(refused) is None


def test_templates_get_what_transformers_gives_them(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "|{{ tools | tojson }}|{{ strftime_now('%Y') }}|{{ extra }}|{{ add_generation_prompt }}"
    )
    tokens = with_template(tmp_path, template)
    assert tokens._template is not None
    body = {
        "messages": [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
        "tools": [{"b": "<x & y>", "a": "é"}],
        "chat_template_kwargs": {"extra": "kw"},
        "add_generation_prompt": False,
    }
    rendered = tokens._template.render(
        **{
            **body["chat_template_kwargs"],
            "messages": body["messages"],
            "tools": body["tools"],
            "add_generation_prompt": False,
        }
    )
    year = datetime.now().strftime("%Y")
    assert (
        rendered == f'first|[{{"b": "<x & y>", "a": "é"}}]|{year}|kw|False'
    )  # not HTML-escaped, keys kept in order
    assert tokens.ids(body) == list(tokens.tokenizer.encode(rendered, add_special_tokens=False).ids)


def test_named_templates_and_a_template_file_beside_the_tokenizer(tmp_path: Path) -> None:
    named = with_template(
        tmp_path / "named", [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    assert named._template is not None and named._template.render(messages=[]) == "D"
    folder = make_tokenizer(tmp_path / "beside")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}")
    beside = PromptTokens.load(folder)
    assert beside._template is not None and beside._template.render(messages=[1, 2]) == "J2"
    (folder / "chat_template.jinja").unlink()
    assert (
        PromptTokens.load(folder).ids({"messages": [{"role": "user", "content": "x"}]}) is None
    )  # no template


def test_what_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as caught:
        PromptTokens.load(tmp_path / "missing.json")
    assert caught.value.field == "tokenizer" and "missing.json" in str(caught.value)
    folder = make_tokenizer(tmp_path / "t")
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError) as caught:
        PromptTokens.load(folder, tmp_path / "bad.jinja")
    assert caught.value.field == "chat_template" and "bad.jinja" in str(caught.value)


@pytest.mark.parametrize("kind", ["bpe-whitespace", "byte-level"])
def test_the_token_cache_gives_what_the_tokenizer_gives(kind: str) -> None:
    """Prompts that share leading text of any length (cut anywhere, even inside a word or a
    multi-byte character) are tokenized as the tokenizer would tokenize them whole."""
    rng = random.Random(5)
    alphabet = [f"w{i}" for i in range(200)] + ["é", "日本", "x.y", "--", "\n"]
    corpus = [" ".join(rng.choice(alphabet) for _ in range(40)) for _ in range(300)]
    if kind == "byte-level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]", "<s>"], show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    if kind != "byte-level":  # a BOS added to a completion's prompt, as Llama's tokenizers do
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    assert TokenCache.agrees_with(tokenizer)
    cache = TokenCache(capacity=5000)
    heads = [" ".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))) for _ in range(8)]
    for _ in range(120):
        head = rng.choice(heads)
        text = head[: rng.randrange(len(head) + 1)] + " ".join(
            rng.choice(alphabet) for _ in range(rng.randrange(0, 200))
        )
        special = rng.random() < 0.5
        assert (
            cache.encode(tokenizer, text, special) == tokenizer.encode(text, add_special_tokens=special).ids
        )
    assert cache.found > 50  # (the cache was used: many prompts started with chunks seen before)


@pytest.mark.parametrize("kind", ["metaspace", "prepend"])
def test_a_tokenizer_that_marks_where_a_text_starts_gets_no_cache_and_its_own_ids(kind: str) -> None:
    """SentencePiece's tokenizers (Llama 2, Mistral) put "▁" in front of the text they are given,
    so a prompt's rest tokenizes differently from the same text inside the prompt."""
    rng = random.Random(6)
    corpus = [" ".join(f"w{rng.randrange(300)}" for _ in range(30)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    if kind == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    else:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], show_progress=False)
    )
    assert not TokenCache.agrees_with(tokenizer)
    tokens = PromptTokens(tokenizer)
    assert tokens.cache is None
    text = " ".join(corpus[:40])
    assert tokens.ids({"prompt": text}) == tokenizer.encode(text).ids
