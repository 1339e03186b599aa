"""Feed events applied to a gateway's clusters (gateway/placement.py), without any server."""

from __future__ import annotations

import random

import pytest

from modelyard.config import PlacementConfig, validate_config
from modelyard.errors import ConfigError, ModelNotFound, ModelNotPlaced
from modelyard.gateway import Gateway
from modelyard.gateway.placement import reconnect_delay
from modelyard.protocols.feed import (
    FeedEndpoint,
    ModelChanged,
    ModelRemoved,
    PlacedModel,
    Snapshot,
    VersionShare,
)


def placed(name: str, *urls: str, state: str = "ModelAvailable", reason: str = "") -> PlacedModel:
    endpoints = tuple(FeedEndpoint(f"s-{i}", url) for i, url in enumerate(urls))
    return PlacedModel(name, 1, state, reason, endpoints)


@pytest.fixture
def gateway() -> Gateway:
    configured = {"name": "mine", "endpoints": [{"url": "http://10.0.0.9:80"}]}
    # (followed, never started: the tests apply what its feed would say)
    data = {"models": [configured], "placement": {"scheduler": "http://127.0.0.1:9", "retry_after": 7}}
    return Gateway(validate_config(data, "<test>"))


def test_a_model_with_endpoints_becomes_a_cluster_with_the_placement_defaults(gateway):
    gateway.placed.apply(Snapshot((placed("iris", "http://10.0.0.1:80"),)))
    cluster = gateway.cluster("iris")
    assert [e.url for e in cluster.endpoints] == ["http://10.0.0.1:80"]
    assert cluster.config.strategy == "least_pending" and cluster.config.protocol == "v2"


def test_an_update_keeps_the_cluster_and_the_endpoints_that_stay(gateway):
    gateway.placed.apply(ModelChanged(placed("iris", "http://10.0.0.1:80")))
    cluster = gateway.cluster("iris")
    kept = cluster.endpoints[0]
    gateway.placed.apply(ModelChanged(placed("iris", "http://10.0.0.1:80", "http://10.0.0.2:80")))
    assert gateway.cluster("iris") is cluster
    assert cluster.endpoints[0] is kept and len(cluster.endpoints) == 2


def test_no_endpoints_is_503_with_state_and_reason_and_the_cluster_comes_back(gateway):
    gateway.placed.apply(ModelChanged(placed("iris", "http://10.0.0.1:80")))
    cluster = gateway.cluster("iris")
    cluster.set_strategy("round_robin")  # as an admin might
    gateway.placed.apply(ModelChanged(placed("iris", state="ModelProgressing", reason="moving")))
    with pytest.raises(ModelNotPlaced) as caught:
        gateway.cluster("iris")
    assert caught.value.headers == {"Retry-After": "7"}
    assert "ModelProgressing: moving" in caught.value.message
    gateway.placed.apply(ModelChanged(placed("iris", "http://10.0.0.3:80")))
    assert gateway.cluster("iris") is cluster and cluster.balancer.strategy.name == "round_robin"


def test_removed_and_absent_from_a_snapshot_are_404(gateway):
    gateway.placed.apply(Snapshot((placed("a", "http://10.0.0.1:80"), placed("b", state="ScheduleFailed"))))
    gateway.placed.apply(ModelRemoved("a"))
    with pytest.raises(ModelNotFound):
        gateway.cluster("a")
    gateway.placed.apply(Snapshot((placed("c", "http://10.0.0.1:80"),)))
    with pytest.raises(ModelNotFound):
        gateway.cluster("b")
    assert set(gateway.clusters) == {"mine", "c"}


def test_the_gateway_config_wins_and_is_never_removed_by_the_feed(gateway):
    mine = gateway.cluster("mine")
    gateway.placed.apply(ModelChanged(placed("mine", "http://10.0.0.1:80")))
    gateway.placed.apply(ModelChanged(placed("mine", state="ModelFailed")))
    gateway.placed.apply(Snapshot(()))
    assert gateway.cluster("mine") is mine
    assert [e.url for e in mine.endpoints] == ["http://10.0.0.9:80"]


def test_endpoints_with_bad_urls_or_repeated_names_are_left_out(gateway):
    model = PlacedModel(
        "iris",
        1,
        "ModelAvailable",
        "",
        (
            FeedEndpoint("a", "ftp://x"),
            FeedEndpoint("b", "http://10.0.0.1:80"),
            FeedEndpoint("b", "http://10.0.0.2:80"),
        ),
    )
    gateway.placed.apply(ModelChanged(model))
    assert [e.url for e in gateway.cluster("iris").endpoints] == ["http://10.0.0.1:80"]


def test_reconnect_delay_grows_to_its_cap_with_jitter_and_is_never_zero():
    config = PlacementConfig(reconnect_base_interval=1.0, reconnect_max_interval=8.0)
    rng = random.Random(0)
    for failures, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (50, 8.0)]:
        delays = [reconnect_delay(failures, config, rng) for _ in range(50)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert len(set(delays)) > 1


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("127.0.0.1:9004", "http://127.0.0.1:9004"),
        ("http://scheduler:9004/", "http://scheduler:9004"),
        ("https://scheduler.example", "https://scheduler.example"),
        ("", None),
    ],
)
def test_the_scheduler_address(given, url):
    assert PlacementConfig(scheduler=given).scheduler == url


@pytest.mark.parametrize("given", ["scheduler", "ftp://x:1", "http://:9004", "host:notaport"])
def test_a_bad_scheduler_address_names_the_field(given):
    with pytest.raises(ConfigError, match=r"placement\.scheduler: expected host:port"):
        validate_config({"placement": {"scheduler": given}}, "<test>")


def _rollout(*shares: tuple[int, int]) -> PlacedModel:
    """Version v on http://10.0.0.<v>:80 (endpoint s-<v>), with the given (version, weight)."""
    endpoints = tuple(FeedEndpoint(f"s-{v}", f"http://10.0.0.{v}:80", v) for v, _ in shares)
    versions = tuple(VersionShare(v, w) for v, w in shares)
    return PlacedModel("iris", max(v for v, _ in shares), "ModelProgressing", "", endpoints, versions)


def test_a_rollout_splits_by_version_subsets_and_the_admin_routes_come_back_after(gateway):
    gateway.placed.apply(ModelChanged(_rollout((1, 100))))
    cluster = gateway.cluster("iris")
    assert [(e.name, e.subset) for e in cluster.endpoints] == [("s-1", "default")]
    cluster.replace_routes([{"name": "mine", "destinations": [{"subset": "default"}]}])

    gateway.placed.apply(ModelChanged(_rollout((1, 34), (2, 66))))
    assert gateway.cluster("iris") is cluster
    assert [(e.name, e.subset) for e in cluster.endpoints] == [("s-1", "v1"), ("s-2", "v2")]
    (route,) = cluster.config.routes
    assert route.name == "rollout" and route.match is None
    assert [(d.subset, d.weight) for d in route.destinations] == [("v1", 34), ("v2", 66)]
    assert cluster.route_for({}, None) is route

    gateway.placed.apply(ModelChanged(_rollout((2, 100))))
    assert [(e.name, e.subset) for e in cluster.endpoints] == [("s-2", "default")]
    assert [r.name for r in cluster.config.routes] == ["mine"]  # set aside during the split


def test_an_entry_from_an_older_scheduler_has_no_split(gateway):
    gateway.placed.apply(ModelChanged(placed("iris", "http://10.0.0.1:80", "http://10.0.0.2:80")))
    cluster = gateway.cluster("iris")
    assert {e.subset for e in cluster.endpoints} == {"default"} and cluster.config.routes == []


def test_a_split_first_seen_mid_rollout_ends_with_the_rollout(gateway):
    # The gateway starts (or first hears of the model) while its traffic is split.
    gateway.placed.apply(Snapshot((_rollout((1, 50), (2, 50)),)))
    cluster = gateway.cluster("iris")
    assert [r.name for r in cluster.config.routes] == ["rollout"]
    gateway.placed.apply(ModelChanged(_rollout((2, 100))))
    assert cluster.config.routes == []  # was: the rollout route kept naming v1/v2, and every request got 503
    assert cluster.route_for({}, None).name == "default"
    assert [e.name for e in cluster.routable("*", 0.0)] == ["s-2"]


def test_a_subset_an_update_took_away_falls_back_to_every_endpoint(gateway):
    gateway.placed.apply(ModelChanged(_rollout((1, 50), (2, 50))))
    cluster = gateway.cluster("iris")
    assert not cluster.vanished_subset("v1")
    gateway.placed.apply(ModelChanged(_rollout((2, 100))))
    assert cluster.vanished_subset("v1") and cluster.vanished_subset("v2")
    assert not cluster.vanished_subset("typo")  # never had endpoints: a route naming it still gets 503
    gateway.placed.apply(ModelChanged(_rollout((2, 50), (3, 50))))
    assert not cluster.vanished_subset("v2")  # back again
