"""The image's entrypoint: `modelyard ARGS`, or the graph router when started as KServe starts its
router image (flags only, --graph-json among them)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).parents[3] / "deploy" / "image" / "entrypoint.sh"


@pytest.fixture
def run(tmp_path):
    fake = tmp_path / "modelyard"  # stands in for the installed command: prints what it was given
    fake.write_text('#!/bin/sh\nprintf "%s|" "$@"\n')
    fake.chmod(0o755)

    def entrypoint(*args: str) -> str:
        env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
        result = subprocess.run(
            ["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, check=True
        )
        return result.stdout

    return entrypoint


def test_kserves_router_flags_run_the_graph_router(run):
    assert run("--graph-json", "{}") == "graph|serve|--graph-json|{}|"
    # newer KServe passes the graph's name too, before or after
    assert (
        run("--inferencegraph-name", "g", "--graph-json={}")
        == "graph|serve|--inferencegraph-name|g|--graph-json={}|"
    )


def test_anything_else_is_a_modelyard_command(run):
    assert (
        run("serve", "--config", "/etc/modelyard/gateway.yaml")
        == "serve|--config|/etc/modelyard/gateway.yaml|"
    )
    assert run("graph", "serve", "--graph-json", "{}") == "graph|serve|--graph-json|{}|"
    assert run("--help") == "--help|"
