import pytest

from modelyard.simworker.latency import (
    CostModel,
    PrefixCache,
    block_hashes,
    cache_usage,
    kv_blocks_needed,
    plan_prefill,
)
from modelyard.simworker.text import tokenize


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_tokens_are_whitespace_separated_words():
    assert tokenize("  hello   big\nworld\t!") == ["hello", "big", "world", "!"]


def test_block_hashes_cover_full_blocks_only():
    assert len(block_hashes(words("t", 47), 16)) == 2
    assert len(block_hashes(words("t", 48), 16)) == 3
    assert block_hashes(words("t", 15), 16) == []


def test_block_hashes_are_chained():
    a = words("a", 32)
    b = words("b", 16) + a[16:]  # same second block, different first block
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]
    assert block_hashes(a, 16) == ha  # deterministic


def test_different_first_block_means_no_hit_on_later_blocks():
    cache = PrefixCache(capacity=16)
    a = words("a", 32)
    plan_prefill(cache, a, 16)
    b = words("b", 16) + a[16:]
    assert plan_prefill(cache, b, 16).cached_tokens == 0


def test_repeated_prompt_hits_its_full_blocks():
    cache = PrefixCache(capacity=16)
    prompt = words("p", 40)
    first = plan_prefill(cache, prompt, 16)
    assert (first.prompt_tokens, first.cached_tokens, first.uncached_tokens) == (40, 0, 40)
    second = plan_prefill(cache, prompt, 16)
    assert (second.cached_tokens, second.uncached_tokens) == (32, 8)


def test_shared_prefix_hits_only_the_common_leading_blocks():
    cache = PrefixCache(capacity=16)
    system = words("sys", 32)
    plan_prefill(cache, system + words("q", 16), 16)
    other = plan_prefill(cache, system + words("r", 16), 16)
    assert other.cached_tokens == 32


def test_match_stops_at_the_first_miss():
    cache = PrefixCache(capacity=8)
    cache.insert([b"a", b"c"])
    assert cache.match([b"a", b"b", b"c"]) == 1
    assert cache.match([b"x", b"a"]) == 0


def test_lru_evicts_least_recently_used_at_capacity():
    cache = PrefixCache(capacity=2)
    cache.insert([b"a"])
    cache.insert([b"b"])
    cache.insert([b"a"])  # touch a: b is now the oldest
    cache.insert([b"c"])
    assert len(cache) == 2
    assert b"a" in cache and b"c" in cache and b"b" not in cache


def test_a_prompts_tail_is_evicted_before_its_head():
    cache = PrefixCache(capacity=3)
    cache.insert([b"h", b"m", b"t"])
    cache.insert([b"x"])
    assert b"t" not in cache
    assert cache.match([b"h", b"m", b"t"]) == 2


def test_zero_capacity_caches_nothing():
    cache = PrefixCache(capacity=0)
    prompt = words("p", 32)
    plan_prefill(cache, prompt, 16)
    assert plan_prefill(cache, prompt, 16).cached_tokens == 0
    assert len(cache) == 0


def test_no_cache_means_every_token_is_prefilled():
    assert plan_prefill(None, words("p", 32), 16).uncached_tokens == 32


def test_costs_scale_with_tokens_and_slowdown():
    costs = CostModel(prefill_ms_per_token=0.5, decode_ms_per_token=4.0, slowdown=2.0)
    assert costs.prefill_ms(10) == pytest.approx(10.0)
    assert costs.decode_ms() == pytest.approx(8.0)
    assert costs.decode_ms(3) == pytest.approx(24.0)
    assert CostModel(0.0, 0.0).prefill_ms(1000) == 0.0


def test_cached_tokens_cost_no_prefill():
    cache = PrefixCache(capacity=16)
    costs = CostModel(prefill_ms_per_token=1.0, decode_ms_per_token=0.0)
    prompt = words("p", 40)
    assert costs.prefill_ms(plan_prefill(cache, prompt, 16).uncached_tokens) == 40.0
    assert costs.prefill_ms(plan_prefill(cache, prompt, 16).uncached_tokens) == 8.0


def test_kv_blocks_and_usage():
    assert kv_blocks_needed(prompt_tokens=20, max_tokens=12, block_tokens=16) == 2
    assert kv_blocks_needed(prompt_tokens=20, max_tokens=13, block_tokens=16) == 3
    assert kv_blocks_needed(0, 0, 16) == 0
    assert cache_usage(64, 256) == 0.25
    assert cache_usage(300, 256) == 1.0
    assert cache_usage(5, 0) == 0.0
