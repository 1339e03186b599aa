"""`GET /openapi.json` documents every route, and live gateways answer as it says.

The fuzzing is schemathesis' own command line, as a user would run it (`schemathesis run
URL/openapi.json`), started in a subprocess against gateways started here over sim workers:
deterministic generation, a bounded number of cases per operation, a time limit as a backstop.
Checks: the gateway answers no 5xx of its own (openapi_checks.py), and every answer's status,
content type, headers and body are as documented (schemathesis' conformance checks), 405s
included. Admin updates are fuzzed on a gateway of their own: routes or strategies the fuzzer
installs would otherwise change what the other operations answer.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import jsonschema_rs  # comes with schemathesis
import pytest
import schemathesis

from support import free_ports, metric_value, model_config

HERE = Path(__file__).parent
TOKEN = "fuzz-admin-token"
CHAT, ECHO = "chat", "echo"
GRAPHS = {
    # a Sequence feeding an Ensemble, and a Switch at the root (no match there: KServe's 404)
    "pipeline": {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    {"name": "first", "serviceName": ECHO},
                    {"name": "both", "nodeName": "both", "data": "$response"},
                ],
            },
            "both": {
                "routerType": "Ensemble",
                "steps": [{"name": "a", "serviceName": ECHO}, {"name": "b", "serviceName": ECHO}],
            },
        }
    },
    "switch": {
        "nodes": {
            "root": {"routerType": "Switch", "steps": [{"condition": "instances", "serviceName": ECHO}]}
        }
    },
}
CONFORMANCE = [
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
]
FUZZ_TIMEOUT = 300  # seconds for one schemathesis run, whatever happens
# A stream that lasts until the gateway stops has no answer to check; test_admin_log.py tests it.
ENDLESS = "/admin/log/stream"


async def start_gateway(sim_workers: Any, gateways: Any, **config: Any) -> Any:
    """Two sim workers serving the OpenAI model, one the OIP model (doubling), and the graphs."""
    chat = await sim_workers(2, models=[CHAT])
    echo = await sim_workers(1, models=[ECHO], oip_scale=2.0)
    models = [model_config(CHAT, chat), model_config(ECHO, echo)]
    return await gateways(models, graphs=GRAPHS, admin={"token": TOKEN}, **config)


@pytest.fixture
async def gateway(sim_workers, gateways):
    return await start_gateway(sim_workers, gateways)


async def fetch_document(http, url: str) -> dict[str, Any]:
    async with http.get(url + "/openapi.json") as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        return await response.json()


def documented_operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }


def schemas_in(value: Any) -> list[Any]:
    """Every JSON schema of an OpenAPI document: components' and each `schema` keyword's."""
    if isinstance(value, list):
        return [s for item in value for s in schemas_in(item)]
    if not isinstance(value, dict):
        return []
    found = [value["schema"]] if isinstance(value.get("schema"), dict) else []
    found += list(value.get("components", {}).get("schemas", {}).values())
    return found + [s for key, item in value.items() if key != "schema" for s in schemas_in(item)]


# --- the document -----------------------------------------------------------------------------


async def test_document_is_valid_openapi_3_1(gateway, http):
    document = await fetch_document(http, gateway.url)
    assert document["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(document).validate()  # the OpenAPI 3.1 meta-schema
    schemas = schemas_in(document)
    assert len(schemas) > 50
    for schema in schemas:
        jsonschema_rs.meta.validate(schema)  # JSON Schema 2020-12, OpenAPI 3.1's dialect


async def test_document_lists_every_route_the_gateway_serves(gateway, http):
    served = {(route.method, route.resource.canonical) for route in gateway.app.router.routes()}
    assert documented_operations(await fetch_document(http, gateway.url)) == served


async def test_document_names_the_gateways_models_and_current_graphs(gateway, http):
    document = await fetch_document(http, gateway.url)
    schemas = document["components"]["schemas"]
    assert schemas["ModelName"]["enum"] == [CHAT, ECHO]
    assert schemas["GraphName"]["enum"] == ["pipeline", "switch"]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    spec = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": ECHO}]}}}
    async with http.put(gateway.url + "/admin/graphs/added", json=spec, headers=headers) as response:
        assert response.status == 200
    async with http.delete(gateway.url + "/admin/graphs/switch", headers=headers) as response:
        assert response.status == 200
    document = await fetch_document(http, gateway.url)
    assert document["components"]["schemas"]["GraphName"]["enum"] == ["added", "pipeline"]


async def test_admin_calls_need_the_token_only_when_one_is_set(sim_workers, gateways, http):
    secured = await start_gateway(sim_workers, gateways)
    (worker,) = await sim_workers(1)
    open_gateway = await gateways([model_config(CHAT, [worker])])
    for running, token in ((secured, True), (open_gateway, False)):
        document = await fetch_document(http, running.url)
        routes = document["paths"]["/admin/models/{model}/routes"]["put"]
        assert ("security" in routes, "401" in routes["responses"]) == (token, token)
        assert ("securitySchemes" in document["components"]) == token
        chat = document["paths"]["/v1/chat/completions"]["post"]
        assert "security" not in chat and "401" not in chat["responses"]


# --- fuzzing ------------------------------------------------------------------------------------


async def schemathesis_run(url: str, workdir: Path, *options: str) -> tuple[int, str, dict[str, str]]:
    """`schemathesis run` against `url`; returns its exit code, its output, and each operation it
    tested with its outcome ("passed", or the failure, error or skip message)."""
    junit = workdir / "junit.xml"
    command = [
        *("run", f"{url}/openapi.json", "--no-color", "--workers", "1"),
        *("--generation-deterministic", "--no-shrink"),
        *("--header", f"Authorization: Bearer {TOKEN}", "--request-timeout", "30"),
        *("--exclude-path", ENDLESS),
        *("--report", "junit", "--report-junit-path", str(junit)),
        *options,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "SCHEMATHESIS_HOOKS": "openapi_checks",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "schemathesis.cli", *command),
        cwd=workdir,  # its example database and cassettes stay out of the repository
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), FUZZ_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    outcomes: dict[str, str] = {}
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            problem = next(iter(case), None)
            outcomes[case.attrib["name"]] = "passed" if problem is None else problem.attrib.get("message", "")
    return process.returncode or 0, output.decode(errors="replace"), outcomes


def readme_command() -> list[str]:
    """The schemathesis command the README shows, as its arguments after `schemathesis`."""
    readme = (HERE.parents[1] / "README.md").read_text()
    found = re.search(r"^\.venv/bin/schemathesis (run .*?)\n```", readme, re.MULTILINE | re.DOTALL)
    assert found, "the README shows no schemathesis command"
    return shlex.split(found.group(1).replace("\\\n", " "))


def expected(document: dict[str, Any], *, admin_updates: bool) -> set[str]:
    """The operations a run tests (schemathesis leaves out the document's own path; the runs
    leave out the endless stream)."""
    return {
        f"{method} {path}"
        for method, path in documented_operations(document)
        if path not in ("/openapi.json", ENDLESS) and (method in ("PUT", "DELETE")) == admin_updates
    }


async def test_fuzz_inference_graphs_and_reads(gateway, http, tmp_path):
    document = await fetch_document(http, gateway.url)
    code, output, outcomes = await schemathesis_run(
        gateway.url,
        tmp_path,
        *("--checks", ",".join(["no_gateway_5xx", *CONFORMANCE])),
        *("--phases", "examples,coverage,fuzzing", "--max-examples", "100"),
        *("--exclude-method", "PUT", "--exclude-method", "DELETE"),
    )
    assert code == 0, output
    assert outcomes == dict.fromkeys(expected(document, admin_updates=False), "passed"), output
    # The enums took the fuzzer past the 404 for unknown names: into the proxy, both models, and graphs.
    for model in (CHAT, ECHO):
        assert await metric_value(http, gateway.url, "modelyard_requests_total", model=model, code="200") > 0
    assert await metric_value(
        http, gateway.url, "modelyard_graph_step_duration_seconds_count", graph="pipeline"
    )


async def test_the_readme_command_passes_as_written(gateway, tmp_path):
    """The README's command, pointed at this gateway, which has an admin token (the README says to
    add its header then); schemathesis' own checks only, as a user runs it."""
    command = readme_command()
    assert command[:2] == ["run", "http://127.0.0.1:8000/openapi.json"], command
    command[1] = f"{gateway.url}/openapi.json"
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "schemathesis.cli", *command),
        *("--no-color", "-H", f"Authorization: Bearer {TOKEN}"),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), FUZZ_TIMEOUT)
    assert process.returncode == 0, output.decode(errors="replace")[-4000:]


async def test_fuzz_admin_updates(gateway, http, tmp_path):
    document = await fetch_document(http, gateway.url)
    code, output, outcomes = await schemathesis_run(
        gateway.url,
        tmp_path,
        *("--checks", ",".join(["no_gateway_5xx", *CONFORMANCE])),
        *("--phases", "examples,coverage,fuzzing,stateful", "--max-examples", "60"),
        *("--include-method", "PUT", "--include-method", "DELETE"),
    )
    assert code == 0, output
    assert outcomes.pop("Stateful tests") == "passed", output  # e.g. PUT a graph, then DELETE it
    assert outcomes == dict.fromkeys(expected(document, admin_updates=True), "passed"), output


async def test_fuzz_a_gateway_whose_servers_are_down(gateways, http, tmp_path):
    """The gateway's own failure answers (502 refused, 503 no healthy endpoint, a graph's 500) as
    documented: here 5xx are expected, so only the conformance checks run."""
    endpoints = [{"url": f"http://127.0.0.1:{port}"} for port in free_ports(2)]  # nothing listens
    models = [  # without health checks the gateway learns only when connecting (502); with, it knows (503)
        {"name": CHAT, "endpoints": endpoints, "health_check": {"interval": 0}},
        {"name": ECHO, "endpoints": endpoints},
    ]
    down = await gateways(models, graphs=GRAPHS, admin={"token": TOKEN})
    document = await fetch_document(http, down.url)
    code, output, outcomes = await schemathesis_run(
        down.url,
        tmp_path,
        *("--checks", ",".join(CONFORMANCE)),
        *("--phases", "examples,fuzzing", "--max-examples", "10"),
        *("--exclude-method", "PUT", "--exclude-method", "DELETE"),
    )
    assert code == 0, output
    assert outcomes == dict.fromkeys(expected(document, admin_updates=False), "passed"), output
    for model, status in ((CHAT, "502"), (ECHO, "503")):
        assert await metric_value(http, down.url, "modelyard_requests_total", model=model, code=status) > 0


# --- found by fuzzing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("destinations", [5, True])
async def test_routes_whose_destinations_are_not_a_list_are_400(gateway, http, destinations):
    body = {"routes": [{"name": "r", "destinations": destinations}]}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with http.put(gateway.url + "/admin/models/chat/routes", json=body, headers=headers) as response:
        assert response.status == 400
        assert "routes[0].destinations" in (await response.json())["error"]["message"]
