import math

import pytest

from modelyard.simworker.text import chat_prompt, completion_prompts, embed, generate_words


def test_generation_is_deterministic_per_prompt():
    assert generate_words("hello world", 8) == generate_words("hello world", 8)
    assert generate_words("hello world", 8) != generate_words("hello there", 8)
    assert generate_words("x", 3) == generate_words("x", 5)[:3]
    assert generate_words("x", 0) == []


def test_chat_prompt_joins_role_and_content():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ]
    assert chat_prompt(messages) == "system be brief\nuser hi\nassistant "
    with pytest.raises(ValueError):
        chat_prompt(["not a message"])


def test_completion_prompt_shapes():
    assert completion_prompts("a b") == ["a b"]
    assert completion_prompts(["a", "b c"]) == ["a", "b c"]
    assert completion_prompts([1, 2, 3]) == ["1 2 3"]
    assert completion_prompts([[1, 2], [3]]) == ["1 2", "3"]
    for bad in (None, 5, [], [1, "a"], {"p": 1}):
        with pytest.raises(ValueError):
            completion_prompts(bad)


def test_embeddings_are_deterministic_unit_vectors():
    v = embed("some text", 16)
    assert len(v) == 16
    assert v == embed("some text", 16)
    assert v != embed("other text", 16)
    assert math.fsum(x * x for x in v) == pytest.approx(1.0)
    assert len(embed("t", 1000)) == 1000
