"""Balancer.look in precise mode: what the KV events say overrules the approximate index's guess
where the events can be trusted, adds to it where they cannot, and never fails a request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kv_tokenizer import make_tokenizer, words
from modelyard.balancing.balancer import PRECISE_MAX_CHARS, Balancer
from modelyard.balancing.kv_events import BlockStored, KVEventBatch, encode_batch
from modelyard.balancing.tokens import PromptTokens
from modelyard.config import ModelConfig

SIZE = 16
NAMES = ("a", "b")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> PromptTokens:
    return PromptTokens.load(make_tokenizer(Path(tmp_path_factory.mktemp("tokenizer"))))


def balancer(tokens: PromptTokens) -> Balancer:
    endpoints = [{"name": n, "url": f"http://127.0.0.1:{9000 + i}"} for i, n in enumerate(NAMES)]
    return Balancer(
        ModelConfig.model_validate({"name": "m", "strategy": "prefix_aware", "endpoints": endpoints}),
        tokens=tokens,
    )


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def prompt_of(body: dict[str, Any]) -> str:  # as the gateway's parse renders it
    return "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])


def store(b: Balancer, name: str, ids: list[int], blocks: int, seq: int = 0) -> None:
    assert b.kv is not None
    event = BlockStored(list(range(1000 * seq, 1000 * seq + blocks)), None, ids[: blocks * SIZE], SIZE)
    b.kv.apply(name, seq, encode_batch(KVEventBatch(ts=0.0, events=[event])), 0.0)


def test_the_events_say_who_holds_the_prompt_and_how_much(tokens: PromptTokens) -> None:
    b = balancer(tokens)
    body = chat(words(0, 400))
    ids = tokens.ids(body)
    assert ids is not None
    store(b, "a", ids, len(ids) // SIZE // 2)  # half the prompt
    store(b, "b", ids, len(ids) // SIZE)  # all of it
    prompt = prompt_of(body)
    view = b.look(prompt, NAMES, 0.0, body)
    chunks = len(view.chunks)
    assert 0 < view.held["a"] < view.held["b"] <= chunks
    assert abs(view.held["a"] - chunks // 2) <= 2 and view.held["b"] >= chunks - 2


def test_live_events_overrule_the_guess_and_lost_ones_only_add_to_it(tokens: PromptTokens) -> None:
    b = balancer(tokens)
    body = chat(words(50, 400))
    ids = tokens.ids(body)
    assert ids is not None and b.kv is not None
    prompt = prompt_of(body)
    chunks = b.prefixes.chunks(prompt)
    for name in NAMES:
        b.on_cached(name, chunks)  # the guess: both were sent the whole prompt
    store(b, "a", [7] * SIZE, 1)  # a's events: it holds none of this prompt (evicted since)
    store(b, "b", [7] * SIZE, 1)
    b.kv.lost("b", 5)  # b's events were lost: its index is rebuilding
    view = b.look(prompt, NAMES, 0.0, body)
    assert view.held["a"] == 0  # live: the server said what it holds
    assert view.held["b"] == len(chunks)  # rebuilding: the guess stands where it says more


def test_requests_it_cannot_tokenize_are_routed_on_the_guess(tokens: PromptTokens) -> None:
    b = balancer(tokens)
    store(b, "a", [7] * SIZE, 1)
    long_text = words(0, PRECISE_MAX_CHARS // 6)
    for body in (
        {"model": "m", "messages": [{"role": "user", "content": [[["x"]]]}], "stream": True},
        {"model": "m", "messages": "not a list"},
        {"model": "m", "prompt": ["two", "prompts"]},
        {"model": "m", "prompt": [1, 2, -3]},
        chat(long_text),
    ):
        prompt = "x" * 200 if body.get("messages") != chat(long_text)["messages"] else prompt_of(body)
        b.on_cached("b", b.prefixes.chunks(prompt))
        view = b.look(prompt, NAMES, 0.0, body)
        assert view.held["a"] == 0 and view.held["b"] == len(view.chunks)


def test_a_template_that_fails_on_a_hostile_body_is_not_an_error(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path)
    (tmp_path / "deep.jinja").write_text("{% for m in messages %}{{ m.content | tojson }}{% endfor %}")
    b = balancer(PromptTokens.load(folder, tmp_path / "deep.jinja"))
    store(b, "a", [7] * SIZE, 1)
    nested: object = "x"
    for _ in range(5000):  # tojson recurses past Python's limit
        nested = [nested]
    view = b.look("x" * 100, NAMES, 0.0, {"messages": [{"role": "user", "content": nested}]})
    assert view.held == {"a": 0, "b": 0}


def test_a_quiet_endpoints_frozen_events_do_not_count(tokens: PromptTokens) -> None:
    b = balancer(tokens)
    body = chat(words(80, 300))
    ids = tokens.ids(body)
    assert ids is not None and b.kv is not None
    store(b, "a", ids, len(ids) // SIZE)
    prompt = prompt_of(body)
    assert b.look(prompt, NAMES, 0.0, body).held["a"] > 0
    for _ in range(8):
        b.kv.answered("a")  # answers go on, events stopped: what they said may be long gone
    assert b.look(prompt, NAMES, 3600.0, body).held["a"] == 0
