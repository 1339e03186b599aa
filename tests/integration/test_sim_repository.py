"""The sim-worker's repository mode: the OIP repository API, memory, and only loaded models answering."""

from __future__ import annotations

import asyncio
import json

from support import metric_value

OIP_BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


def _model(repo, name, **extra):
    (repo / name).mkdir(parents=True)
    settings = {"name": name, "parameters": {"extra": extra}}
    (repo / name / "model-settings.json").write_text(json.dumps(settings))


async def _post(http, url, body=None):
    async with http.post(url, json=body if body is not None else {}) as response:
        return response.status, await response.json(content_type=None)


async def test_load_serve_unload_with_memory_from_model_settings(sim_workers, http, tmp_path):
    _model(tmp_path, "iris", memory_bytes=300)
    _model(tmp_path, "big", memory_bytes=800)
    _model(tmp_path, "broken", fail_load=True)
    (worker,) = await sim_workers(1, repository=tmp_path, memory=1000)
    url = worker.url

    status, _ = await _post(http, f"{url}/v2/models/iris/infer", OIP_BODY)
    assert status == 404  # not loaded yet
    status, index = await _post(http, f"{url}/v2/repository/index")
    assert status == 200
    assert {e["name"]: e["state"] for e in index} == {
        "big": "UNAVAILABLE",
        "broken": "UNAVAILABLE",
        "iris": "UNAVAILABLE",
    }

    assert (await _post(http, f"{url}/v2/repository/models/iris/load"))[0] == 200
    status, answer = await _post(http, f"{url}/v2/models/iris/infer", OIP_BODY)
    assert status == 200 and answer["model_name"] == "iris"
    status, index = await _post(http, f"{url}/v2/repository/index", {"ready": True})
    assert index == [{"name": "iris", "version": "", "state": "READY", "reason": "", "memory_bytes": 300}]
    assert await metric_value(http, url, "modelyard_sim_memory_used_bytes") == 300
    assert await metric_value(http, url, "modelyard_sim_model_memory_bytes", model="iris") == 300

    status, error = await _post(http, f"{url}/v2/repository/models/big/load")
    assert status == 500 and "out of memory" in error["error"] and "800" in error["error"]
    status, error = await _post(http, f"{url}/v2/repository/models/broken/load")
    assert status == 500 and "simulated load failure" in error["error"]
    status, error = await _post(http, f"{url}/v2/repository/models/nope/load")
    assert status == 404 and error == {"error": "Model nope not found"}

    assert (await _post(http, f"{url}/v2/repository/models/iris/unload"))[0] == 200
    assert (await _post(http, f"{url}/v2/models/iris/infer", OIP_BODY))[0] == 404
    assert (await _post(http, f"{url}/v2/repository/models/iris/unload"))[0] == 404
    async with http.get(f"{url}/sim/repository") as response:
        assert await response.json() == {
            "memory_bytes": 1000,
            "memory_used_bytes": 0,
            "loaded": {},
            "loads": {"iris": 1},  # failed loads are not counted
            "unloads": {"iris": 1},
        }
    assert await metric_value(http, url, "modelyard_sim_model_loads_total", model="iris") == 1


async def test_openai_and_model_list_see_only_loaded_models_without_a_dir(sim_workers, http):
    (worker,) = await sim_workers(1, repository_api=True, model_memory=10, fail_load=("bad",))
    url = worker.url
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{url}/v1/chat/completions", json=chat) as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "model_not_found"
    assert (await _post(http, f"{url}/v2/repository/models/llm/load"))[0] == 200
    async with http.post(f"{url}/v1/chat/completions", json=chat) as response:
        assert response.status == 200
    async with http.get(f"{url}/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["llm"]
    assert (await _post(http, f"{url}/v2/repository/models/bad/load"))[0] == 500
    assert await metric_value(http, url, "modelyard_sim_models_loaded") == 1


async def test_without_repository_mode_there_is_no_repository_api(sim_workers, http):
    (worker,) = await sim_workers(1)
    async with http.post(f"{worker.url}/v2/repository/index", json={}) as response:
        assert response.status in (404, 405)
    assert (await _post(http, f"{worker.url}/v2/models/anything/infer", OIP_BODY))[0] == 200


async def _loaded(http, url):
    async with http.get(f"{url}/sim/repository") as response:
        return (await response.json())["loaded"]


async def test_an_unload_during_a_load_waits_for_it_then_unloads(sim_workers, http):
    (worker,) = await sim_workers(1, repository_api=True, load_delay=0.3, model_memory=100)
    model = f"{worker.url}/v2/repository/models/m"
    load = asyncio.create_task(_post(http, f"{model}/load"))
    await asyncio.sleep(0.1)
    # Before: 404 at once, then the load finished and the model stayed loaded, unasked.
    assert (await _post(http, f"{model}/unload"))[0] == 200
    assert (await load)[0] == 200
    assert await _loaded(http, worker.url) == {}


async def test_a_reload_serves_the_old_model_meanwhile_and_a_failed_one_keeps_it(sim_workers, http, tmp_path):
    _model(tmp_path, "iris", memory_bytes=100)
    (worker,) = await sim_workers(1, repository=tmp_path, load_delay=0.3, memory=150)
    url, model = worker.url, f"{worker.url}/v2/repository/models/iris"
    assert (await _post(http, f"{model}/load"))[0] == 200
    reload = asyncio.create_task(_post(http, f"{model}/load"))
    await asyncio.sleep(0.1)
    # Before: the old model was dropped when the reload began, so inference answered 404.
    assert (await _post(http, f"{url}/v2/models/iris/infer", OIP_BODY))[0] == 200
    assert (await reload)[0] == 200  # in the memory of the model it replaces (150 holds one)
    assert await _loaded(http, url) == {"iris": 100}

    settings = {"name": "iris", "parameters": {"extra": {"memory_bytes": 100, "fail_load": True}}}
    (tmp_path / "iris" / "model-settings.json").write_text(json.dumps(settings))
    assert (await _post(http, f"{model}/load"))[0] == 500
    assert (await _post(http, f"{url}/v2/models/iris/infer", OIP_BODY))[0] == 200  # the old one serves
    assert await _loaded(http, url) == {"iris": 100}
