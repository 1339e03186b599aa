"""What the workers of one gateway share (gateway/siblings.py), two `Siblings` on one file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from modelyard.cluster import ResourceSnapshot
from modelyard.config import GatewayConfig, validate_config
from modelyard.errors import ChangeNotShared, UnknownStrategy
from modelyard.gateway import workers as workers_module
from modelyard.gateway.app import create_app
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.siblings import (
    SHARED_FILE,
    SNAPSHOT_SLOTS,
    Layout,
    Siblings,
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    worker_exited,
    write_snapshot,
)
from modelyard.gateway.worker_log import LOG_FILE
from modelyard.gateway.workers import worker_count
from modelyard.serving import ListenerStats
from modelyard.serving.workers import SharedInts
from modelyard.state.siblings import LOG_RING_BYTES, RINGS_FILE, create_rings

ENDPOINTS = [{"url": "http://127.0.0.1:9001", "name": "a"}, {"url": "http://127.0.0.1:9002", "name": "b"}]


def _config() -> GatewayConfig:
    models = [
        {"name": "m", "strategy": "least_pending", "endpoints": ENDPOINTS},
        {"name": "n", "endpoints": ENDPOINTS[1:]},  # the same server under a second model
    ]
    return validate_config({"models": models}, "<test>")


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Siblings, Siblings]:
    config = _config()
    SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=True).close()
    return Siblings(config, 0, 2, tmp_path), Siblings(config, 1, 2, tmp_path)


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


def test_a_refusal_on_a_follower_reaches_the_leader_once(pair, tmp_path):
    leader, follower = pair
    config = _config()
    mine = {m.name: Cluster(m, {}, on_refused=follower.connection_refused) for m in config.models}
    theirs = {m.name: Cluster(m, {}, on_refused=leader.connection_refused) for m in config.models}
    assert leader.suspected() == []
    mine["n"].record_connection_failure(mine["n"].endpoints[0], "refused")
    assert not mine["n"].endpoints[0].healthy
    assert leader.suspected() == [("n", "b")]
    assert leader.suspected() == []  # taken once
    # The leader takes it out as its own refusal, which publishes the verdict to the followers.
    theirs["n"].record_connection_failure(theirs["n"].endpoints[0], "refused")
    mine["n"].adopt_health(mine["n"].endpoints[0], True, "")  # as if a probe had brought it back
    follower.adopt_probes(mine)
    assert not mine["n"].endpoints[0].healthy
    theirs["n"].record_probe(theirs["n"].endpoints[0], "")
    leader.publish_probe(theirs["n"], theirs["n"].endpoints[0])
    follower.adopt_probes(mine)
    assert mine["n"].endpoints[0].healthy
    mine["n"].record_connection_failure(mine["n"].endpoints[0], "refused")
    again = Siblings(config, 0, 2, tmp_path)  # a restarted leader: only refusals after it started
    assert again.suspected() == []


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


def test_the_parent_clears_a_dead_worker_loads_and_keeps_its_listener_counts(pair, tmp_path):
    first, second = pair
    theirs = second.new_load("http://127.0.0.1:9002", "b")
    theirs.acquire(4)
    first.new_load("http://127.0.0.1:9002", "b").acquire(1)
    second.publish_listener(ListenerStats(open_connections=2, refused_connections=3, refused_heads={431: 1}))
    parent = SharedInts(tmp_path / SHARED_FILE, first.layout.size, create=False)
    worker_exited(parent.ints, first.layout, 1)
    assert (theirs.in_flight, theirs.outstanding_tokens) == (1, 1)  # only worker 0's request is left
    again = Siblings(_config(), 1, 2, tmp_path)  # the restarted worker 1, its listener from zero
    again.publish_listener(ListenerStats(refused_connections=1))
    totals = first.listener_totals(ListenerStats())
    assert (totals.open_connections, totals.refused_connections, totals.refused_heads[431]) == (0, 4, 1)


def test_auto_the_default_counts_the_cpus_this_process_may_run_on(monkeypatch):
    config = validate_config({}, "<test>")
    assert config.listen.workers == "auto"
    monkeypatch.setattr(workers_module.sys, "platform", "linux")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 2, 5}, raising=False)
    assert worker_count(config) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(1000)), raising=False)
    assert worker_count(config) == 8  # auto's most
    assert worker_count(validate_config({"listen": {"workers": 70}}, "<test>")) == 70
    placed = validate_config({"placement": {"scheduler": "127.0.0.1:9004"}}, "<test>")
    assert worker_count(placed) == 1  # placed models: one process
    monkeypatch.setattr(workers_module.sys, "platform", "darwin")
    assert worker_count(config) == 1  # no SO_REUSEPORT spreading off Linux


def test_followers_know_which_verdicts_they_still_wait_for(pair):
    leader, follower = pair
    config = validate_config(
        {"models": [{"name": "m", "endpoints": ENDPOINTS}, {"name": "n", "endpoints": ENDPOINTS[1:],
                    "health_check": {"interval": 0}}]},
        "<test>",
    )  # fmt: skip
    clusters = {m.name: Cluster(m, {}) for m in config.models}
    assert follower.verdicts_pending(clusters)
    for endpoint in clusters["m"].endpoints:
        leader.publish_probe(clusters["m"], endpoint)
    assert not follower.verdicts_pending(clusters)  # n is not health-checked: nothing to wait for


async def test_a_change_that_cannot_be_published_is_not_applied(tmp_path):
    config = _config()
    SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=True).close()
    create_rings(tmp_path / RINGS_FILE, 2)
    create_rings(tmp_path / LOG_FILE, 2, LOG_RING_BYTES)
    (tmp_path / "metrics").mkdir()
    gateway = create_app(config, siblings=Siblings(config, 0, 2, tmp_path))[GATEWAY]
    cluster = gateway.clusters["m"]
    before = cluster.config.routes
    routes = [{"name": "all", "destinations": [{"subset": "default", "weight": 100}], "tags": {1, 2}}]
    with pytest.raises(ChangeNotShared):  # a set: no JSON for it
        gateway.change("routes", {"m": routes}, lambda: cluster.replace_routes(routes))
    assert cluster.config.routes == before
    lock = tmp_path / "admin.json.lock"
    lock.unlink()
    lock.mkdir()  # the lock cannot be opened
    with pytest.raises(ChangeNotShared):
        gateway.change(
            "strategies", {"m": "round_robin"}, lambda: gateway.set_strategy(cluster, "round_robin")
        )
    lock.rmdir()
    assert cluster.balancer.strategy.name == "least_pending"
    with pytest.raises(UnknownStrategy):  # fails here: not given to the others
        gateway.change("strategies", {"m": "nope"}, lambda: gateway.set_strategy(cluster, "nope"))
    assert not (tmp_path / "admin.json").exists()
    gateway.change("strategies", {"m": "round_robin"}, lambda: gateway.set_strategy(cluster, "round_robin"))
    other = Siblings(config, 1, 2, tmp_path)
    assert other.admin_changes() == {"strategies": {"m": "round_robin"}}
    await gateway.pool.close()


def test_a_snapshot_survives_its_slots_none_included():
    full = ResourceSnapshot(1234.5678, 3.0, 2.0, 0.25, 0.9, 0.5, in_flight_at_scrape=7)
    sparse = ResourceSnapshot(0.001, queue_depth=0.0, in_flight_at_scrape=0)
    for snapshot in (full, sparse):
        fields = encode_snapshot(snapshot)
        assert all(isinstance(f, int) and -(2**63) <= f < 2**63 for f in fields)
        assert decode_snapshot(fields) == snapshot
    assert decode_snapshot(encode_snapshot(sparse)).running is None


def _slots() -> memoryview:
    return memoryview(bytearray(8 * SNAPSHOT_SLOTS)).cast("q")


def test_a_snapshot_is_read_whole_or_not_at_all():
    ints = _slots()
    assert read_snapshot(ints, 0) is None  # nothing published yet
    first = ResourceSnapshot(1.0, queue_depth=4.0, in_flight_at_scrape=2)
    write_snapshot(ints, 0, first)
    assert read_snapshot(ints, 0) == (2, first)
    ints[0] += 1  # a write under way (odd): its fields are not read
    ints[2] = 999
    assert read_snapshot(ints, 0) is None
    write_snapshot(ints, 0, first)  # the next write moves past the odd number
    assert read_snapshot(ints, 0) == (6, first)


class _WrittenDuringRead(list[int]):
    """Slots where the writer writes a new snapshot whole while a reader reads the fields, `times` times."""

    def __init__(self, values: list[int], snapshot: ResourceSnapshot, times: int) -> None:
        super().__init__(values)
        self.snapshot, self.times = snapshot, times

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        value = super().__getitem__(index)
        if isinstance(index, slice) and self.times:
            self.times -= 1
            write_snapshot(self, 0, self.snapshot)  # type: ignore[arg-type]
        return value


def test_a_snapshot_rewritten_while_read_is_read_again():
    ints = _slots()
    old, new = ResourceSnapshot(1.0, queue_depth=1.0), ResourceSnapshot(2.0, queue_depth=9.0)
    write_snapshot(ints, 0, old)
    racing = _WrittenDuringRead(ints.tolist(), new, times=1)
    assert read_snapshot(racing, 0) == (4, new)  # type: ignore[arg-type]  # the old fields were dropped
    always = _WrittenDuringRead(ints.tolist(), new, times=100)
    assert read_snapshot(always, 0) is None  # gives up this round rather than adopt a torn one


def test_followers_adopt_the_leader_scrapes_once_each(pair):
    leader, follower = pair
    config = _config()
    theirs = {m.name: Cluster(m, {}) for m in config.models}
    mine = {m.name: Cluster(m, {}) for m in config.models}
    follower.adopt_resources(mine)
    assert all(e.resources is None for c in mine.values() for e in c.endpoints)
    scraped = ResourceSnapshot(10.0, queue_depth=5.0, running=1.0, in_flight_at_scrape=3)
    endpoint = theirs["m"].endpoints[1]
    endpoint.resources = scraped
    leader.publish_resources(theirs["m"], endpoint)
    follower.adopt_resources(mine)
    assert mine["m"].endpoints[1].resources == scraped
    assert mine["m"].endpoints[0].resources is None
    assert mine["n"].endpoints[0].resources is None  # the same server under another model: its own
    mine["m"].endpoints[1].resources = None
    follower.adopt_resources(mine)
    assert mine["m"].endpoints[1].resources is None  # nothing new published: nothing adopted again


def _ejecting_config(percent: float = 50) -> GatewayConfig:
    detection = {"consecutive_5xx": 2, "base_ejection_time": "30s", "max_ejection_percent": percent}
    models = [{"name": "m", "endpoints": ENDPOINTS, "outlier_detection": detection}]
    return validate_config({"models": models}, "<test>")


def _fail(cluster: Cluster, name: str, times: int, now: float) -> None:
    endpoint = next(e for e in cluster.endpoints if e.name == name)
    for _ in range(times):
        cluster.record_outcome(endpoint, False, None, now)


def _ejecting_pair(tmp_path: Path, config: GatewayConfig) -> tuple[Siblings, Siblings, Cluster, Cluster]:
    """Two workers, and the one model's cluster in each, telling the other of its ejections."""
    first, second = _siblings(tmp_path, config)
    (model,) = config.models
    mine = Cluster(model, {}, on_ejected=first.publish_ejection)
    theirs = Cluster(model, {}, on_ejected=second.publish_ejection)
    return first, second, mine, theirs


def _siblings(tmp_path: Path, config: GatewayConfig) -> tuple[Siblings, Siblings]:
    SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=True).close()
    return Siblings(config, 0, 2, tmp_path), Siblings(config, 1, 2, tmp_path)


def test_an_ejection_in_one_worker_is_taken_by_the_others(tmp_path):
    config = _ejecting_config()
    first, second, mine, theirs = _ejecting_pair(tmp_path, config)
    now = time.monotonic()
    _fail(theirs, "b", 2, now)  # consecutive_5xx in the second worker alone
    assert theirs.outliers["b"].ejected
    first.adopt_ejections({"m": mine})
    assert mine.outliers["b"].ejected_until == theirs.outliers["b"].ejected_until
    assert [e.name for e in mine.routable("default", now)] == ["a"]
    second.adopt_ejections({"m": theirs})  # its own row: nothing to adopt, and no echo
    before = mine.outliers["b"]
    first.adopt_ejections({"m": mine})  # seen already: unchanged
    assert mine.outliers["b"] is before
    # It returns everywhere at the same (monotonic) instant.
    assert [e.name for e in mine.routable("default", before.ejected_until + 0.1)] == ["a", "b"]


def test_an_adopted_ejection_keeps_max_ejection_percent(tmp_path):
    config = _ejecting_config(percent=50)
    first, _second, mine, theirs = _ejecting_pair(tmp_path, config)
    now = time.monotonic()
    _fail(mine, "a", 2, now)  # out here: one of two is the cap
    _fail(theirs, "b", 2, now)
    first.adopt_ejections({"m": mine})
    assert mine.outliers["a"].ejected and not mine.outliers["b"].ejected


def test_a_restarted_worker_takes_the_ejections_still_in_force(tmp_path):
    config = _ejecting_config(percent=100)
    _first, second = _siblings(tmp_path, config)
    (model,) = config.models
    theirs = Cluster(model, {}, on_ejected=second.publish_ejection)
    _fail(theirs, "a", 2, time.monotonic())
    again = Siblings(config, 0, 2, tmp_path)
    fresh = Cluster(model, {})
    again.adopt_ejections({"m": fresh})
    assert fresh.outliers["a"].ejected_until == theirs.outliers["a"].ejected_until
    expired = Cluster(model, {})  # an ejection whose time is over is not taken
    _fail(theirs, "b", 2, time.monotonic() - 60)
    assert theirs.outliers["b"].ejected  # published, but over 30 s ago
    Siblings(config, 0, 2, tmp_path).adopt_ejections({"m": expired})
    assert expired.outliers["a"].ejected and not expired.outliers["b"].ejected


def test_the_return_of_an_adopted_ejection_is_counted_by_the_worker_that_decided(tmp_path):
    config = _ejecting_config()
    first, second = _siblings(tmp_path, config)
    (model,) = config.models
    events: list[tuple[int, str, str]] = []
    mine = Cluster(
        model, {}, on_outlier=lambda m, e, ev: events.append((0, e, ev)), on_ejected=first.publish_ejection
    )
    theirs = Cluster(
        model, {}, on_outlier=lambda m, e, ev: events.append((1, e, ev)), on_ejected=second.publish_ejection
    )
    now = time.monotonic()
    _fail(theirs, "b", 2, now)
    first.adopt_ejections({"m": mine})
    later = theirs.outliers["b"].ejected_until + 0.1
    theirs.routable("default", later)
    mine.routable("default", later)
    assert not mine.outliers["b"].ejected and not theirs.outliers["b"].ejected
    assert events == [(1, "b", "consecutive_5xx"), (1, "b", "returned")]


def test_a_restarted_worker_takes_its_predecessors_own_ejections(tmp_path):
    config = _ejecting_config()
    _first, second = _siblings(tmp_path, config)
    (model,) = config.models
    dying = Cluster(model, {}, on_ejected=second.publish_ejection)
    _fail(dying, "a", 2, time.monotonic())
    successor, fresh = Siblings(config, 1, 2, tmp_path), Cluster(model, {})
    successor.adopt_ejections({"m": fresh})
    assert fresh.outliers["a"].ejected_until == dying.outliers["a"].ejected_until


def test_an_ejection_the_cap_kept_out_is_taken_once_there_is_room(tmp_path):
    config = _ejecting_config(percent=50)
    first, _second, mine, theirs = _ejecting_pair(tmp_path, config)
    now = time.monotonic()
    _fail(mine, "a", 2, now - 29)  # out here until about now + 1 s: the cap is full
    _fail(theirs, "b", 2, now)  # out there for 30 s
    first.adopt_ejections({"m": mine})
    assert not mine.outliers["b"].ejected
    mine.routable("default", now + 2)  # a returns here
    first.adopt_ejections({"m": mine})
    assert mine.outliers["b"].ejected_until == theirs.outliers["b"].ejected_until


def test_the_shared_files_leave_a_dev_shm_too_small_for_them(monkeypatch, caplog, tmp_path):
    from modelyard.gateway import workers

    shm = tmp_path  # stands for /dev/shm; its free space is what disk_usage says below
    needed = workers.rings_size(16) + workers.rings_size(16, LOG_RING_BYTES) + workers.SHM_MARGIN
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda path: _Usage(needed - 1))
    assert workers._run_parent(16, True, shm) is None  # the temporary folder
    assert f"{shm} has" in caplog.text and "MiB free" in caplog.text
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda path: _Usage(needed))
    assert workers._run_parent(16, True, shm) == shm
    without_state = needed - workers.rings_size(16)  # enough for the log's rings alone
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda path: _Usage(without_state))
    assert workers._run_parent(16, False, shm) == shm  # Redis: no state rings
    assert workers._run_parent(16, True, shm) is None
    assert workers._run_parent(16, True, tmp_path / "absent") is None  # no tmpfs at all


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_each_worker_keeps_its_part_of_the_per_process_limits():
    from modelyard.gateway.workers import worker_share

    model = {
        "name": "m",
        "endpoints": ENDPOINTS,
        "circuit_breakers": {"max_requests": 4, "max_pending_requests": 9},
        "retry_budget": {"min_retry_concurrency": 0},
    }
    config = validate_config(
        {"listen": {"max_connections": 1000}, "admin": {"max_log_streams": 3}, "models": [model]}, "<test>"
    )
    share = worker_share(config, 2)
    assert (share.listen.max_connections, share.admin.max_log_streams) == (1000, 3)  # a process's own
    assert share.upstream.max_connections == 512  # of the default 1024 per server
    (shared,) = share.models
    assert shared.circuit_breakers.max_pending_requests == 5  # rounded up
    assert shared.circuit_breakers.max_requests == 4  # held across the workers already (shared loads)
    assert shared.retry_budget.min_retry_concurrency == 0  # none stays none
    assert (
        worker_share(validate_config({"listen": {"max_connections": 0}}, "<t>"), 4).listen.max_connections
        == 0
    )


def test_the_overview_counts_every_workers_requests(pair, tmp_path):
    first, second = pair
    config = _config()
    mine = {m.name: Cluster(m, {}) for m in config.models}
    theirs = {m.name: Cluster(m, {}) for m in config.models}
    mine["m"].budget.request_started()
    for _ in range(3):
        theirs["m"].budget.request_started()
    theirs["m"].budget.retry_started()
    second.publish_counts(theirs)
    totals = first.model_totals(mine["m"])
    assert totals == {"queued": 0, "active_requests": 4, "retries_in_flight": 1, "max_pending_requests": 0}
    assert first.model_totals(mine["n"])["active_requests"] == 0  # per model
    shared = SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=False)
    worker_exited(shared.ints, Layout(config, 2), 1)  # what the second had ended with it
    assert first.model_totals(mine["m"])["active_requests"] == 1


def test_the_overview_counts_each_models_requests_on_an_endpoint_over_every_worker(pair, tmp_path):
    first, second = pair
    config = _config()
    mine = {m.name: Cluster(m, {}) for m in config.models}
    theirs = {m.name: Cluster(m, {}) for m in config.models}
    mine["m"].acquire(mine["m"].endpoints[1], tokens=1)  # m on b, here
    for _ in range(2):
        theirs["m"].acquire(theirs["m"].endpoints[1], tokens=1)  # and twice in the other worker
    theirs["n"].acquire(theirs["n"].endpoints[0], tokens=1)  # n on the same server b
    second.publish_counts(theirs)
    assert first.endpoint_totals(mine["m"]) == {"a": 0, "b": 3}
    assert first.endpoint_totals(mine["n"]) == {"b": 1}
    shared = SharedInts(tmp_path / SHARED_FILE, Layout(config, 2).size, create=False)
    worker_exited(shared.ints, Layout(config, 2), 1)  # what the second had ended with it
    assert first.endpoint_totals(mine["m"]) == {"a": 0, "b": 1}
    assert first.endpoint_totals(mine["n"]) == {"b": 0}


def test_another_workers_canary_events_join_the_account():
    from modelyard.gateway.shadow import apply_canary

    config = _config()
    clusters = {m.name: Cluster(m, {}) for m in config.models}
    apply_canary(clusters, ["outcome", "m", "r", "v2", 0.25, True])
    apply_canary(clusters, ["outcome", "m", "r", "v2", 0.5, False])
    apply_canary(clusters, ["comparison", "m", "r", 0.5, False])
    apply_canary(clusters, ["comparison", "gone", "r", 1.0, True])  # a model not here: skipped
    apply_canary(clusters, ["outcome", "m", "r"])  # not well formed: skipped
    summary = clusters["m"].canary_stats("r").summary()
    assert (summary["compared"], summary["mean_rouge_l"], summary["exact_match_rate"]) == (1, 0.5, 0.0)
    assert summary["subsets"]["v2"]["requests"] == 2 and summary["subsets"]["v2"]["errors"] == 1


def test_a_canary_event_with_whole_numbers_counts_too():
    from modelyard.gateway.shadow import apply_canary

    (model, _) = _config().models
    clusters = {"m": Cluster(model, {})}
    apply_canary(clusters, ["outcome", "m", "r", "v2", 0, True])
    apply_canary(clusters, ["comparison", "m", "r", 1, True])
    summary = clusters["m"].canary_stats("r").summary()
    assert (summary["compared"], summary["subsets"]["v2"]["requests"]) == (1, 1)
