"""A graph whose steps are served by a real inference server: MLServer with a scikit-learn model.

MLServer and scikit-learn live in their own virtual environment (they pin their own numpy,
fastapi and protobuf), installed from their own lock (tests/fixtures/mlserver/requirements.txt,
every version with its hashes: `make lock`), built by the fixture on first use under `.cache/` and
reused until the lock changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import free_ports

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "tests" / "fixtures" / "mlserver" / "requirements.txt"
VENV = ROOT / ".cache" / f"mlserver-{hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]}"

TRAIN = """
import joblib, sys
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
X, y = load_iris(return_X_y=True)
joblib.dump(LogisticRegression(max_iter=500).fit(X, y), sys.argv[1])
"""

SETOSA = [5.1, 3.5, 1.4, 0.2]  # class 0
VIRGINICA = [6.7, 3.0, 5.2, 2.3]  # class 2


def _mlserver_venv() -> Path:
    ready = VENV / ".ready"
    if ready.exists():
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--require-hashes", "-r", str(LOCK)], check=True, timeout=900)
    ready.write_text("ok\n")
    return VENV


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlserver exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # a bounded wait for the server process to come up
    pytest.fail(f"mlserver not ready in {seconds}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def mlserver_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """MLServer serving the iris model: (its REST URL, its gRPC URL as grpc_url takes it)."""
    venv = _mlserver_venv()
    models = tmp_path_factory.mktemp("mlserver")
    iris = models / "iris"
    iris.mkdir()
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", TRAIN, str(iris / "model.joblib")], check=True, timeout=300
    )
    (iris / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "iris",
                "implementation": "mlserver_sklearn.SKLearnModel",
                "parameters": {"uri": "./model.joblib", "version": "v1"},
            }
        )
    )
    http_port, grpc_port, metrics_port = free_ports(3)
    (models / "settings.json").write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "http_port": http_port,
                "grpc_port": grpc_port,
                "metrics_port": metrics_port,
                "parallel_workers": 0,
            }
        )
    )
    log = models / "mlserver.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(venv / "bin" / "mlserver"), "start", str(models)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(url, process, log)
        yield url, f"grpc://127.0.0.1:{grpc_port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def mlserver(mlserver_urls: tuple[str, str]) -> str:
    return mlserver_urls[0]


def infer_body(*rows: list[float]) -> dict:
    return {
        "inputs": [
            {"name": "x", "shape": [len(rows), 4], "datatype": "FP64", "data": [v for r in rows for v in r]}
        ]
    }


async def test_gateway_graph_over_mlserver(mlserver, gateways, http):
    graph = {
        "nodes": {
            "root": {
                "routerType": "Ensemble",
                "steps": [
                    {"name": "direct", "serviceName": "iris"},
                    {"name": "via-switch", "nodeName": "pick"},
                ],
            },
            "pick": {
                "routerType": "Switch",
                "steps": [{"serviceName": "iris", "condition": "inputs.#(name==x)"}],
            },
        }
    }
    model = {
        "name": "iris",
        "protocol": "v2",
        "endpoints": [{"url": mlserver}],
        "health_check": {"path": "/v2/health/ready"},
    }
    gateway = await gateways([model], graphs={"iris-ensemble": graph})
    async with http.post(
        gateway.url + "/v1/graphs/iris-ensemble", json=infer_body(SETOSA, VIRGINICA)
    ) as response:
        assert response.status == 200, await response.text()
        body = await response.json()
    for key in ("direct", "via-switch"):
        (output,) = body[key]["outputs"]
        assert output["data"] == [0, 2]
        assert body[key]["model_name"] == "iris"

    # The model is also reachable through the gateway's plain OIP route.
    async with http.post(gateway.url + "/v2/models/iris/infer", json=infer_body(VIRGINICA)) as response:
        assert (await response.json())["outputs"][0]["data"] == [2]


async def test_drop_in_router_over_mlserver(mlserver, http):
    from modelyard.graph import GraphDocument, parse_graph
    from modelyard.graphrouter import start_router

    spec = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "iris"}]}}}
    graph, _ = parse_graph(GraphDocument("iris", spec, "<test>"))
    router = await start_router(
        graph, host="127.0.0.1", port=0, services={"iris": mlserver + "/v2/models/iris/infer"}
    )
    try:
        async with http.post(router.url + "/", json=infer_body(SETOSA)) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json"
            assert (await response.json())["outputs"][0]["data"] == [0]
    finally:
        await router.stop()
