"""The `modelyard` command as a user runs it: config validate, serve with a bad file, the demo."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from modelyard.config import load_config

EXAMPLES = Path(__file__).parents[2] / "examples"
BAD_CONFIG = """
listen: {port: 99999}
models:
  - name: m
    strategy: fastest
    endpoints:
      - {url: "http://127.0.0.1:9001"}
      - {url: "ftp://nowhere", weight: -1}
"""


def modelyard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelyard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_validate_accepts_the_example_config():
    result = modelyard("config", "validate", str(EXAMPLES / "gateway.yaml"))
    assert result.returncode == 0, result.stderr
    assert "ok (2 models, 0 graphs)" in result.stdout


def test_validate_prints_every_error_with_its_field_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_CONFIG)
    result = modelyard("config", "validate", str(bad))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert any(f"{bad}: listen.port:" in line for line in lines)
    assert any(f"{bad}: models[0].strategy: expected one of" in line for line in lines)
    assert any(f"{bad}: models[0].endpoints[1].url: expected an http://" in line for line in lines)
    assert any(f"{bad}: models[0].endpoints[1].weight:" in line for line in lines)
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_bad_file_with_exit_code_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    endpoints: []\n")
    result = modelyard("serve", "-c", str(bad))
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"error: {bad}: models[0].endpoints: List should have at least 1 item after validation, not 0"
    )


def test_serve_reports_unreadable_and_invalid_yaml(tmp_path):
    missing = modelyard("serve", "-c", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "cannot read file" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [\n")
    result = modelyard("serve", "-c", str(broken))
    assert result.returncode == 1 and "line 2" in result.stderr and "invalid YAML" in result.stderr


def test_print_config_applies_env_and_cli_precedence():
    env = {"MODELYARD_LISTEN__PORT": "9100", "MODELYARD_ADMIN__TOKEN": "t0ken"}
    result = modelyard(
        "serve", "-c", str(EXAMPLES / "gateway.yaml"), "--host", "::1", "--print-config", env=env
    )
    assert result.returncode == 0, result.stderr
    assert "port: 9100" in result.stdout and "host: ::1" in result.stdout and "token: t0ken" in result.stdout
    assert re.search(r"^# listen\.workers: \d+ process(es)? here$", result.stdout, re.M)  # what auto gives


def test_validate_and_serve_blame_a_bad_variable_not_the_file():
    # The same precedence as serve (flags > MODELYARD_* > file > defaults), and the line names
    # where the value came from: the variable, not the file that is fine.
    env = {"MODELYARD_LISTEN__PORT": "abc"}
    expected = "error: environment: MODELYARD_LISTEN__PORT: expected an integer (got 'abc')"
    validated = modelyard("config", "validate", str(EXAMPLES / "gateway.yaml"), env=env)
    assert (validated.returncode, validated.stderr.strip()) == (1, expected)
    served = modelyard("serve", "-c", str(EXAMPLES / "gateway.yaml"), "--print-config", env=env)
    assert (served.returncode, served.stderr.strip()) == (1, expected)
    demo = modelyard("serve", "--print-config", env=env)  # the embedded demo reads it too
    assert (demo.returncode, demo.stderr.strip()) == (1, expected)


def test_a_problem_in_the_file_still_names_the_file_and_its_field_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: {port: abc}\n")
    env = {"MODELYARD_ADMIN__TOKEN": "t0ken"}  # fine: the file is to blame
    for command in (("config", "validate", str(bad)), ("serve", "-c", str(bad))):
        result = modelyard(*command, env=env)
        assert (result.returncode, result.stderr.strip()) == (
            1,
            f"error: {bad}: listen.port: expected an integer (got 'abc')",
        )


def test_a_bad_flag_is_named_as_the_flag():
    result = modelyard("serve", "-c", str(EXAMPLES / "gateway.yaml"), "--port", "99999")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: command line: --port: Input should be less than or equal to 65535 (got 99999)"
    )


@pytest.mark.parametrize("config", [["-c", str(EXAMPLES / "gateway.yaml")], []], ids=["file", "none"])
def test_a_bad_scheduler_is_named_as_the_variable_or_the_flag_that_gave_it(config):
    # --scheduler reads MODELYARD_SCHEDULER when it is not given: a value from there is no flag.
    expected = "expected host:port or http://host:port for the scheduler (got 'bad::x')"
    served = modelyard("serve", *config, "--print-config", env={"MODELYARD_SCHEDULER": "bad::x"})
    assert (served.returncode, served.stderr.strip()) == (
        1,
        f"error: environment: MODELYARD_SCHEDULER: {expected}",
    )
    served = modelyard("serve", *config, "--print-config", "--scheduler", "bad::x")
    assert (served.returncode, served.stderr.strip()) == (1, f"error: command line: --scheduler: {expected}")


def test_the_scheduler_field_s_own_variable_is_named_and_the_flag_s_variable_wins_over_it():
    expected = "expected host:port or http://host:port for the scheduler (got 'bad::x')"
    config = ["-c", str(EXAMPLES / "gateway.yaml")]
    served = modelyard("serve", *config, "--print-config", env={"MODELYARD_PLACEMENT__SCHEDULER": "bad::x"})
    assert (served.returncode, served.stderr.strip()) == (
        1,
        f"error: environment: MODELYARD_PLACEMENT__SCHEDULER: {expected}",
    )
    env = {"MODELYARD_PLACEMENT__SCHEDULER": "ok:9004", "MODELYARD_SCHEDULER": "bad::x"}
    served = modelyard("serve", *config, "--print-config", env=env)
    assert (served.returncode, served.stderr.strip()) == (
        1,
        f"error: environment: MODELYARD_SCHEDULER: {expected}",
    )


@pytest.mark.parametrize("config", [["-c", str(EXAMPLES / "gateway.yaml")], []], ids=["file", "demo"])
def test_print_config_into_a_closed_pipe_exits_quietly(config):
    # `modelyard serve --print-config | head -1`: head has gone before the config is printed.
    # Closing our end first makes that deterministic: the first write meets a closed pipe.
    process = subprocess.Popen(
        [sys.executable, "-m", "modelyard", "serve", *config, "--print-config"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    process.stdout.close()
    stderr = process.stderr.read()
    process.stderr.close()
    assert process.wait(60) != 0  # the output was cut short, but nothing to say about it
    assert stderr == ""


def test_print_config_shows_effective_values_and_loads_back(tmp_path):
    printed = modelyard("serve", "-c", str(EXAMPLES / "gateway.yaml"), "--print-config")
    assert printed.returncode == 0, printed.stderr
    # What the defaults mean, not '' (the gateway's own service name, <url>/metrics).
    assert "  service_name: modelyard-gateway\n" in printed.stdout
    first_url = load_config(EXAMPLES / "gateway.yaml").models[0].endpoints[0].url
    assert f"    metrics_url: {first_url}/metrics\n" in printed.stdout
    assert "''" not in printed.stdout.replace("gpu_metrics_url: ''", "").replace("grpc_url: ''", "")
    again = tmp_path / "printed.yaml"
    again.write_text(printed.stdout)
    # (the file's and this environment's settings, as the command printed them)
    assert load_config(again, env={}) == load_config(EXAMPLES / "gateway.yaml")
    reprinted = modelyard("serve", "-c", str(again), "--print-config")
    assert reprinted.stdout == printed.stdout


GRAPH = '{"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceUrl": "http://127.0.0.1:1/"}]}}}'
GRPC_WHY = "address in use or not available"  # all grpc says


@pytest.mark.parametrize(
    ("command", "what", "why"),
    [
        (["serve", "-c", "{config}", "--workers", "1"], "gateway HTTP", "Address already in use"),
        (["serve", "-c", "{grpc_config}", "--workers", "1"], "gateway OIP gRPC", GRPC_WHY),
        (["scheduler", "--db", ":memory:", "--port", "{port}", "--agent-port", "0"], "scheduler REST",
         "Address already in use"),
        (["scheduler", "--db", ":memory:", "--port", "0", "--agent-port", "{port}"], "scheduler agent gRPC",
         GRPC_WHY),
        (["sim-worker", "--port", "{port}"], "sim-worker HTTP", "Address already in use"),
        (["sim-worker", "--port", "0", "--grpc-port", "{port}"], "sim-worker OIP gRPC", GRPC_WHY),
        (["graph", "serve", "--graph-json", GRAPH, "--host", "127.0.0.1", "--port", "{port}"], "graph router",
         "Address already in use"),
    ],
    ids=["gateway", "gateway-grpc", "scheduler", "scheduler-agents", "sim-worker", "sim-worker-grpc",
         "graph"],
)  # fmt: skip
def test_a_port_in_use_is_named_with_what_it_is_for(tmp_path, command, what, why):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = tmp_path / "gateway.yaml"
        config.write_text(f"listen: {{port: {port}}}\n")
        grpc_config = tmp_path / "grpc.yaml"
        grpc_config.write_text(f"listen: {{port: 0, grpc_port: {port}}}\n")
        values = {"{port}": str(port), "{config}": str(config), "{grpc_config}": str(grpc_config)}
        result = modelyard(*(values.get(part, part) for part in command))
    assert result.returncode == 1, result.stdout + result.stderr
    # (grpc logs its own line first, which is not ours to silence)
    assert (
        result.stderr.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port} ({what}): {why}"
    )


async def test_embedded_demo_serves_chat_and_oip():
    # with the access log on: its lines go to stdout, as with a config file
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "serve", "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "MODELYARD_LOGGING__ACCESS_LOG": "true"},
    )  # fmt: skip
    try:
        url = None
        for _ in range(50):
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "the demo did not print its URL"
        banner = ""
        while "Ctrl-C stops everything." not in banner:
            banner += (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        # --port 0: the demo's scheduler took free ports too, and the banner says where
        scheduler = re.search(r"placement: scheduler (http://\S+)", banner)
        assert scheduler and not scheduler.group(1).endswith(":9004"), banner
        assert f"MODELYARD_SCHEDULER={scheduler.group(1)} " in banner
        assert f"dashboard: {url}/dashboard" in banner
        chat = orjson.dumps({"model": "demo-llm", "messages": [{"role": "user", "content": "Hello!"}]})
        infer = orjson.dumps({"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            graph = orjson.dumps({"instances": [[1, 2]]})
            for path, body in (
                ("/v1/chat/completions", chat),
                ("/v2/models/demo-echo/infer", infer),
                ("/v1/graphs/demo-pipeline", graph),
                ("/v1/graphs/demo-route", graph),
            ):
                async with http.post(url + path, data=body) as response:
                    assert response.status == 200, path
            async with http.get(url + "/dashboard") as response:
                assert response.status == 200 and response.content_type == "text/html"
            async with http.get(scheduler.group(1) + "/v1/servers") as response:
                servers = (await response.json())["servers"]
            assert [len(s["replicas"]) for s in servers] == [2]
    finally:
        process.send_signal(signal.SIGTERM)
        rest, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    paths = {orjson.loads(line)["path"] for line in rest.decode().splitlines() if line.startswith("{")}
    assert {"/v1/chat/completions", "/v2/models/demo-echo/infer", "/v1/graphs/demo-pipeline"} <= paths
    assert b'"request_id"' not in errors
