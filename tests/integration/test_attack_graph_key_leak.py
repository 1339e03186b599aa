"""Attack: with auth on, a graph run hands the caller's API key to its steps' services when the
propagation patterns match it; the REST proxy drops it (proxy.py CREDENTIAL_FIELDS), graphs do not."""

from __future__ import annotations

from pathlib import Path

import yaml
from aiohttp import web

from support import model_config

KEY_A = "sk-team-a-0123456789"


async def test_a_graph_step_never_receives_the_callers_api_key(sim_workers, gateways, http, tmp_path: Path):
    seen: list[dict[str, str]] = []

    async def infer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"outputs": []})

    app = web.Application()
    app.router.add_post("/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        path = tmp_path / "keys.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "tenants": [{"name": "a", "models": ["steps"]}],
                    "keys": [{"name": "a-app", "tenant": "a", "key": KEY_A}],
                }
            )
        )
        graph = {
            "steps": {
                "nodes": {
                    "root": {
                        "routerType": "Sequence",
                        "steps": [{"serviceUrl": f"http://127.0.0.1:{port}/infer"}],
                    }
                }
            }
        }
        workers = await sim_workers(1)
        gateway = await gateways(
            [model_config("chat", workers)],
            auth={"enabled": True, "keys_file": str(path)},
            graphs=graph,
            graph_propagate_headers=["Authorization", "Api-Key", "X-Trace.*"],
        )
        async with http.post(
            gateway.url + "/v1/graphs/steps",
            json={"inputs": []},
            headers={"Authorization": f"Bearer {KEY_A}"},
        ) as response:
            assert response.status == 200, await response.text()
        assert seen, "the step was not called"
        assert not any(KEY_A in value for value in seen[0].values()), seen[0]
    finally:
        await runner.cleanup()
