"""The agent driving a real MLServer 1.7.1 through its repository API: fetch a scikit-learn iris
model from a local storageUri into MLServer's model repository, load, infer, unload.

MLServer starts with an empty repository and `load_models_at_startup: false`; the venv is the one
test_graph_mlserver.py builds (and caches under .cache/).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_graph_mlserver import SETOSA, TRAIN, VIRGINICA, _mlserver_venv, _wait_ready, infer_body

from fake_agent_scheduler import FakeScheduler
from modelyard.agent import AgentConfig, start_agent
from modelyard.rpc.agent_v1 import agent_pb2
from support import free_ports, wait_until

Event = agent_pb2.ModelEvent


@pytest.fixture(scope="module")
def mlserver_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(url, repository dir, iris source dir): MLServer over an empty repository."""
    venv = _mlserver_venv()
    root = tmp_path_factory.mktemp("agent-mlserver")
    source = root / "sources" / "iris"
    source.mkdir(parents=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", TRAIN, str(source / "model.joblib")], check=True, timeout=300
    )
    (source / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "iris-as-uploaded",  # the agent renames it to the model's name
                "implementation": "mlserver_sklearn.SKLearnModel",
                "parameters": {"uri": "./model.joblib"},
            }
        )
    )
    broken = root / "sources" / "broken"
    broken.mkdir()
    (broken / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "broken",
                "implementation": "mlserver_sklearn.SKLearnModel",
                "parameters": {"uri": "./missing.joblib"},
            }
        )
    )
    # `mlserver start DIR` makes DIR the model repository root, whatever settings.json says: the
    # server's settings live in the repository the agent fetches into (it only adds model dirs).
    repository = root / "repository"
    repository.mkdir()
    http_port, grpc_port, metrics_port = free_ports(3)
    (repository / "settings.json").write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "http_port": http_port,
                "grpc_port": grpc_port,
                "metrics_port": metrics_port,
                "parallel_workers": 0,
                "load_models_at_startup": False,
            }
        )
    )
    log = root / "mlserver.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(venv / "bin" / "mlserver"), "start", str(repository)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(url, process, log)
        yield url, repository, source
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


async def test_agent_loads_serves_and_unloads_on_mlserver(mlserver_repo, scheduler, http):
    url, repository, source = mlserver_repo
    fake, target = scheduler
    config = AgentConfig(
        scheduler=target,
        server_name="mlserver",
        inference_url=url,
        memory_bytes="10M",  # type: ignore[arg-type]
        capabilities=("mlserver", "sklearn"),  # type: ignore[arg-type]
        repository=repository,
        unload_grace=0,
        load_attempts=2,
        load_backoff=0.05,
        fetch_roots=(source.parent,),  # the sources, beside the repository
    )
    agent = await start_agent(config)
    try:
        async with http.post(f"{url}/v2/models/iris/infer", json=infer_body(SETOSA)) as response:
            assert response.status == 404  # nothing preloaded
        await _subscribed(fake)
        fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(source), memory_bytes=1000)
        loaded = await _outcome(fake, "iris", 60)
        assert loaded.event == Event.LOADED, loaded.message
        assert loaded.available_memory_bytes == 10_000_000 - 1000

        async with http.post(f"{url}/v2/models/iris/infer", json=infer_body(SETOSA, VIRGINICA)) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["model_name"] == "iris"
        assert answer["outputs"][0]["data"] == [0, 2]

        fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "broken", storage_uri=str(source.parent / "broken"))
        failed = await _outcome(fake, "broken", 60)
        assert failed.event == Event.LOAD_FAILED
        assert "after 2 attempt(s)" in failed.message and "missing.joblib" in failed.message
        assert not (repository / "broken").exists()

        fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris")
        await fake.event("iris", Event.UNLOADED, within=60)
        async with http.post(f"{url}/v2/models/iris/infer", json=infer_body(SETOSA)) as response:
            assert response.status == 404
        assert not (repository / "iris").exists()
    finally:
        await agent.stop()


async def _subscribed(fake: FakeScheduler) -> None:
    async def subscribed() -> bool:
        return bool(fake.subscribes)

    await wait_until(subscribed, attempts=1000)


async def _outcome(fake: FakeScheduler, name: str, within: float) -> agent_pb2.ModelEvent:
    """The first event for `name`, whatever it is (a failure shows its message at once)."""

    async def arrived() -> bool:
        return any(e.model_name == name for e in fake.events)

    await wait_until(arrived, attempts=int(within / 0.01))
    return next(e for e in fake.events if e.model_name == name)
