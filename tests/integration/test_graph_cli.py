"""`modelyard graph validate | run | serve` as a user runs them, in a subprocess with a bounded timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from modelyard.simworker import SimWorker, SimWorkerConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "graphs"
VALID = FIXTURES / "valid"
INVALID = FIXTURES / "invalid"
TIMEOUT = 30.0  # the longest any one command may take
ENV = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
ENV.pop("PROPAGATE_HEADERS", None)


def modelyard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "graph", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=ENV,
    )


async def modelyard_async(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modelyard",
        "graph",
        *args,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(TIMEOUT):
            stdout, stderr = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def doubler() -> AsyncIterator[SimWorker]:
    worker = SimWorker(SimWorkerConfig(port=0, prefill_ms_per_token=0, decode_ms_per_token=0, oip_scale=2.0))
    await worker.start()
    yield worker
    await worker.stop()


# validate -----------------------------------------------------------------------------------------


def test_validate_accepts_good_files_and_prints_warnings() -> None:
    result = modelyard("validate", str(VALID), str(FIXTURES / "warnings.yaml"))
    assert result.returncode == 0, result.stderr
    multi = VALID / "multi.yaml"
    assert result.stdout.splitlines() == [
        f"{VALID / 'kserve-sequence.yaml'}: graph 'doubler-chain': ok",
        f"{VALID / 'manifest.json'}: graph 'json-graph': ok",
        f"{VALID / 'mapping.yaml'}: graph 'ensemble-graph': ok",
        f"{VALID / 'mapping.yaml'}: graph 'nested-graph': ok",
        f"{multi} (document 1): graph 'switch-graph': ok",
        f"{multi} (document 2): graph 'splitter-graph': ok",
        f"{FIXTURES / 'warnings.yaml'}: graph 'with-warnings': ok",
    ]
    prefix = f"warning: {FIXTURES / 'warnings.yaml'}: graph 'with-warnings': "
    assert result.stderr.splitlines() == [
        prefix + "nodes.root.steps[0].condition: missing: this Switch step can never be chosen",
        prefix + "nodes.root.steps[0].weight: ignored: only a Splitter uses weights, this is a Switch",
        prefix + "nodes.orphan: unreachable from root: it never runs",
    ]


def test_validate_reports_every_error_with_its_path() -> None:
    webhook, cycle, wrong = INVALID / "webhook.yaml", INVALID / "cycle.yaml", INVALID / "wrong-kind.yaml"
    good = VALID / "manifest.json"
    result = modelyard(
        "validate", str(webhook), str(cycle), str(wrong), str(INVALID / "syntax-error.yaml"), str(good)
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines() == [f"{good}: graph 'json-graph': ok"]  # later files are still checked
    lines = result.stderr.splitlines()
    graph = f"error: {webhook}: graph 'Bad_Graph': "
    assert any(
        line.startswith(graph + 'metadata.name: The InferenceGraph "Bad_Graph" is invalid: ')
        for line in lines
    )
    assert any(
        line.startswith(graph + "nodes.split.steps[1].weight: InferenceGraph[Bad_Graph] ") for line in lines
    )
    for expected in [
        graph + "nodes: root node not found, InferenceGraph needs a node with name 'root' as the root node "
        "of the graph",
        graph
        + 'nodes.start.steps[1].name: Node "start" of InferenceGraph "Bad_Graph" contains more than one step '
        'with name "dup"',
        graph
        + 'nodes.start.steps[1]: Step 1 ("dup") in node "start" of InferenceGraph "Bad_Graph" specifies more '
        "than one of nodeName, serviceName, serviceUrl",
        graph
        + 'nodes.start.steps[2]: Step 2 ("") in node "start" of InferenceGraph "Bad_Graph" does not specify '
        "an inference target",
        f"error: {cycle}: graph 'loop': nodes.root: cycle: root -> a -> root",
        f"error: {wrong}: apiVersion: expected 'serving.kserve.io/v1alpha1', got 'serving.kserve.io/v1beta1'",
        f"error: {wrong}: kind: expected 'InferenceGraph', got 'InferenceService'",
    ]:
        assert expected in lines, expected
    assert any(
        line.startswith(f"error: {INVALID / 'syntax-error.yaml'}: line 8, column 1: invalid YAML")
        for line in lines
    )
    assert sum(line.startswith(graph) for line in lines) == 6


def test_validate_prints_kserve_bracketed_messages_verbatim() -> None:
    result = modelyard("validate", str(INVALID / "webhook.yaml"))
    assert result.returncode == 1
    graph = f"error: {INVALID / 'webhook.yaml'}: graph 'Bad_Graph': "
    lines = result.stderr.splitlines()
    assert (
        graph + "nodes.split.steps[1].weight: InferenceGraph[Bad_Graph] Node[split] Route[model-b] "
        "missing the 'Weight'"
    ) in lines
    assert (
        graph
        + 'metadata.name: The InferenceGraph "Bad_Graph" is invalid: a InferenceGraph name must consist of '
        "lower case alphanumeric characters or '-', and must start with alphabetical character. "
        '(e.g. "my-name" or "abc-123", regex used for validation is \'[a-z]([-a-z0-9]*[a-z0-9])?\')'
    ) in lines


# run ----------------------------------------------------------------------------------------------


async def test_run_prints_the_answer_and_a_trace(doubler: SimWorker) -> None:
    code, stdout, stderr = await modelyard_async(
        "run",
        str(VALID / "kserve-sequence.yaml"),
        "--data",
        '{"instances": [1, 2.5]}',
        "--service",
        f"doubler={doubler.url}/v1/models/m:predict",
    )
    assert code == 0, stderr
    assert stdout == '{"predictions":[4,10]}\n'
    assert "graph 'doubler-chain': 200" in stderr
    rows = [line for line in stderr.splitlines() if "doubler" in line and "root" in line]
    assert len(rows) == 2
    assert "first" in rows[0] and "second" in rows[1]
    assert all("200" in row for row in rows)


def test_run_refuses_unresolved_service_names() -> None:
    result = modelyard("run", str(VALID / "kserve-sequence.yaml"), "--data", "{}")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: serviceName without a URL: doubler; pass --service NAME=URL"


# serve --------------------------------------------------------------------------------------------


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes] | None:
    try:
        async with http.get(url) as response:
            return response.status, await response.read()
    except aiohttp.ClientConnectionError:
        return None


async def test_serve_runs_the_graph_and_drains_on_sigterm(doubler: SimWorker) -> None:
    received: list[tuple[str, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        received.append((await request.text(), request.headers.get("Authorization")))
        return web.json_response({"recorded": True})

    app = web.Application()
    app.router.add_post("/record", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    recorder = f"http://127.0.0.1:{runner.addresses[0][1]}/record"

    spec = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    {"serviceName": "doubler"},
                    {"serviceUrl": recorder, "data": "$response", "mapPredictionsToInstances": True},
                ],
            }
        }
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "modelyard", "graph", "serve", "--graph-json", json.dumps(spec)],
        *["--host", "127.0.0.1", "--port", str(port), "--drain-seconds", "0.5"],
        *["--service", f"doubler={doubler.url}/v1/models/m:predict"],
        env={**ENV, "PROPAGATE_HEADERS": "Authorization"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with asyncio.timeout(TIMEOUT):  # bounded wait for the process to listen
                while await _status(http, base + "/readyz") != (200, b""):
                    assert process.returncode is None, "graph serve exited before it was ready"
                    await asyncio.sleep(0.05)

            headers = {"Authorization": "Bearer t", "Content-Type": "application/json"}
            async with http.post(
                base + "/any/path?q=1", data=b'{"instances": [1, 2]}', headers=headers
            ) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == "application/json"
                assert await response.read() == b'{"recorded": true}'
            assert received == [('{"instances":[2,4]}', "Bearer t")]

            process.send_signal(signal.SIGTERM)
            seen: list[tuple[int, bytes] | None] = []
            async with asyncio.timeout(TIMEOUT):  # 503 during the drain, then the process exits
                while process.returncode is None:
                    status = await _status(http, base + "/readyz")
                    seen.append(status)
                    if status is None:
                        break
                    await asyncio.sleep(0.02)
                stdout, stderr = await process.communicate()
        assert (503, b"shutting down\n") in seen
        assert process.returncode == 0, stderr.decode()
        assert f"graph router listening on {base} (graph 'graph')" in stdout.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("graph_json", "message"),
    [
        ("{not json", "error: --graph-json is not valid JSON: "),
        (
            '{"nodes": {"root": {"routerType": "Sequence", "steps": [{"nodeName": "root"}]}}}',
            "error: --graph-json: graph 'graph': nodes.root: cycle: root -> root",
        ),
    ],
)
def test_serve_refuses_a_bad_graph(graph_json: str, message: str) -> None:
    result = modelyard("serve", "--graph-json", graph_json, "--host", "127.0.0.1", "--port", str(free_port()))
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr


def test_serve_takes_the_spec_kserves_controller_passes(tmp_path):
    """The controller keeps serviceName beside the serviceUrl it resolved; the router must start."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = (
        '{"nodes":{"root":{"routerType":"Sequence","steps":[{"name":"a","serviceName":"model-a",'
        '"serviceUrl":"http://127.0.0.1:9/v1/models/model-a:predict"}]}}}'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "modelyard", "graph", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--graph-json", spec, "--drain-seconds", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
            except OSError:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                time.sleep(0.05)  # a bounded wait for the server process to listen
        else:
            raise AssertionError("the router did not start")
    finally:
        process.terminate()
        process.wait(timeout=10)
