"""The gateway config `modelyard bench --spawn` writes for each run."""

from __future__ import annotations

from typing import Any

from modelyard.bench.spawn import gateway_config
from modelyard.bench.workload import SimShape
from modelyard.config import PrefixAwareConfig


def prefix_aware(overrides: dict[str, object] | None) -> Any:
    sims = SimShape(cache_blocks=256, block_tokens=16)
    config = gateway_config("prefix_aware", ["http://w0"], sims, 0, overrides)
    models = config["models"]
    assert isinstance(models, list)
    return models[0]["prefix_aware"]


def test_the_index_is_sized_with_the_chunk_size_in_use() -> None:
    cache_chars = 256 * 16 * 7
    default = prefix_aware(None)
    assert default["chunk_chars"] == PrefixAwareConfig().chunk_chars
    assert default["max_chunks_per_endpoint"] == cache_chars // PrefixAwareConfig().chunk_chars
    wider = prefix_aware({"chunk_chars": 256})
    assert wider["chunk_chars"] == 256 and wider["max_chunks_per_endpoint"] == cache_chars // 256
    assert prefix_aware({"max_chunks_per_endpoint": 5})["max_chunks_per_endpoint"] == 5  # an override wins
