"""The embedded demo: three simulated workers of different speeds behind one gateway, and a
scheduler placing models on two more (cli/demo_placement.py)."""

from __future__ import annotations

from typing import Any

from modelyard.cli.demo_placement import DemoPlacement, placement_banner
from modelyard.config import GatewayConfig, validate_config
from modelyard.simworker import SimWorker, SimWorkerConfig

# (name, decode ms per token, prefill ms per token): a fast, a medium and a slow server.
DEMO_WORKERS = (("fast", 2.0, 0.02), ("medium", 5.0, 0.05), ("slow", 12.0, 0.1))


# Graph steps name demo models (serviceName): each step is routed like any request to that model.
DEMO_GRAPHS: dict[str, Any] = {
    "demo-pipeline": {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    {"name": "preprocess", "serviceName": "demo-echo"},
                    {
                        "name": "predict",
                        "serviceName": "demo-echo",
                        "data": "$response",
                        "mapPredictionsToInstances": True,
                        "dependency": "Hard",
                    },
                    {
                        "name": "compare",
                        "nodeName": "compare",
                        "data": "$response",
                        "mapPredictionsToInstances": True,
                    },
                ],
            },
            "compare": {
                "routerType": "Ensemble",
                "steps": [
                    {"name": "a", "serviceName": "demo-echo"},
                    {"name": "b", "serviceName": "demo-echo"},
                ],
            },
        }
    },
    "demo-route": {
        "nodes": {
            "root": {
                "routerType": "Switch",
                "steps": [
                    {"name": "premium", "serviceName": "demo-echo", "condition": "[@this].#(tier==premium)"},
                    {"name": "everyone-else", "serviceName": "demo-echo", "condition": "@this"},
                ],
            }
        }
    },
}


async def start_demo_workers(host: str = "127.0.0.1") -> list[tuple[str, SimWorker]]:
    workers = []
    for seed, (name, decode, prefill) in enumerate(DEMO_WORKERS):
        worker = SimWorker(
            SimWorkerConfig(
                host=host,
                port=0,
                models=("demo-llm", "demo-echo"),
                decode_ms_per_token=decode,
                prefill_ms_per_token=prefill,
                seed=seed,
            )
        )
        await worker.start()
        workers.append((name, worker))
    return workers


def demo_config(
    workers: list[tuple[str, SimWorker]], base: dict[str, Any], placement: DemoPlacement | None = None
) -> GatewayConfig:
    """The demo's models over the started workers, merged over `base` (listen, state, admin...);
    with `placement`, the gateway also follows its scheduler."""
    endpoints = [
        {"name": f"sim-{name}", "url": worker.url, "cost_per_1k_tokens": cost}
        for (name, worker), cost in zip(workers, (0.6, 0.3, 0.1), strict=True)
    ]
    data = dict(base)
    # Everything is on loopback, with no load balancer to tell: stop at once unless asked to drain.
    data["listen"] = {"drain_seconds": 0, **data.get("listen", {})}
    data["models"] = [
        {
            "name": "demo-llm",
            "strategy": "round_robin",
            "endpoints": endpoints,
            "health_check": {"interval": "2s"},
        },
        {
            "name": "demo-echo",
            "strategy": "least_pending",
            "endpoints": endpoints,
            "health_check": {"path": "/v2/health/ready", "interval": "2s"},
        },
    ]
    data["graphs"] = DEMO_GRAPHS
    if placement is not None:
        data["placement"] = {**data.get("placement", {}), "scheduler": placement.url}
    return validate_config(data, "<embedded demo>")


def demo_banner(
    url: str, workers: list[tuple[str, SimWorker]], placement: DemoPlacement | None = None
) -> str:
    lines = [
        f"modelyard gateway (embedded demo) listening on {url}",
        f"dashboard: {url}/dashboard",
        "simulated workers: " + ", ".join(f"sim-{name} {w.url}" for name, w in workers),
        "models: demo-llm (OpenAI, round_robin), demo-echo (Open Inference Protocol v2, least_pending)",
        "graphs: demo-pipeline (Sequence -> Ensemble), demo-route (Switch)",
        "",
        "try:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        '    -d \'{"model": "demo-llm", "messages": [{"role": "user", "content": "Hello!"}]}\'',
        f'  curl -s -X PUT {url}/admin/strategy -d \'{{"strategy": "kv_aware"}}\'',
        f"  curl -s {url}/v2/models/demo-echo/infer -H 'Content-Type: application/json' \\",
        '    -d \'{"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}\'',
        f"  curl -s {url}/v1/graphs/demo-pipeline -H 'X-Modelyard-Trace: 1' -D - \\",
        "    -d '{\"instances\": [[1, 2]]}'",
        f"  curl -s {url}/metrics | grep '^modelyard_requests_total'",
        *(placement_banner(placement, url) if placement is not None else []),
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
