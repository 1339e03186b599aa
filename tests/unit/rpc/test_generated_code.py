"""The checked-in gRPC code runs on every runtime that pyproject.toml admits, and beside the clients
users have (tritonclient, KServe's client), which need protobuf 6: the code protoc generated must
be no newer than the lowest protobuf and grpcio we declare, and our range must meet theirs."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

RPC = Path(__file__).resolve().parents[3] / "src" / "modelyard" / "rpc"
MESSAGES = sorted(RPC.glob("*_v*/*_pb2.py"))
SERVICES = sorted(RPC.glob("*_v*/*_pb2_grpc.py"))


def declared(package: str, of: str = "modelyard", extra: str | None = None) -> SpecifierSet:
    """The range `of` declares for `package` (for `extra`, or its runtime when None)."""
    for line in metadata.requires(of) or []:
        requirement = Requirement(line)
        wanted = {"extra": extra} if extra else {"extra": ""}
        if requirement.name == package and (
            requirement.marker is None or requirement.marker.evaluate(wanted)
        ):
            return requirement.specifier
    raise AssertionError(f"{of} declares no {package}")


def installed(client: str) -> bool:
    try:
        metadata.version(client)
    except metadata.PackageNotFoundError:
        return False
    return True


# `make test-bounds` runs these files where only modelyard's runtime is (no clients); [dev] has both.
needs_clients = pytest.mark.skipif(
    not (installed("tritonclient") and installed("kserve")),
    reason="tritonclient and kserve are not installed here (they are in modelyard[dev])",
)


def lowest(specifier: SpecifierSet) -> Version:
    (bound,) = [Version(s.version) for s in specifier if s.operator == ">="]
    return bound


def test_the_generated_files_are_found():
    assert len(MESSAGES) == 2 and len(SERVICES) == 2


@pytest.mark.parametrize("path", MESSAGES, ids=lambda p: p.name)
def test_protobuf_gencode_runs_on_the_lowest_protobuf_declared(path: Path):
    """protobuf refuses at import a runtime older than the code's generator ("gencode 7.35.1
    runtime 6.33.6"): the lowest protobuf we admit must be at least the gencode's version."""
    called = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", path.read_text()
    )
    assert called, f"{path.name}: no runtime version check found (protoc's output changed?)"
    gencode = Version(".".join(called.groups()))
    assert gencode <= lowest(declared("protobuf")), f"{path.name} was generated for protobuf {gencode}"


@pytest.mark.parametrize("path", SERVICES, ids=lambda p: p.name)
def test_grpc_code_runs_on_the_lowest_grpcio_declared(path: Path):
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", path.read_text())
    assert generated, f"{path.name}: no GRPC_GENERATED_VERSION"
    assert Version(generated.group(1)) <= lowest(declared("grpcio"))


@needs_clients
@pytest.mark.parametrize(("client", "extra"), [("tritonclient", "grpc"), ("kserve", None)])
def test_our_protobuf_range_admits_the_clients_lowest_protobuf(client: str, extra: str | None):
    """Installed beside tritonclient or KServe's client, pip can pick a protobuf both accept: at
    least the lowest one the client accepts is in our range."""
    theirs = declared("protobuf", of=client, extra=extra)
    assert lowest(theirs) in declared("protobuf"), f"{client} needs protobuf {theirs}"


@needs_clients
@pytest.mark.parametrize("client", ["tritonclient.grpc", "kserve"])
def test_modelyard_imports_beside_the_clients_generated_code(client: str):
    """One process, as an application embedding both: no "duplicate symbol" (ours are in a pool of
    their own), no runtime version error (the dev lock installs the protobuf the clients allow)."""
    code = f"import {client}, modelyard.rpc, modelyard.cli.main; print('ok')"
    both = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert both.returncode == 0 and both.stdout.strip() == "ok", both.stderr[-2000:]


@needs_clients
def test_every_command_starts_beside_the_clients():
    """This environment holds tritonclient and KServe's client with the protobuf they allow; every
    modelyard command must still start (the gencode check fails at import, before --help)."""
    commands = [[], ["serve"], ["scheduler"], ["agent"], ["sim-worker"], ["bench"], ["graph", "serve"]]
    for command in commands:
        shown = subprocess.run(
            [sys.executable, "-m", "modelyard", *command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, f"modelyard {' '.join(command)} --help: {shown.stderr[-2000:]}"
        assert "Usage" in shown.stdout
