"""`modelyard key create | list | revoke | usage` against a real gateway on a free port: a key made,
used, listed (never shown again), revoked and then refused; and each kind of bad input, one line and
exit 1. The gateway runs on this test's event loop, so each command runs in a thread (its own
event loop, as from a shell); one runs as a user runs it, `python -m modelyard` in a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from certificates import Pki
from modelyard.cli.main import app
from support import free_ports, model_config, wait_until

ADMIN = "admin-token-0123456789"
KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"
CHAT = "/v1/chat/completions"
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
TIMEOUT = 60.0  # the longest one command may take
# Variables a developer's shell may hold that would change what the commands do: unset for each.
CLEAN = {
    name: None
    for name in (
        "MODELYARD_GATEWAY",
        "MODELYARD_ADMIN_TOKEN",
        "MODELYARD_ADMIN_TOKEN_FILE",
        "MODELYARD_GATEWAY_CA",
    )
}


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {"name": "a", "models": ["chat"], "limits": {"requests_per_minute": 100, "budget": 5.0}},
                    {"name": "b", "models": ["*"], "priority": 3},
                ],
                "keys": [
                    {"name": "a-app", "tenant": "a", "key": KEY_A},
                    {"name": "b-app", "tenant": "b", "key": KEY_B, "limits": {"max_concurrent_requests": 2}},
                ],
            }
        )
    )
    return path


async def start(sim_workers: Any, gateways: Any, tmp_path: Path, **config: Any) -> Any:
    workers = await sim_workers(1)
    return await gateways(
        [
            model_config(
                "chat", workers, endpoints=[{"name": "w0", "url": workers[0].url, "cost_per_1k_tokens": 2.0}]
            )
        ],
        auth={
            "enabled": True,
            "keys_file": str(keys_file(tmp_path)),
            "runtime_keys_file": str(tmp_path / "runtime-keys.json"),
        },
        admin={"token": ADMIN},
        **config,
    )


async def key(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """`modelyard key ARGS` in a thread; no admin token unless `env` or ARGS give one."""
    environment: dict[str, str | None] = {**CLEAN, "COLUMNS": "200", **(env or {})}
    runner = CliRunner()
    result = await asyncio.wait_for(
        asyncio.to_thread(runner.invoke, app, ["key", *args], env=environment), TIMEOUT
    )
    assert ADMIN not in result.stdout + result.stderr  # the admin token is never printed
    return result


def one_error(result: Result) -> str:
    """The one `error:` line of a command that failed (exit 1), without its prefix."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert result.stdout == ""
    return lines[0].removeprefix("error: ")


async def status_with(http: aiohttp.ClientSession, url: str, api_key: str) -> int:
    async with http.post(url + CHAT, json=BODY, headers={"Authorization": f"Bearer {api_key}"}) as response:
        await response.read()
        return response.status


async def test_a_key_made_is_used_listed_without_the_key_and_revoked(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, tmp_path)
    env = {"MODELYARD_GATEWAY": gateway.url, "MODELYARD_ADMIN_TOKEN": ADMIN}

    # As a user runs it: the key alone on stdout (KEY=$(modelyard key create ...)), a note on stderr.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "key", "create", "--tenant", "a", "--name", "a-ci",
        "--model", "chat", "--requests-per-minute", "5", "--budget", "0.5",
        env={**os.environ, **env, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT)
    assert process.returncode == 0, stderr.decode()
    made = stdout.decode().splitlines()
    assert len(made) == 1 and made[0].startswith("sk-my-"), made
    made_key = made[0]
    assert "key a-ci of tenant a created" in stderr.decode() and made_key not in stderr.decode()
    assert ADMIN not in stdout.decode() + stderr.decode()

    async with http.post(gateway.url + CHAT, json=BODY, headers={"Authorization": f"Bearer {made_key}"}) as r:
        assert r.status == 200 and r.headers["x-ratelimit-limit-requests"] == "5"

    listed = await key("list", env=env)
    assert listed.exit_code == 0, listed.stderr
    assert made_key not in listed.stdout
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert list(rows) == ["a-app", "a-ci", "b-app"], listed.stdout
    assert listed.stdout.splitlines()[0].split() == [
        "NAME", "TENANT", "SOURCE", "MODELS", "PRIORITY", "LIMITS", "CREATED"
    ]  # fmt: skip
    assert rows["a-ci"].split()[:5] == ["a-ci", "a", "runtime", "chat", "tenant's"]
    assert "5 req/min, $0.5/day" in rows["a-ci"] and rows["a-ci"].rstrip().endswith("Z")
    assert rows["a-app"].split()[:3] == ["a-app", "a", "file"] and rows["a-app"].rstrip().endswith("\u2013")
    assert "2 concurrent" in rows["b-app"] and rows["b-app"].split()[4] == "3"  # b's priority
    # -o json: the API's answer, with the tenants' own limits
    answer = orjson.loads((await key("list", "-o", "json", env=env)).stdout)
    assert made_key not in orjson.dumps(answer).decode()
    tenants = {t["name"]: t for t in answer["tenants"]}
    assert tenants["a"]["limits"] == {"requests_per_minute": 100, "budget": 5.0, "budget_period": "day"}
    assert tenants["b"] == {"name": "b", "models": None, "priority": 3, "limits": {}}

    # usage, once the request is counted (settled in the background)
    async def counted() -> bool:
        async with http.get(gateway.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            return any(t["tenant"] == "a" and t["requests"] == 1 for t in (await r.json())["tenants"])

    await wait_until(counted, attempts=100, interval=0.02)
    shown = await key("usage", env=env)
    assert shown.exit_code == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["TENANT", "KEY", "REQUESTS", "TOKENS", "ERRORS", "REFUSED", "COST"]
    assert lines[1].split()[:3] == ["a", "(all)", "1"] and lines[2].split()[:2] == ["a-ci", "1"]
    assert "this worker" in shown.stdout  # the caption: the day and the scope
    day = orjson.loads((await key("usage", "-o", "json", env=env)).stdout)["day"]
    assert (await key("usage", "--day", day, "-o", "json", env=env)).exit_code == 0
    empty = await key("usage", "--day", "2001-01-01", env=env)
    assert empty.stdout.strip() == "no usage on 2001-01-01 (this worker)"

    revoked = await key("revoke", "a-ci", env=env)
    assert (revoked.exit_code, revoked.stdout) == (0, "a-ci: revoked\n")
    assert await status_with(http, gateway.url, made_key) == 401
    assert one_error(await key("revoke", "a-ci", env=env)) == "no runtime key named 'a-ci'"
    assert "is in the keys file" in one_error(await key("revoke", "a-app", env=env))
    assert await status_with(http, gateway.url, KEY_A) == 200  # the file's key still works

    # -o json prints the whole answer, the key in it
    made_json = orjson.loads(
        (await key("create", "--tenant", "b", "--name", "b-ci", "-o", "json", env=env)).stdout
    )
    assert made_json["key"].startswith("sk-my-") and made_json["source"] == "runtime"
    assert await status_with(http, gateway.url, made_json["key"]) == 200
    revoked_json = await key("revoke", "b-ci", "-o", "json", env=env)
    assert orjson.loads(revoked_json.stdout) == {"revoked": "b-ci"}


async def test_bad_input_is_one_line_and_exit_1(sim_workers, gateways, tmp_path):
    gateway = await start(sim_workers, gateways, tmp_path)
    url = ["--gateway", gateway.url]
    (nobody,) = free_ports(1)  # nothing listens there

    unreachable = one_error(await key("list", "--gateway", f"127.0.0.1:{nobody}", "--admin-token", ADMIN))
    assert unreachable == f"cannot reach the gateway at http://127.0.0.1:{nobody}: connection refused"
    wrong = await key("list", *url, "--admin-token", "not-the-token")
    assert "not-the-token" not in wrong.stdout + wrong.stderr
    assert one_error(wrong) == (
        "admin calls need the header 'Authorization: Bearer <admin.token>' "
        "(give the admin token: --admin-token, MODELYARD_ADMIN_TOKEN or --admin-token-file)"
    )
    assert one_error(await key("usage", *url)).startswith("admin calls need the header")  # none given

    with_token = [*url, "--admin-token", ADMIN]
    unknown = one_error(await key("create", "--tenant", "nobody", "--name", "x", *with_token))
    assert unknown == "key.tenant: expected one of the tenants (a, b), got 'nobody'"
    beyond = one_error(await key("create", "--tenant", "a", "--name", "x", "--model", "other", *with_token))
    assert "key.models" in beyond
    zero = one_error(
        await key("create", "--tenant", "a", "--name", "x", "--requests-per-minute", "0", *with_token)
    )
    assert "key.limits.requests_per_minute: expected a whole number over 0, got 0" in zero
    taken = one_error(await key("create", "--tenant", "a", "--name", "a-app", *with_token))
    assert "the keys file has a key named 'a-app'" in taken
    assert one_error(
        await key("create", "--tenant", "a", "--name", "x", "--budget-period", "week", *with_token)
    ) == ("--budget-period needs --budget")
    assert one_error(await key("usage", "--day", "yesterday", *with_token)) == (
        "day: expected YYYY-MM-DD, got 'yesterday'"
    )
    assert one_error(await key("list", "--gateway", "no port", "--admin-token", ADMIN)) == (
        "command line: --gateway: expected host:port or http(s)://host:port for the gateway (got 'no port')"
    )
    from_env = await key("list", env={"MODELYARD_GATEWAY": "ftp://x:1"})
    assert one_error(from_env).startswith("environment: MODELYARD_GATEWAY: expected host:port")

    # the token from a file, or the variables; two flags are a mistake, a flag beats a variable
    token_file = tmp_path / "admin-token"
    token_file.write_text(f"# the gateway's admin.token\n{ADMIN}\n")
    assert (await key("list", *url, "--admin-token-file", str(token_file))).exit_code == 0
    assert (await key("list", *url, env={"MODELYARD_ADMIN_TOKEN_FILE": str(token_file)})).exit_code == 0
    both = await key("list", *url, "--admin-token", ADMIN, "--admin-token-file", str(token_file))
    assert one_error(both) == "--admin-token and --admin-token-file: give one of them"
    flag_wins = await key(
        "list", *url, "--admin-token", ADMIN, env={"MODELYARD_ADMIN_TOKEN_FILE": "/nonexistent"}
    )
    assert flag_wins.exit_code == 0, flag_wins.stderr
    missing = one_error(await key("list", *url, "--admin-token-file", str(tmp_path / "missing")))
    assert missing.startswith(f"{tmp_path / 'missing'}: cannot read the token file")
    # never over plain http to another host: refused before anything is sent
    plain = one_error(await key("list", "--gateway", "http://192.0.2.1:8000", "--admin-token", ADMIN))
    assert "over plain http to 192.0.2.1" in plain and "use https" in plain
    # the help does not show a token taken from the environment
    shown = await key("list", "--help", env={"MODELYARD_ADMIN_TOKEN": ADMIN})
    assert "MODELYARD_ADMIN_TOKEN" in shown.stdout


async def test_a_gateway_without_runtime_keys_or_without_auth_says_so(sim_workers, gateways, tmp_path):
    workers = await sim_workers(1)
    keyed = await gateways(
        [model_config("chat", workers)], auth={"enabled": True, "keys_file": str(keys_file(tmp_path))}
    )
    listed = await key("list", "--gateway", keyed.url)  # no admin.token: none needed
    assert listed.exit_code == 0 and [line.split()[0] for line in listed.stdout.splitlines()[1:]] == [
        "a-app",
        "b-app",
    ]
    refused = one_error(await key("create", "--tenant", "a", "--name", "x", "--gateway", keyed.url))
    assert "runtime_keys_file" in refused
    open_gateway = await gateways([model_config("chat", workers)])
    assert one_error(await key("usage", "--gateway", open_gateway.url)) == (
        "API keys are off: set auth.enabled (with auth.keys_file)"
    )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def test_an_https_gateway_is_verified_with_the_ca_file(sim_workers, gateways, tmp_path, pki):
    server = pki.issue()
    listen = {
        "host": "127.0.0.1",
        "port": 0,
        "tls": {"cert_file": str(server.cert), "key_file": str(server.key)},
    }
    gateway = await start(sim_workers, gateways, tmp_path, listen=listen)
    assert gateway.url.startswith("https://")
    where = ["--gateway", gateway.url, "--admin-token", ADMIN]
    listed = await key("list", *where, "--ca-file", str(pki.ca_file))
    assert listed.exit_code == 0, listed.stderr
    other = Pki(tmp_path, "other")
    untrusted = one_error(await key("list", *where, "--ca-file", str(other.ca_file)))
    assert untrusted.startswith(f"cannot reach the gateway at {gateway.url}: TLS: the gateway's certificate")
    from_env = await key("list", *where, env={"MODELYARD_GATEWAY_CA": str(pki.ca_file)})
    assert from_env.exit_code == 0, from_env.stderr
