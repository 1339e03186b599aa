"""Conversations sent to a real sim-worker: each turn carries the server's own earlier answers,
so a server that keeps the conversation in its prefix cache serves most of each later prompt
from it; streams report time to first token and inter-token latency; an open loop of Poisson
arrivals stops at the requests asked for."""

from __future__ import annotations

from modelyard.bench import WorkloadSpec, run_workload, summarize
from modelyard.bench.workload import iter_conversations


async def test_each_turn_quotes_the_answers_before_it_and_the_server_caches_them(sim_workers):
    (worker,) = await sim_workers(1, decode_ms_per_token=1.0, cache_blocks=4096, block_tokens=4)
    spec = WorkloadSpec(
        requests=40,
        concurrency=4,
        turns=4.0,
        output_tokens=12,
        prompt_tokens=30,
        stream=True,
        shared_prefix_share=0.0,
    )
    outcomes, wall = await run_workload(worker.url, "sim-model", spec, iter_conversations(spec))
    assert len(outcomes) == 40 and all(o.status == 200 for o in outcomes)
    assert all(o.text and o.itl is not None and o.ttft is not None for o in outcomes)
    # later turns resend the conversation: their prompts grow, and the server has most of it
    later = [o for o in outcomes if o.prompt_tokens > 60]
    assert later and sum(o.cached_tokens for o in later) / sum(o.prompt_tokens for o in later) > 0.5
    summary = summarize("sim", outcomes, wall)
    assert summary.ttft_p95_ms is not None and summary.itl_p50_ms is not None and summary.itl_p50_ms >= 0.5


async def test_an_open_loop_of_conversations_stops_at_the_requests_asked_for(sim_workers):
    (worker,) = await sim_workers(1)
    spec = WorkloadSpec(
        requests=25, concurrency=8, rate=200.0, turns=3.0, agent_share=0.5, agent_prompt_tokens=50
    )
    outcomes, _ = await run_workload(worker.url, "sim-model", spec, iter_conversations(spec))
    assert len(outcomes) == 25 and {o.kind for o in outcomes} == {"chat", "agent"}


async def test_a_user_thinking_holds_no_request_slot_and_later_turns_count_from_when_sent(sim_workers):
    """Open loop, one request in flight at most: conversations whose users think for a while
    between turns do not keep the others out, and no turn's latency includes a think pause."""
    (worker,) = await sim_workers(1)
    spec = WorkloadSpec(requests=12, concurrency=1, rate=100.0, turns=3.0, think_seconds=0.2, output_tokens=2)
    outcomes, _ = await run_workload(worker.url, "sim-model", spec, iter_conversations(spec))
    assert len(outcomes) == 12
    assert max(o.latency for o in outcomes) < 0.15  # (a pause is 0.2 s on average)
