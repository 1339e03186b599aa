"""modelyard bench: the workload a spec makes, and the summaries of outcomes."""

from __future__ import annotations

import csv
import json

import pytest

from modelyard.bench import Outcome, WorkloadSpec, build_requests, summarize
from modelyard.bench.report import median_of_runs, write
from modelyard.bench.workload import PROFILES, cacheable_share, prompt_tokens


def test_the_same_spec_makes_the_same_requests_and_another_seed_others():
    spec = WorkloadSpec(requests=50)
    assert build_requests(spec) == build_requests(spec)
    assert build_requests(spec) != build_requests(spec.model_copy(update={"seed": 1}))


def test_shares_of_repeats_and_shared_prefixes_follow_the_spec():
    spec = WorkloadSpec(
        requests=2000, repeat_share=0.5, shared_prefix_share=0.75, system_prompts=4, pool_size=40
    )
    requests = build_requests(spec)
    repeats = [r for r in requests if r.kind == "repeat"]
    assert 0.45 < len(repeats) / len(requests) < 0.55
    fresh = [r for r in requests if r.kind == "fresh"]
    assert 0.70 < sum(1 for r in fresh if r.system) / len(fresh) < 0.80
    assert len({r.system for r in requests if r.system}) == 4
    # Zipf popularity: the most asked pooled prompt is asked far more than the median one.
    counts = sorted((sum(1 for r in repeats if r.user == u) for u in {r.user for r in repeats}), reverse=True)
    assert counts[0] > 5 * counts[len(counts) // 2]
    assert len({r.user for r in requests if r.kind == "fresh"}) == len(requests) - len(
        repeats
    )  # never repeated


def test_a_repeat_is_the_whole_prompt_again_system_prompt_included():
    requests = build_requests(WorkloadSpec(requests=1000, pool_size=10, shared_prefix_share=0.5))
    systems: dict[str, set[str]] = {}
    for r in requests:
        if r.kind == "repeat":
            systems.setdefault(r.user, set()).add(r.system)
    assert len(systems) == 10
    assert all(len(s) == 1 for s in systems.values())
    assert {"" in s for s in systems.values()} == {True, False}  # some pooled prompts have none


def test_the_cacheable_share_counts_prefixes_asked_before_in_whole_blocks():
    once = WorkloadSpec(requests=200, repeat_share=0.0, shared_prefix_share=0.0)
    assert cacheable_share(build_requests(once)) == 0.0  # nothing is asked twice
    always = WorkloadSpec(requests=200, repeat_share=1.0, pool_size=1, shared_prefix_share=0.0)
    requests = build_requests(always)
    tokens = len(prompt_tokens(requests[0]))
    whole = tokens // 16 * 16  # the partial last block is never cached
    assert cacheable_share(requests) == pytest.approx(199 * whole / (200 * tokens))
    assert 0.4 < cacheable_share(build_requests(PROFILES["inferflow"].workload)) < 0.6


def test_a_request_body_is_an_openai_chat_request():
    spec = WorkloadSpec(requests=1, shared_prefix_share=1.0, stream=True, output_tokens=7)
    body = build_requests(spec)[0].body("m", spec)
    assert body["model"] == "m" and body["max_tokens"] == 7 and body["stream"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert len(body["messages"][0]["content"].split()) == spec.system_prompt_tokens + 2  # "system N:" + words


def test_the_inferflow_profile_has_its_published_shape():
    profile = PROFILES["inferflow"]
    assert (profile.workload.requests, profile.workload.concurrency, profile.workload.repeat_share) == (
        300,
        3,
        0.5,
    )
    assert profile.workload.system_prompts == 4
    assert (
        profile.sims.max_concurrency,
        profile.sims.prefill_ms_per_token,
        profile.sims.decode_ms_per_token,
    ) == (
        1,
        0.8,
        2.5,
    )


def test_the_quick_profile_is_inferflows_shape_with_fewer_requests():
    inferflow, quick = PROFILES["inferflow"], PROFILES["quick"]
    assert quick.sims == inferflow.sims
    assert quick.workload == inferflow.workload.model_copy(update={"requests": quick.workload.requests})
    # A run sends for well under half a minute even if no prompt token were ever cached: each
    # request's prefill and decode on one of 3 single-slot workers.
    spec, sims = quick.workload, quick.sims
    prompt = max(len(prompt_tokens(r)) for r in build_requests(spec))
    worst = spec.requests * (
        prompt * sims.prefill_ms_per_token + spec.output_tokens * sims.decode_ms_per_token
    )
    assert worst / 3 / 1000 < 20
    assert 100 <= spec.requests < inferflow.workload.requests  # yet enough for the caches to warm


def _outcome(latency: float, backend: str, prompt: int = 100, cached: int = 0, status: int = 200) -> Outcome:
    return Outcome(status, latency, None, backend, prompt, cached, "fresh")


def test_a_summary_has_percentiles_cache_share_and_the_busiest_backend():
    outcomes = [
        _outcome(0.1 * (i + 1), "w0" if i < 6 else "w1", cached=50 if i % 2 else 0) for i in range(10)
    ]
    outcomes.append(_outcome(0.0, "", status=0))
    summary = summarize("least_pending", outcomes, wall=2.0)
    assert (summary.requests, summary.errors) == (11, 1)
    assert summary.p50_ms == pytest.approx(500) and summary.p95_ms == pytest.approx(1000)
    assert summary.mean_ms == pytest.approx(550)
    assert summary.cached_share == pytest.approx(0.25)
    assert summary.busiest_share == pytest.approx(0.6) and summary.backends == {"w0": 6, "w1": 4}
    assert summary.req_per_s == pytest.approx(5.0)


def test_summaries_are_written_as_json_or_csv(tmp_path):
    summary = summarize("prefix_aware", [_outcome(0.2, "w0", cached=30)], wall=1.0)
    write(tmp_path / "out.json", [summary], "modelyard bench --spawn 3")
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["command"] == "modelyard bench --spawn 3" and data["runs"][0]["label"] == "prefix_aware"
    write(tmp_path / "out.csv", [summary], "cmd")
    rows = list(csv.DictReader((tmp_path / "out.csv").open()))
    assert rows[0]["label"] == "prefix_aware" and rows[0]["backends"] == "w0:1"


def test_a_duration_run_gets_fresh_prompts_without_end():
    import itertools

    from modelyard.bench import iter_requests

    spec = WorkloadSpec(requests=10, repeat_share=0.0)
    many = list(itertools.islice(iter_requests(spec), 500))
    assert len({r.user for r in many}) == 500  # never the first 10 again
    assert many[:10] == build_requests(spec)


def test_runs_merge_into_each_columns_median_and_the_median_runs_split():
    fast = summarize("least_pending", [_outcome(0.1, "w0", cached=20)] * 4, wall=1.0)
    middle = summarize("least_pending", [_outcome(0.2, "w1", cached=40)] * 4, wall=1.0)
    slow = summarize("least_pending", [_outcome(0.4, "w0")] * 3 + [_outcome(0.0, "", status=0)], wall=2.0)
    merged = median_of_runs([slow, fast, middle])
    assert (merged.p50_ms, merged.p95_ms) == (pytest.approx(200), pytest.approx(200))
    assert merged.cached_share == pytest.approx(0.2)  # the median of 0, 0.2 and 0.4
    assert (merged.requests, merged.errors) == (12, 1)  # every run's
    assert merged.backends == {"w1": 4}  # the run with the median P95
    assert sorted(merged.latencies_ms) == pytest.approx([100] * 4 + [200] * 4 + [400] * 3)
    assert median_of_runs([fast]) is fast
