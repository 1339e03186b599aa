"""The chat and agent workload: conversations shaped like chat logs, each turn carrying the ones
before it, and the capacity `--load` is a share of."""

from __future__ import annotations

import itertools
import statistics

from modelyard.bench import PROFILES, WorkloadSpec
from modelyard.bench.workload import SimShape, capacity, iter_conversations, mean_turns, request_tokens


def take(spec: WorkloadSpec, count: int):
    return list(itertools.islice(iter_conversations(spec), count))


def test_conversations_are_the_same_for_a_seed_and_shaped_as_asked():
    spec = WorkloadSpec(turns=3.5, agent_share=0.3, agent_steps=5.0, prompt_spread=1.0, output_spread=0.6)
    first = take(spec, 2000)
    assert first == take(spec, 2000)
    assert first != take(spec.model_copy(update={"seed": 1}), 2000)
    chats = [c for c in first if c.kind == "chat"]
    agents = [c for c in first if c.kind == "agent"]
    assert abs(len(agents) / len(first) - 0.3) < 0.04
    assert abs(statistics.fmean(len(c.messages) for c in chats) - 3.5) < 0.3
    assert abs(statistics.fmean(len(c.messages) for c in agents) - 5.0) < 0.5
    assert sum(len(c.messages) == 1 for c in chats) > len(chats) / 5  # a long tail: many short ones
    assert max(len(c.messages) for c in first) <= spec.max_turns
    words = [len(m.split()) for c in chats for m in c.messages]
    assert statistics.median(words) < statistics.fmean(words)  # lognormal: a tail of long messages
    assert len({c.system for c in agents}) == spec.agents
    assert all(len(c.system.split()) > spec.agent_prompt_tokens for c in agents)
    assert all(1 <= t <= 8 * spec.output_tokens for c in first for t in c.max_tokens)


def test_each_turn_carries_the_conversation_so_far():
    conversation = next(
        c
        for c in iter_conversations(WorkloadSpec(turns=4.0, shared_prefix_share=1.0))
        if len(c.messages) >= 3
    )
    answers = ["first answer", "second answer"]
    body = conversation.turn(2, answers).body("m", WorkloadSpec(stream=True))
    roles = [m["role"] for m in body["messages"]]  # type: ignore[index]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    contents = [m["content"] for m in body["messages"]]  # type: ignore[index]
    assert contents == [
        conversation.system,
        conversation.messages[0],
        "first answer",
        conversation.messages[1],
        "second answer",
        conversation.messages[2],
    ]
    assert body["max_tokens"] == conversation.max_tokens[2] and body["stream"] is True


def test_single_requests_are_unchanged_when_there_are_no_conversations():
    spec = WorkloadSpec()
    assert not spec.conversations and mean_turns(spec) == 1.0
    assert WorkloadSpec(turns=2.0).conversations and WorkloadSpec(agent_share=0.1).conversations


def test_capacity_is_what_full_slots_serve_with_nothing_cached():
    spec = WorkloadSpec(system_prompt_tokens=0, shared_prefix_share=0.0, prompt_tokens=100, output_tokens=50)
    prompt, output = request_tokens(spec)
    assert output == 50 and 100 < prompt < 110  # (the role and the "fresh n:" words count too)
    sims = SimShape(max_concurrency=4, prefill_ms_per_token=1.0, decode_ms_per_token=10.0, batch_slowdown=0.1)
    seconds = (prompt * 1.0 + 50 * 10.0 * (1 + 0.1 * 3)) / 1000
    assert abs(capacity(spec, sims, 3) - 3 * 4 / seconds) < 1e-9
    # a conversation's later turns resend the earlier ones: its requests cost more
    chat = PROFILES["chat"]
    longer, _ = request_tokens(chat.workload)
    single, _ = request_tokens(chat.workload.model_copy(update={"turns": 1.0, "agent_share": 0.0}))
    assert longer > 2 * single


def test_the_warm_up_is_sent_but_not_counted():
    from modelyard.bench import Outcome, summarize

    early = Outcome(200, 5.0, None, "w0", 10, 0, "chat", sent=1.0)
    late = [Outcome(200, 0.1, None, "w1", 10, 5, "chat", sent=6.0 + i) for i in range(4)]
    counted = summarize("s", [early, *late], wall=10.0, warmup=5.0)
    assert counted.requests == 4 and counted.p99_ms == 100.0 and counted.backends == {"w1": 4}
    assert counted.req_per_s == 4 / 5.0 and counted.cached_share == 0.5
    assert summarize("s", [early, *late], wall=10.0).requests == 5
