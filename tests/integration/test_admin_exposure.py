"""A gateway that other machines can reach does not start with its admin API open (issue 28): its
routes, strategies and graphs would be anyone's to change. Loopback needs no token, as before."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import free_ports

OPEN = "is reachable from other machines and admin.token is not set"


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "MODELYARD_ADMIN__TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", *args],
        capture_output=True, text=True, timeout=60, env={**environment, "COLUMNS": "200", **(env or {})},
    )  # fmt: skip


def config(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"listen: {{host: '{host}', port: 0}}\nmodels: []\n")
    return path


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_every_address_without_a_token_is_refused_in_one_line(tmp_path, host):
    refused = serve("-c", str(config(tmp_path, host)), "--workers", "1")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'gateway.yaml'}: listen.host: ") and OPEN in line


def test_the_demo_on_every_address_is_refused_too():
    (port,) = free_ports(1)
    refused = serve("--host", "0.0.0.0", "--port", str(port))
    assert refused.returncode == 1
    assert OPEN in refused.stderr and refused.stderr.startswith(
        "error: the embedded demo: listen.host: 0.0.0.0"
    )


async def test_with_a_token_it_serves(tmp_path):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "serve", "-c", str(config(tmp_path, "0.0.0.0")), "--workers", "1",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "MODELYARD_ADMIN__TOKEN": "a-token-of-sixteen-chars"},
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        assert b"modelyard gateway listening on http://0.0.0.0:" in line, line
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), 60)


def test_print_config_serves_nothing_and_is_not_refused(tmp_path):
    printed = serve("-c", str(config(tmp_path, "0.0.0.0")), "--print-config")
    assert printed.returncode == 0 and "host: 0.0.0.0" in printed.stdout


@pytest.mark.parametrize(
    ("token", "says"),
    [
        ("", "error: environment: MODELYARD_ADMIN__TOKEN: String should have at least 1 character"),
        ("short-token", "admin.token: at least 16 characters on an address others reach"),
    ],
)
def test_an_empty_or_short_token_does_not_open_an_address_others_reach(tmp_path, token, says):
    """An empty bearer matched an empty token: the admin API was anyone's, exposure check passed."""
    refused = serve(
        "-c", str(config(tmp_path, "0.0.0.0")), "--workers", "1", env={"MODELYARD_ADMIN__TOKEN": token}
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert says in refused.stderr
