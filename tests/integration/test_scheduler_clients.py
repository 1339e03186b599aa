"""The scheduler's clients with credentials (issue 28 item 3): `modelyard model ...` and `modelyard
server list` send a token from a flag, a variable or a file and verify an https scheduler; the
gateway's feed sends its token file's token and verifies TLS. A real scheduler over real TLS."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_scheduler_security import READ_TOKEN, WRITE_TOKEN, files, pki, scheduler, tls
from typer.testing import CliRunner

from certificates import Pki
from modelyard.cli.main import app
from modelyard.errors import ConfigError
from modelyard.gateway import GATEWAY
from modelyard.scheduler import SchedulerConfig, start_scheduler
from modelyard.upstream.feed import FeedClient

__all__ = ["files", "pki", "scheduler"]  # fixtures shared with the attacks' tests


@contextlib.contextmanager
def threaded_scheduler(**settings: Any) -> Any:
    """A real scheduler on its own loop in a thread, for commands that run their own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="scheduler", daemon=True)
    thread.start()
    config = SchedulerConfig(port=0, agent_port=0, db=":memory:", retry_interval=60, **settings)
    try:
        running = asyncio.run_coroutine_threadsafe(start_scheduler(config), loop).result(timeout=10)
        try:
            yield running
        finally:
            asyncio.run_coroutine_threadsafe(running.stop(), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_model_and_server_commands_send_the_token_and_verify_tls(
    pki: Pki, files: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("MODELYARD_SCHEDULER", "MODELYARD_SCHEDULER_TOKEN", "MODELYARD_SCHEDULER_TOKEN_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("MODELYARD_SCHEDULER_CA", raising=False)
    manifest = tmp_path / "iris.yaml"
    manifest.write_text("name: iris\nstorage_uri: file:///models/iris\nmemory: 100\n")
    token_file = tmp_path / "token"
    token_file.write_text(f"{WRITE_TOKEN}\n")
    runner = CliRunner()
    with threaded_scheduler(tls=tls(pki.issue()), tokens_file=files["tokens"]) as sched:
        where = ["--scheduler", sched.url, "--ca-file", str(pki.ca_file)]

        def run(*args: str, env: dict[str, str] | None = None) -> Any:
            result = runner.invoke(app, [*args, *where], env=env)
            assert READ_TOKEN not in result.output + result.stderr
            assert WRITE_TOKEN not in result.output + result.stderr
            return result

        # No token: refused, and the line says how to give one.
        result = run("model", "apply", "-f", str(manifest))
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            "error: the scheduler's API needs a bearer token (Authorization: Bearer <token>); the request "
            "has no credential (give a token: --token, MODELYARD_SCHEDULER_TOKEN or --token-file)"
        ]
        result = run("model", "apply", "-f", str(manifest), "--token", READ_TOKEN)
        assert result.exit_code == 1 and "needs the role write" in result.stderr
        result = run("model", "apply", "-f", str(manifest), "--token-file", str(token_file))
        assert result.exit_code == 0, result.stderr
        assert result.output == "iris: created (version 1)\n"
        result = run("model", "list", "-o", "json", env={"MODELYARD_SCHEDULER_TOKEN": READ_TOKEN})
        assert result.exit_code == 0 and [m["name"] for m in orjson.loads(result.output)["models"]] == [
            "iris"
        ]
        result = run("server", "list", env={"MODELYARD_SCHEDULER_TOKEN_FILE": str(token_file)})
        assert result.exit_code == 0, result.stderr
        # A flag wins over a variable; two flags are one line.
        result = run(
            "model", "status", "iris", "--token", READ_TOKEN, env={"MODELYARD_SCHEDULER_TOKEN_FILE": "x"}
        )
        assert result.exit_code == 0, result.stderr
        result = run("model", "delete", "iris", "--token", READ_TOKEN, "--token-file", str(token_file))
        assert (
            result.exit_code == 1 and result.stderr == "error: --token and --token-file: give one of them\n"
        )
        result = run("model", "list", "--token-file", str(tmp_path / "missing"))
        assert result.exit_code == 1 and result.stderr.startswith(
            f"error: {tmp_path / 'missing'}: cannot read"
        )
        # The help never shows a token taken from the environment.
        help_text = runner.invoke(
            app, ["model", "list", "--help"], env={"MODELYARD_SCHEDULER_TOKEN": WRITE_TOKEN}
        )
        assert "MODELYARD_SCHEDULER_TOKEN" in help_text.output and WRITE_TOKEN not in help_text.output

        # A scheduler whose certificate the client does not trust: one line, no token sent.
        result = runner.invoke(
            app,
            [
                "model",
                "list",
                "--scheduler",
                sched.url,
                "--token",
                READ_TOKEN,
                "--ca-file",
                str(Pki(tmp_path, "x").ca_file),
            ],
        )
        assert result.exit_code == 1 and "certificate did not verify" in result.stderr
        assert len(result.stderr.splitlines()) == 1
        result = run("model", "delete", "iris", env={"MODELYARD_SCHEDULER_TOKEN": WRITE_TOKEN})
        assert result.exit_code == 0, result.stderr


async def test_the_gateways_feed_needs_the_token_and_verifies_tls(
    scheduler: Any, pki: Pki, files: dict[str, str], tmp_path: Path, gateways: Any
) -> None:
    sched = await scheduler(tls=tls(pki.issue()), tokens_file=files["tokens"])
    token_file = tmp_path / "feed-token"
    token_file.write_text(f"{READ_TOKEN}\n")
    placement = {
        "scheduler": sched.url,
        "tls": {"ca_file": str(pki.ca_file)},
        "startup_wait": 5.0,
        "reconnect_base_interval": 0.05,
        "reconnect_max_interval": 0.1,
    }
    followed = await gateways([], placement={**placement, "token_file": str(token_file)})
    follower = followed.app[GATEWAY].follower
    assert follower is not None and follower.synced and follower.connected

    refused_gateway = await gateways([], placement={**placement, "startup_wait": 0.5})
    follower = refused_gateway.app[GATEWAY].follower
    assert follower is not None and not follower.synced
    assert "answered 401" in follower.last_error and "bearer token" in follower.last_error

    untrusted = await gateways(
        [],
        placement={
            **placement,
            "token_file": str(token_file),
            "tls": {"ca_file": str(Pki(tmp_path, "x").ca_file)},
            "startup_wait": 0.5,
        },
    )
    follower = untrusted.app[GATEWAY].follower
    assert follower is not None and not follower.synced and "did not verify" in follower.last_error
    assert READ_TOKEN not in follower.last_error

    with pytest.raises(ConfigError, match="cannot read the token file"):
        await gateways([], placement={**placement, "token_file": str(tmp_path / "missing")})


def test_no_command_sends_a_token_over_plain_http_to_another_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token sent over plain http to another machine can be read on the way: refused in one line,
    before anything is sent (nothing listens at 192.0.2.1, a documentation address)."""
    for variable in ("MODELYARD_SCHEDULER", "MODELYARD_SCHEDULER_TOKEN", "MODELYARD_SCHEDULER_TOKEN_FILE"):
        monkeypatch.delenv(variable, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(f"{WRITE_TOKEN}\n")
    runner = CliRunner()
    for scheduler_address in ("192.0.2.1:9004", "http://scheduler.example:9004"):
        for credential in (["--token", WRITE_TOKEN], ["--token-file", str(token_file)]):
            result = runner.invoke(app, ["model", "list", "--scheduler", scheduler_address, *credential])
            assert result.exit_code == 1, result.output
            (line,) = result.stderr.splitlines()
            assert "plain http" in line and "https" in line and WRITE_TOKEN not in line, line
    # Loopback stays plain (the demo, a port-forward); without a token nothing is refused here.
    with threaded_scheduler() as sched:
        loopback = sched.url.replace("127.0.0.1", "localhost")
        for address in (sched.url, loopback):
            result = runner.invoke(app, ["model", "list", "--scheduler", address, "--token", WRITE_TOKEN])
            assert result.exit_code == 0, result.stderr


def test_the_feed_client_sends_no_token_over_plain_http_to_another_host(tmp_path: Path) -> None:
    token_file = tmp_path / "feed-token"
    token_file.write_text(f"{READ_TOKEN}\n")
    timeouts = {"connect_timeout": 1.0, "ping_timeout": 1.0}
    with pytest.raises(ConfigError, match="plain http") as caught:
        FeedClient("http://modelyard-scheduler:9004", token_file=str(token_file), **timeouts)
    assert READ_TOKEN not in str(caught.value)
    FeedClient(
        "http://modelyard-scheduler:9004", token_file=str(token_file), allow_plain_token=True, **timeouts
    )
    FeedClient("https://modelyard-scheduler:9004", token_file=str(token_file), **timeouts)
    FeedClient("http://127.0.0.1:9004", token_file=str(token_file), **timeouts)
    FeedClient("http://[::1]:9004", token_file=str(token_file), **timeouts)
    FeedClient("http://modelyard-scheduler:9004", **timeouts)  # no token: nothing to read on the way
