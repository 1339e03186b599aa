"""The Dockerfile builds an image that runs every role as the manifests run it (issue 12 item 1).

Built with podman from Debian's packages (`make test` installs podman, runc and debootstrap when
it can, as it does chromium). This machine reaches no image registry, so the base image is a
Debian made here by debootstrap with Python 3.11 (the Dockerfile's BASE_IMAGE argument; its
default is python:3.11-slim). The base is built once and kept in podman's storage.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from modelyard import __version__
from modelyard.kube.render import dump, render
from modelyard.kube.values import DeployValues
from support import free_ports, wait_answering

ROOT = Path(__file__).parents[2]
BASE = "localhost/modelyard-test-base:bookworm"
IMAGE = "localhost/modelyard:test"
TOOLS = ("podman", "runc", "debootstrap")
# The host's CA bundle goes into the base: where a proxy re-signs TLS, pip inside the build needs it.
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in TOOLS) or os.geteuid() != 0,
    reason="needs root with podman, runc and debootstrap (make test installs them with apt-get)",
)


@pytest.fixture(scope="module")
def podman() -> Iterator[list[str]]:
    """The podman command line. This sandbox lets no process raise its rlimits and has hybrid
    cgroups: no default ulimits, runc and cgroupfs work where the defaults do not."""
    with tempfile.TemporaryDirectory() as folder:
        conf = Path(folder) / "containers.conf"
        conf.write_text("[containers]\ndefault_ulimits = []\n")
        os.environ["CONTAINERS_CONF"] = str(conf)
        try:
            yield ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
        finally:
            del os.environ["CONTAINERS_CONF"]


def run(args: list[str], timeout: float = 600, stdin: Any = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, stdin=stdin)


@pytest.fixture(scope="module")
def image(podman: list[str]) -> str:
    if run([*podman, "image", "exists", BASE]).returncode != 0:
        with tempfile.TemporaryDirectory() as folder:
            rootfs = Path(folder) / "rootfs"
            made = run(
                ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                 "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                timeout=900,
            )  # fmt: skip
            assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
            if CA_BUNDLE.exists():
                shutil.copy(CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
                (rootfs / "etc/pip.conf").write_text(f"[global]\ncert = {CA_BUNDLE}\n")
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            imported = run([*podman, "import", "-", BASE], stdin=tar.stdout)
            tar.wait()
            assert imported.returncode == 0, imported.stderr
    built = run(
        [*podman, "build", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE}", "-t", IMAGE, str(ROOT)],
        timeout=900,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGE


def test_the_image_runs_as_a_numeric_non_root_user_on_a_read_only_root(podman, image):
    user = run([*podman, "image", "inspect", image, "--format", "{{.Config.User}}"])
    assert user.stdout.strip() == "10001:10001"  # numeric: Kubernetes' runAsNonRoot can check it
    version = run([*podman, "run", "--rm", "--read-only", "--read-only-tmpfs=false", image, "version"])
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == __version__


def test_the_image_renders_the_same_manifests(podman, image):
    """The manifests are package data: an installed modelyard (the image's) has them."""
    rendered = run(
        [*podman, "run", "--rm", "--read-only", "--read-only-tmpfs=false", image, "deploy", "render"]
    )
    assert rendered.returncode == 0, rendered.stderr
    assert list(yaml.safe_load_all(rendered.stdout)) == list(yaml.safe_load_all(dump(render(DeployValues()))))


async def test_started_as_kserve_starts_its_router_it_serves_the_graph(podman, image, sim_workers, http):
    """KServe runs its router image with only `--graph-json <spec>`: this image, put in its place,
    runs `modelyard graph serve` and answers readiness and the graph on the router's port."""
    (worker,) = await sim_workers(1)
    (port,) = free_ports(1)
    url = f"{worker.url}/v2/models/m/infer"
    spec = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"name": "a", "serviceUrl": url}]}}}
    name = f"modelyard-test-router-{port}"
    container = await asyncio.create_subprocess_exec(
        *podman, "run", "--rm", "--name", name, "--network", "host",
        "--read-only", "--read-only-tmpfs=false", image,
        "--graph-json", orjson.dumps(spec).decode(), "--port", str(port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        await wait_answering(http, f"http://127.0.0.1:{port}/readyz", container)
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        async with http.post(f"http://127.0.0.1:{port}/", json=body) as response:
            assert response.status == 200
            assert (await response.json())["model_name"] == "m"
    finally:
        await asyncio.to_thread(run, [*podman, "stop", "-t", "5", name], 60)
        await container.wait()
