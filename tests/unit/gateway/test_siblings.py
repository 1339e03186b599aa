"""What the workers of one gateway share (gateway/siblings.py), two `Siblings` on one file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from modelyard.config import GatewayConfig, validate_config
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.siblings import SHARED_FILE, Layout, Siblings
from modelyard.serving import ListenerStats
from modelyard.serving.workers import SharedInts

ENDPOINTS = [{"url": "http://127.0.0.1:9001", "name": "a"}, {"url": "http://127.0.0.1:9002", "name": "b"}]


def _config() -> GatewayConfig:
    models = [
        {"name": "m", "strategy": "least_pending", "endpoints": ENDPOINTS},
        {"name": "n", "endpoints": ENDPOINTS[1:]},  # the same server under a second model
    ]
    return validate_config({"models": models}, "<test>")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Siblings, Siblings]]:
    config = _config()
    SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=True).close()
    first, second = Siblings(config, 0, 2, tmp_path), Siblings(config, 1, 2, tmp_path)
    yield first, second
    first.close()
    second.close()


def test_a_server_load_is_the_sum_of_every_worker_rows(pair):
    first, second = pair
    mine, theirs = first.new_load("http://127.0.0.1:9002", "b"), second.new_load("http://127.0.0.1:9002", "b")
    mine.acquire(10)
    theirs.acquire(5)
    theirs.acquire(1)
    assert (
        (mine.in_flight, mine.outstanding_tokens) == (3, 16) == (theirs.in_flight, theirs.outstanding_tokens)
    )
    theirs.release(5)
    assert mine.in_flight == 2 and mine.outstanding_tokens == 11
    other = first.new_load("http://127.0.0.1:9001", "a")
    assert other.in_flight == 0  # another server, another slot


def test_a_restarted_worker_starts_its_row_from_zero(pair, tmp_path):
    _first, second = pair
    second.new_load("http://127.0.0.1:9001", "a").acquire(7)
    again = Siblings(_config(), 1, 2, tmp_path)
    assert again.new_load("http://127.0.0.1:9001", "a").in_flight == 0
    again.close()


def test_followers_adopt_the_leader_verdicts(pair):
    leader, follower = pair
    config = _config()
    theirs = {m.name: Cluster(m, {}) for m in config.models}
    mine = {m.name: Cluster(m, {}) for m in config.models}
    endpoint = theirs["m"].endpoints[1]
    theirs["m"].record_probe(endpoint, "refused")
    leader.publish_probe(theirs["m"], endpoint)
    follower.adopt_probes(mine)
    assert [e.healthy for e in mine["m"].endpoints] == [True, False]
    assert all(e.healthy for e in mine["n"].endpoints)  # a verdict is per model and endpoint
    theirs["m"].record_probe(endpoint, "")
    leader.publish_probe(theirs["m"], endpoint)
    follower.adopt_probes(mine)
    assert all(e.healthy for e in mine["m"].endpoints)


def test_admin_changes_merge_and_are_seen_once(pair):
    first, second = pair
    first.publish_admin("strategies", "m", "round_robin")
    second.publish_admin("routes", "n", [{"name": "r"}])  # merged with the first, not replacing it
    changes = first.admin_changes()
    assert changes == {"strategies": {"m": "round_robin"}, "routes": {"n": [{"name": "r"}]}}
    assert first.admin_changes() is None
    assert second.admin_changes() == changes


def test_listener_counters_sum_over_workers(pair):
    first, second = pair
    second.publish_listener(ListenerStats(open_connections=2, refused_connections=1, refused_heads={400: 3}))
    totals = first.listener_totals(ListenerStats(open_connections=5, header_timeouts=1))
    assert (totals.open_connections, totals.refused_connections, totals.header_timeouts) == (7, 1, 1)
    assert totals.refused_heads == {400: 3, 431: 0}
