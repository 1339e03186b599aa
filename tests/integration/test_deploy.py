"""`modelyard deploy render` and `modelyard graph deploy` as a user runs them, and the paths the
rendered probes hit, answered by the real servers (issue 12 items 1 to 3)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from certificates import Pki
from kube_schemas import validate
from modelyard.agent import AgentConfig, start_agent
from modelyard.kube.render import render
from modelyard.kube.values import DeployValues
from modelyard.scheduler import SchedulerConfig, start_scheduler
from support import free_ports, metric_value, run_modelyard, wait_answering, wait_until

ROOT = Path(__file__).parents[2]
PIPELINE = ROOT / "examples" / "graphs" / "pipeline.yaml"


def modelyard(*args: str) -> subprocess.CompletedProcess[str]:
    return run_modelyard(*args, cwd=ROOT)


def valid(text: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for doc in docs:
        validate(doc, "1.30.0")  # cert-manager's kinds against its API too
    return docs


def test_deploy_render_prints_every_role_ready_for_kubectl():
    result = modelyard("deploy", "render")
    assert result.returncode == 0, result.stderr
    docs = valid(result.stdout)
    assert docs == render(DeployValues())
    result = modelyard("deploy", "render", "--values", "deploy/values-production.yaml")
    assert result.returncode == 0, result.stderr
    assert {d["metadata"]["name"] for d in valid(result.stdout) if d["kind"] == "StatefulSet"} == {
        "modelyard-scheduler",
        "cpu-pool",
        "gpu-pool",
    }


def test_deploy_render_writes_a_file(tmp_path):
    out = tmp_path / "modelyard.yaml"
    result = modelyard("deploy", "render", "-o", str(out))
    assert result.returncode == 0 and result.stdout == ""
    assert f"wrote {len(valid(out.read_text()))} manifests to {out}" in result.stderr


def test_bad_values_print_the_file_and_every_field_path(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("gateway:\n  replicas: 0\n  config: {listen: {port: -1}}\nredis: {deploy: false}\n")
    result = modelyard("deploy", "render", "--values", str(values))
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert f"error: {values}: gateway.replicas: Input should be greater than or equal to 1 (got 0)" in lines
    assert any(line.startswith(f"error: {values}: redis: deploy is false: give url") for line in lines)
    # the gateway's own config is checked once the values are: its problems come next time
    values.write_text("gateway:\n  config: {listen: {port: -1}}\n")
    result = modelyard("deploy", "render", "--values", str(values))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {values}: gateway.config.listen.port: Input should be greater")
    result = modelyard("deploy", "render", "--values", str(tmp_path / "missing.yaml"))
    assert result.returncode == 1
    assert "missing.yaml: cannot read file: No such file or directory" in result.stderr


def test_graph_deploy_prints_kserves_objects_for_the_manifest_a_user_has():
    result = modelyard(
        "graph", "deploy", str(PIPELINE), "--namespace", "ml", "--service",
        "demo-echo=http://echo.ml.svc.cluster.local/v2/models/demo-echo/infer",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # every serviceName resolved: nothing guessed
    deployment, service, hpa = valid(result.stdout)
    assert [deployment["kind"], service["kind"], hpa["kind"]] == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
    ]
    assert deployment["metadata"]["namespace"] == "ml"
    assert (
        "http://echo.ml.svc.cluster.local/v2/models/demo-echo/infer"
        in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1]
    )
    # without --service, the InferenceService's raw-mode address, said on stderr
    result = modelyard("graph", "deploy", str(PIPELINE))
    assert result.returncode == 0
    assert "serviceName 'demo-echo' goes to its InferenceService's predictor in 'default'" in result.stderr


def test_graph_deploy_refuses_a_bad_graph_before_printing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(PIPELINE.read_text().replace("routerType: Ensemble", "routerType: Fanout"))
    result = modelyard("graph", "deploy", str(bad))
    assert result.returncode == 1 and result.stdout == ""
    assert "routerType" in result.stderr and str(bad) in result.stderr
    result = modelyard("graph", "deploy", str(PIPELINE), "--name", "nope")
    assert result.returncode == 1 and "no graph named 'nope'" in result.stderr


async def test_the_rendered_graph_router_serves_its_graph(sim_workers, http, tmp_path):
    """The Deployment's command and args, run as the pod would (port aside), answer /readyz and the graph."""
    (worker,) = await sim_workers(1)
    graph = tmp_path / "graph.yaml"
    graph.write_text(
        "apiVersion: serving.kserve.io/v1alpha1\nkind: InferenceGraph\nmetadata: {name: one}\n"
        "spec: {nodes: {root: {routerType: Sequence, steps: [{name: m, serviceName: m}]}}}\n"
    )
    result = modelyard("graph", "deploy", str(graph), "--service", f"m={worker.url}/v2/models/m/infer")
    deployment = next(yaml.safe_load_all(result.stdout))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = free_ports(1)
    command = [sys.executable, "-m", *container["command"]]  # modelyard graph serve, from this checkout
    router = await asyncio.create_subprocess_exec(
        *command, *container["args"], "--port", str(port), "--host", "127.0.0.1",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    probe = container["readinessProbe"]["httpGet"]
    try:
        await wait_answering(http, f"http://127.0.0.1:{port}{probe['path']}", router)
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with http.post(f"http://127.0.0.1:{port}/", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["model_name"] == "m"
    finally:
        if router.returncode is None:
            router.terminate()
        await router.wait()


async def test_the_gateway_and_scheduler_answer_their_probe_paths(gateways, sim_workers, http, tmp_path):
    docs = render(DeployValues())
    paths = {
        (doc["metadata"]["name"], c["name"]): {
            c[kind]["httpGet"]["path"]
            for kind in ("readinessProbe", "livenessProbe", "startupProbe")
            if kind in c
        }
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
        if "httpGet" in c.get("readinessProbe", {})
    }
    (worker,) = await sim_workers(1)
    gateway = await gateways([{"name": "m", "endpoints": [{"url": worker.url}]}])
    scheduler = await start_scheduler(SchedulerConfig(port=0, agent_port=0, db=str(tmp_path / "s.db")))
    try:
        for path in paths[("modelyard-gateway", "gateway")]:
            async with http.get(gateway.url + path) as response:
                assert response.status == 200, path
        for path in paths[("modelyard-scheduler", "scheduler")]:
            async with http.get(scheduler.url + path) as response:
                assert response.status == 200, path
        # MLServer's probe paths are the OIP health paths every OIP server answers (the sim-worker
        # here; real MLServer in test_agent_mlserver.py)
        for path in paths[("mlserver", "mlserver")]:
            async with http.get(worker.url + path) as response:
                assert response.status == 200, path
    finally:
        await scheduler.stop()


async def test_the_agent_is_ready_while_subscribed(scheduler, sim_workers, http):
    """/agent/readyz: 200 while the agent holds a subscription, 503 (with why) without one."""
    fake, target = scheduler
    (worker,) = await sim_workers(1, repository_api=True)
    (closed,) = free_ports(1)
    settings: dict[str, Any] = {
        "server_name": "s", "inference_url": worker.url, "memory_bytes": 1000, "port": 0,
        "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.1,
    }  # fmt: skip
    lonely = await start_agent(AgentConfig(scheduler=f"127.0.0.1:{closed}", **settings))
    agent = await start_agent(AgentConfig(scheduler=target, **settings))
    try:
        async with http.get(lonely.url + "/agent/livez") as response:
            assert response.status == 200
        async with http.get(lonely.url + "/agent/readyz") as response:
            assert response.status == 503
            assert (await response.json())["reason"] == "not subscribed to the scheduler"

        async def ready() -> bool:
            async with http.get(agent.url + "/agent/readyz") as response:
                return response.status == 200

        await wait_until(ready, attempts=1000)

        async def subscribed() -> bool:
            return len(fake.subscribes) == 1

        await wait_until(subscribed)
    finally:
        await lonely.stop()
        await agent.stop()


async def test_requests_in_flight_are_exported_for_the_autoscaler(gateways, sim_workers, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=100.0)
    gateway = await gateways([{"name": "m", "endpoints": [{"url": worker.url}]}])
    assert await metric_value(http, gateway.url, "modelyard_requests_in_flight", model="m") == 0
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    async with http.post(gateway.url + "/v1/chat/completions", json=chat) as response:
        assert response.status == 200
        await response.content.readline()  # the stream has begun: the request is in flight
        assert await metric_value(http, gateway.url, "modelyard_requests_in_flight", model="m") == 1
        await response.read()

    async def done() -> bool:
        return await metric_value(http, gateway.url, "modelyard_requests_in_flight", model="m") == 0

    await wait_until(done)


async def test_mlservers_prestop_waits_for_the_agent_to_exit(sim_workers, http, tmp_path):
    """The rendered preStop hook of the MLServer container, run against a real agent whose data
    plane serves TLS, as rendered: it holds while the agent answers (draining included), and
    returns once the agent has exited."""
    (server,) = [
        d
        for d in render(DeployValues())
        if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "mlserver"
    ]
    containers = {c["name"]: c for c in server["spec"]["template"]["spec"]["containers"]}
    command = containers["mlserver"]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    (worker,) = await sim_workers(1, repository_api=True)
    served = Pki(tmp_path).issue("*.mlserver.modelyard.svc")  # as the server's Certificate names it
    agent = await start_agent(
        AgentConfig(
            scheduler="127.0.0.1:1", server_name="s", inference_url=worker.url, memory_bytes=1000, port=0,
            tls={"cert_file": str(served.cert), "key_file": str(served.key)},
        )
    )  # fmt: skip
    assert "https://127.0.0.1:9999/agent/livez" in command[2]
    script = command[2].replace("127.0.0.1:9999", agent.url.removeprefix("https://"))
    hook = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(hook.wait()), 1.5)
        assert hook.returncode is None  # still waiting: the agent is up
    finally:
        await agent.stop()
    assert await asyncio.wait_for(hook.wait(), 10) == 0
