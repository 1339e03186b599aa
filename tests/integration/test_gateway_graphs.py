"""Inference graphs inside the gateway: serviceName steps routed per request, hot replacement,
traces, metrics and the graph timeout."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from modelyard.config import validate_config
from modelyard.errors import ConfigError
from modelyard.graph import load_config_graphs
from support import metric_value, model_config, sim_stats, wait_until

SEQUENCE = {
    "nodes": {
        "root": {
            "routerType": "Sequence",
            "steps": [
                {"name": "first", "serviceName": "double"},
                {
                    "name": "second",
                    "serviceName": "double",
                    "data": "$response",
                    "mapPredictionsToInstances": True,
                },
            ],
        }
    }
}


@pytest.fixture
async def setup(sim_workers, gateways):
    workers = await sim_workers(3, oip_scale=2.0)
    gateway = await gateways([model_config("double", workers)], graphs={"quad": SEQUENCE})
    return gateway, workers


async def test_a_sequence_over_a_model_chains_and_is_load_balanced(setup, http):
    gateway, workers = setup
    for _ in range(3):
        async with http.post(gateway.url + "/v1/graphs/quad", json={"instances": [[1, 2], [3]]}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json"
            assert await response.json() == {"predictions": [[4, 8], [12]]}
    # 6 step calls through round_robin over 3 workers: each served two.
    assert [(await sim_stats(http, w))["requests_total"] for w in workers] == [2, 2, 2]


async def test_trace_header_lists_every_step(setup, http):
    gateway, _ = setup
    headers = {"X-Modelyard-Trace": "1"}
    async with http.post(
        gateway.url + "/v1/graphs/quad", json={"instances": [1]}, headers=headers
    ) as response:
        trace = orjson.loads(response.headers["X-Modelyard-Graph-Trace"])
    assert trace["graph"] == "quad"
    assert [(s["node"], s["step"], s["target"], s["status"]) for s in trace["steps"]] == [
        ("root", "first", "double", 200),
        ("root", "second", "double", 200),
    ]
    assert all(s["ms"] >= 0 for s in trace["steps"])
    async with http.post(gateway.url + "/v1/graphs/quad", json={"instances": [1]}) as response:
        assert "X-Modelyard-Graph-Trace" not in response.headers


async def test_step_metrics(setup, http):
    gateway, _ = setup
    await (await http.post(gateway.url + "/v1/graphs/quad", json={"instances": [1]})).read()
    labels = {"graph": "quad", "node": "root", "step": "second", "code": "200"}
    assert await metric_value(http, gateway.url, "modelyard_graph_step_duration_seconds_count", **labels) == 1


async def test_list_get_put_delete(setup, http):
    gateway, _ = setup
    async with http.get(gateway.url + "/v1/graphs") as response:
        assert [g["name"] for g in (await response.json())["data"]] == ["quad"]
    async with http.get(gateway.url + "/v1/graphs/quad") as response:
        assert (await response.json())["spec"]["nodes"]["root"]["routerType"] == "Sequence"

    single = "nodes:\n  root:\n    routerType: Sequence\n    steps:\n      - serviceName: double\n"
    async with http.put(gateway.url + "/admin/graphs/double-once", data=single) as response:
        assert response.status == 200, await response.text()
    async with http.post(gateway.url + "/v1/graphs/double-once", json={"instances": [5]}) as response:
        assert await response.json() == {"predictions": [10]}

    async with http.delete(gateway.url + "/admin/graphs/double-once") as response:
        assert response.status == 200
    async with http.post(gateway.url + "/v1/graphs/double-once", json={"instances": [5]}) as response:
        assert response.status == 404
        assert "known graphs: quad" in (await response.json())["error"]["message"]


async def test_put_of_an_invalid_graph_is_400_with_every_problem(setup, http):
    gateway, _ = setup
    bad = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [{"nodeName": "a"}, {"serviceName": "x", "serviceUrl": "http://y"}],
            },
            "a": {"routerType": "Switch", "steps": [{"nodeName": "root", "condition": "#((("}]},
        }
    }
    async with http.put(gateway.url + "/admin/graphs/quad", data=orjson.dumps(bad)) as response:
        assert response.status == 400
        problems = (await response.json())["error"]["problems"]
    assert any("nodes.root.steps[1]" in p and "more than one of nodeName" in p for p in problems)
    assert any("cycle: root -> a -> root" in p for p in problems)
    assert any("nodes.a.steps[0].condition" in p for p in problems)
    # The old graph still serves.
    async with http.post(gateway.url + "/v1/graphs/quad", json={"instances": [1]}) as response:
        assert await response.json() == {"predictions": [4]}


async def test_hot_replacement_under_load_fails_no_request(setup, http):
    gateway, _ = setup
    other = orjson.dumps(
        {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "double"}]}}}
    )

    async def client(n: int) -> list[int]:
        statuses = []
        for _ in range(n):
            async with http.post(gateway.url + "/v1/graphs/quad", json={"instances": [1]}) as response:
                statuses.append(response.status)
                await response.read()
        return statuses

    async def replace(n: int) -> None:
        for i in range(n):
            async with http.put(
                gateway.url + "/admin/graphs/quad", data=other if i % 2 else orjson.dumps(SEQUENCE)
            ) as r:
                assert r.status == 200

    results = await asyncio.gather(client(60), client(60), replace(20))
    assert set(results[0]) | set(results[1]) == {200}


async def test_graph_admin_needs_the_token(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways(
        [model_config("double", workers)], admin={"token": "t"}, graphs={"quad": SEQUENCE}
    )
    async with http.delete(gateway.url + "/admin/graphs/quad") as response:
        assert response.status == 401
    async with http.post(gateway.url + "/v1/graphs/quad", json={"instances": [1]}) as response:
        assert response.status == 200


async def test_graph_timeout_is_504_and_cancels_the_pending_call(sim_workers, gateways, http):
    workers = await sim_workers(1, decode_ms_per_token=5000.0)  # one OIP/KServe step costs one decode step
    spec = {"timeout": 1, "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "slow"}]}}}
    gateway = await gateways([model_config("slow", workers)], graphs={"slow": spec})
    async with http.post(gateway.url + "/v1/graphs/slow", json={"instances": [1]}) as response:
        assert response.status == 504
        body = await response.json()
    assert body["error"] == "Failed to process request" and "timeout" in body["cause"]

    async def upstream_idle() -> bool:
        return (await sim_stats(http, workers[0]))["running"] == 0

    # 5 s of decode could only end this early by the cancellation.
    await wait_until(upstream_idle, attempts=300)


def test_an_invalid_graph_in_the_config_names_its_path():
    config = validate_config(
        {"models": [], "graphs": {"g": {"nodes": {"root": {"routerType": "Sequence", "steps": []}}}}},
        "gw.yaml",
    )
    with pytest.raises(ConfigError) as info:
        load_config_graphs(config, "gw.yaml")
    assert info.value.problems == [
        "graphs.g.nodes.root.steps: a Sequence needs at least one step (KServe drops the connection)"
    ]


async def test_put_of_a_manifest_named_otherwise_is_refused(setup, http):
    gateway, _ = setup
    manifest = (
        "apiVersion: serving.kserve.io/v1alpha1\nkind: InferenceGraph\nmetadata: {name: other}\n"
        "spec:\n  nodes:\n    root: {routerType: Sequence, steps: [{serviceName: double}]}\n"
    )
    async with http.put(gateway.url + "/admin/graphs/quad", data=manifest) as response:
        assert response.status == 400
        problems = (await response.json())["error"]["problems"]
    assert problems == ["metadata.name: the manifest names 'other'; the path names 'quad'"]
