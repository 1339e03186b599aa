"""The tokenizer `--strategies prefix_aware:precise` gives its spawned sim-workers and gateway.

Precise mode needs the servers' token ids; the sim-workers count whitespace words. This writes a
real `tokenizers` tokenizer whose tokens are exactly those words (split at whitespace only, a
vocabulary of every word the bench and the sim-workers write; any other word, such as a prompt's
number, is [UNK]) and a chat template whose role markers stand where the sim-worker writes the
role: a prompt is as many tokens in both but one (the template's generation prompt), so precise
runs cost the servers what the others do. Distinct numbers in prompts ("chat 3.1:") are one
[UNK]: a prompt's other words tell it apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelyard.bench.workload import _VOCABULARY
from modelyard.simworker.text import _WORDS

ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The words the bench writes besides its vocabulary (workload.py: "system 0:", "chat 3.1:", ...).
_KEYWORDS = ("system", "pooled", "fresh", "chat", "task", "tool", "result", "agent", "tools:")


def write_word_tokenizer(folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json (the chat template) in `folder`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", *dict.fromkeys([*_VOCABULARY, *_WORDS, *_KEYWORDS, *map(str, range(1000))])]
    vocabulary = {word: i for i, word in enumerate(words)}
    for role in ROLES:
        vocabulary[role] = len(vocabulary)
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.add_special_tokens(list(ROLES))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder
