"""On chat and agent traffic (the `chat` profile: multi-turn conversations quoting the servers'
answers, agent loops over long instructions, open-loop arrivals, servers batching 8 requests),
prefix_aware comes close to an oracle that knows every cache and batch: `benchmarks/chat_sim.py`,
replayed through the gateway's own Balancer in virtual time (the full runs are the benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


_load("routing_sim")
chat_sim = _load("chat_sim")


@pytest.mark.parametrize("load", [0.7, 0.9])
def test_prefix_aware_caches_within_3_points_of_the_oracle_at_the_lowest_time_to_first_token(load):
    names = ["least_pending", "round_robin", "prefix_aware", "prefix_aware:precise"]
    rows = chat_sim.run(names, "chat", workers=4, load=load, seeds=2, requests=400)  # (medians of 2)
    oracle = rows["oracle"]
    assert oracle["cached"] <= oracle["ceiling"]  # (no router beats a cache without a size limit)
    for name in ("prefix_aware", "prefix_aware:precise"):
        row = rows[name]
        assert row["cached"] >= oracle["cached"] - 0.03, (name, row, oracle)
        for other in ("least_pending", "round_robin"):
            assert row["ttft95"] <= rows[other]["ttft95"], (name, other, row, rows[other])
            assert row["ttft50"] <= rows[other]["ttft50"], (name, other, row, rows[other])
            assert row["mean"] <= 1.03 * rows[other]["mean"], (name, other, row, rows[other])


def test_each_turn_quotes_the_answer_the_server_gave_so_the_next_turn_finds_it_cached():
    """A conversation's second turn carries its first turn's prompt and the sim-worker's answer:
    its prefix is the first turn's prompt, whole blocks of which a server that ran it holds."""
    spec = chat_sim.PROFILES["chat"].workload
    conversation = next(c for c in chat_sim.iter_conversations(spec) if len(c.messages) > 1)
    first = conversation.turn(0, [])
    said = chat_sim.answer(first, spec)
    assert len(said.split()) == (first.max_tokens or spec.output_tokens)
    second = conversation.turn(1, [said])
    before, after = chat_sim.prompt_tokens(first), chat_sim.prompt_tokens(second)
    assert (
        after[: len(before)] == before
        and said.split() == after[len(before) + 1 : len(before) + 1 + len(said.split())]
    )
