"""`/admin/overview`'s data (gateway/overview.py), from a gateway built without any server."""

from __future__ import annotations

import pytest

from modelyard.config import validate_config
from modelyard.gateway import Gateway
from modelyard.gateway.overview import overview
from modelyard.protocols.feed import FeedEndpoint, PlacedModel, Snapshot

SERVER = "http://10.0.0.1:80"


@pytest.fixture
def gateway() -> Gateway:
    configured = {"name": "mine", "endpoints": [{"name": "s", "url": SERVER}]}
    placement = {"scheduler": "http://127.0.0.1:9", "retry_after": 7}
    return Gateway(validate_config({"models": [configured], "placement": placement}, "<test>"))


def test_every_placed_model_is_shown_with_its_state_replicas_and_reason_routable_or_not(gateway):
    small = PlacedModel("chat-small", 1, "ModelAvailable", "", (FeedEndpoint("s", SERVER),), (), 2, 0)
    huge = PlacedModel("chat-huge", 3, "ScheduleFailed", "no matching servers", (), (), 0, 1)
    older = PlacedModel("from-an-older-scheduler", 1, "ModelProgressing", "", ())
    gateway.placed.apply(Snapshot((small, huge, older)))
    placement = overview(gateway, now=0.0, epoch=0.0)["placement"]
    assert placement["scheduler"] == "http://127.0.0.1:9"
    assert (placement["connected"], placement["synced"], placement["last_error"]) == (False, False, "")
    assert placement["models"] == [
        {
            "name": "chat-huge",
            "version": 3,
            "state": "ScheduleFailed",
            "reason": "no matching servers",
            "ready_replicas": 0,
            "desired_replicas": 1,
            "routable": False,
        },
        {
            "name": "chat-small",
            "version": 1,
            "state": "ModelAvailable",
            "reason": "",
            "ready_replicas": 2,
            "desired_replicas": 2,
            "routable": True,
        },
        {
            "name": "from-an-older-scheduler",
            "version": 1,
            "state": "ModelProgressing",
            "reason": "",
            "ready_replicas": None,
            "desired_replicas": None,
            "routable": False,
        },
    ]


def test_without_a_scheduler_placement_is_null_and_the_rest_keeps_its_shape():
    data = overview(
        Gateway(validate_config({"models": [{"name": "m", "endpoints": [{"url": SERVER}]}]}, "<t>")),
        0.0,
        1_700_000_000.5,
    )
    assert data["placement"] is None
    assert set(data) == {
        "models",
        "strategies",
        "admin_token_required",
        "graph_views_protected",
        "api_keys",
        "placement",
        "now",
    }
    assert data["now"] == 1_700_000_000.5  # the gateway's clock, as the routing log's `time`


def test_a_model_shows_its_own_requests_on_a_server_another_model_shares(gateway):
    gateway.placed.apply(
        Snapshot((PlacedModel("placed", 1, "ModelAvailable", "", (FeedEndpoint("s", SERVER),)),))
    )
    mine, placed = gateway.clusters["mine"], gateway.clusters["placed"]
    placed.acquire(placed.endpoints[0], tokens=1)
    described = {m["name"]: m["endpoints"][0] for m in overview(gateway, now=0.0, epoch=0.0)["models"]}
    assert (described["mine"]["model_in_flight"], described["mine"]["in_flight"]) == (0, 1)
    assert (described["placed"]["model_in_flight"], described["placed"]["in_flight"]) == (1, 1)
    assert mine.endpoints[0].load is placed.endpoints[0].load  # one server, one load
