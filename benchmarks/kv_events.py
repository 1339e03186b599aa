"""prefix_aware's precise mode: how many KV-cache events one process absorbs, and what a routing
decision costs with the events' index against the approximate one.

    .venv/bin/python benchmarks/kv_events.py                   # about 20 s
    .venv/bin/python benchmarks/kv_events.py --prompt-words 2000 --endpoints 8

Ingest: batches shaped like a busy vLLM's (each stores a request's new blocks, 16 tokens each, and
removes as many evicted ones), encoded as vLLM encodes them, applied by `KvIndex.apply` (decoding
included, no socket): batches and events per second of one core. The ZMQ receive adds a few
microseconds per message (pyzmq's recv_multipart) on top.

Routing: `Balancer.look` for a chat request (the gateway's parsed body), approximate against
precise (the chat template rendered, the prompt tokenized by a real `tokenizers` BPE, its block
keys hashed, each endpoint's index matched), on endpoints whose indexes hold the prompt's first
half. Precise mode keeps the tokens of prompts' leading text (balancing/tokens.py `TokenCache`),
so it is timed on three kinds of traffic: the same prompt again, a new user message after the
same system prompt (half the prompt), and prompts that share nothing. Medians of rounds of CPU
time per call; the difference is what precise mode adds to a request, before it is sent.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from modelyard.balancing.balancer import Balancer
from modelyard.balancing.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvIndex,
    block_keys,
    encode_batch,
)
from modelyard.balancing.tokens import PromptTokens
from modelyard.config import ModelConfig

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
BLOCK = 16


def words(rng: random.Random, count: int, vocabulary: list[str]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def make_tokens(vocabulary: list[str], folder: Path) -> PromptTokens:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["[UNK]"], show_progress=False)
    rng = random.Random(1)
    tokenizer.train_from_iterator((words(rng, 50, vocabulary) for _ in range(2000)), trainer)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE)
    return PromptTokens.load(path, template)


def ingest(rounds: int, batches: int) -> None:
    rng = random.Random(2)
    payloads = []
    parent: int | None = None
    for i in range(batches):
        tokens = [rng.randrange(32000) for _ in range(4 * BLOCK)]
        hashes = [i * 8 + k for k in range(4)]
        events: list[object] = [BlockStored(hashes, parent, tokens, BLOCK)]
        if i >= 4:
            events.append(BlockRemoved([(i - 4) * 8 + k for k in range(4)]))
        parent = None if i % 16 == 15 else hashes[-1]  # a new prompt every 16 batches
        payloads.append(encode_batch(KVEventBatch(ts=float(i), events=events)))
    per_batch = []
    for _ in range(rounds):
        kv = KvIndex()
        kv.apply("a", 0, encode_batch(KVEventBatch(ts=0.0, events=[])), 0.0)
        started = time.process_time()
        for seq, payload in enumerate(payloads, 1):
            kv.apply("a", seq, payload, 0.0)
        per_batch.append((time.process_time() - started) / batches)
        assert kv.usable("a", 0.0) is not None
    median = statistics.median(per_batch)
    events = (2 * batches - 4) / batches
    print("| ingest | µs per batch (4 blocks stored, 4 removed) | batches/s | events/s |")
    print("|---|---:|---:|---:|")
    print(f"| KvIndex.apply | {median * 1e6:.1f} | {1 / median:,.0f} | {events / median:,.0f} |")


def look(rounds: int, calls: int, prompt_words: int, endpoints: int) -> None:
    rng = random.Random(3)
    vocabulary = [f"w{rng.randrange(10**6)}" for _ in range(3000)]
    names = [f"e{i}" for i in range(endpoints)]
    with tempfile.TemporaryDirectory() as folder:
        tokens = make_tokens(vocabulary, Path(folder))
    system = words(rng, prompt_words // 2, vocabulary)
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": words(rng, prompt_words - prompt_words // 2, vocabulary)},
        ],
    }
    prompt = "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])  # as the gateway's parse
    model = ModelConfig.model_validate(
        {
            "name": "m",
            "strategy": "prefix_aware",
            "endpoints": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(endpoints)],
        }
    )
    approximate = Balancer(model)
    precise = Balancer(model, tokens=tokens)
    ids = tokens.ids(body)
    assert ids is not None and precise.kv is not None
    half = len(ids) // 2 // BLOCK * BLOCK
    for name in names:
        stored = BlockStored(list(range(half // BLOCK)), None, ids[:half], BLOCK)
        precise.kv.apply(name, 0, encode_batch(KVEventBatch(ts=0.0, events=[stored])), 0.0)
    for balancer in (approximate, precise):
        chunks = balancer.prefixes.chunks(prompt)
        for name in names:
            balancer.on_cached(name, chunks[: len(chunks) // 2])
    view = precise.look(prompt, names, 0.0, body)
    assert all(held > 0 for held in view.held.values()), view.held
    assert (
        precise.kv.usable(names[0], 0.0) is not None
        and precise.kv.track(names[0]).match(block_keys(ids, BLOCK)) == half // BLOCK
    )

    # Three kinds of traffic: the same prompt again; a new user message after the same system
    # prompt (half the prompt); nothing shared. Each call gets a body made before the round.
    def bodies(kind: str, count: int) -> list[tuple[str, dict[str, object]]]:
        made = []
        for _ in range(count):
            if kind == "same":
                new = body
            else:
                head = system if kind == "shared system prompt" else words(rng, prompt_words // 2, vocabulary)
                user = words(rng, prompt_words - prompt_words // 2, vocabulary)
                new = {
                    "model": "m",
                    "messages": [{"role": "system", "content": head}, {"role": "user", "content": user}],
                }
            text = "\n".join(f"{m['role']}: {m['content']}" for m in new["messages"])  # type: ignore[attr-defined]
            made.append((text, new))
        return made

    rows = [
        ("approximate", approximate, "same"),
        *(("precise, " + k, precise, k) for k in ("same", "shared system prompt", "nothing shared")),
    ]
    results = {}
    for label, balancer, kind in rows:
        times = []
        for _ in range(rounds):
            made = bodies(kind, calls)
            given = label != "approximate"
            started = time.process_time()
            for text, new in made:
                balancer.look(text, names, 0.0, new if given else None)
            times.append((time.process_time() - started) / calls)
        results[label] = statistics.median(times)
    print()
    shape = (
        f"a chat of {prompt_words} words ({len(ids)} tokens, {len(prompt)} characters), {endpoints} endpoints"
    )
    print(f"| Balancer.look, {shape} | µs per call | more than approximate |")
    print("|---|---:|---:|")
    for label, seconds in results.items():
        print(f"| {label} | {seconds * 1e6:.1f} | {(seconds - results['approximate']) * 1e6:+.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--prompt-words", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=4)
    args = parser.parse_args()
    print(
        f"`benchmarks/kv_events.py --rounds {args.rounds} --batches {args.batches} --calls {args.calls} "
        f"--prompt-words {args.prompt_words} --endpoints {args.endpoints}`, medians of {args.rounds} rounds\n"
    )
    ingest(args.rounds, args.batches)
    look(args.rounds, args.calls, args.prompt_words, args.endpoints)


if __name__ == "__main__":
    main()
