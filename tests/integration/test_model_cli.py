"""`modelyard model ...` and `modelyard server list` against a fake scheduler (in a thread; each
command runs its own event loop, as from a shell)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from fake_scheduler import FakeScheduler, model_json, threaded_scheduler
from modelyard.cli.main import app
from modelyard.cli.model import MAX_FILE_BYTES
from modelyard.placement.manifest import spec_from_manifest, spec_to_plain
from modelyard.scheduler.config import MAX_BODY_BYTES, SchedulerConfig
from support import free_ports

SELDON_MODELS = """\
apiVersion: mlops.seldon.io/v1alpha1
kind: Model
metadata:
  name: iris
spec:
  storageUri: gs://seldon-models/scv2/samples/mlserver_1.5.0/iris-sklearn
  requirements: [sklearn]
  memory: 100Ki
---
apiVersion: mlops.seldon.io/v1alpha1
kind: Model
metadata:
  name: tfsimple1
spec:
  storageUri: gs://seldon-models/triton/simple
  requirements: [tensorflow]
  memory: 100Ki
  replicas: 2
"""

BAD_SECOND = """\
name: good
storage_uri: ./examples/models/iris
---
apiVersion: mlops.seldon.io/v1alpha1
kind: Model
metadata:
  name: bad
spec:
  storageUri: ./x
  memory: lots
"""

SERVERS = [
    {
        "name": "mlserver",
        "shared": True,
        "replicas": [
            {
                "index": 0,
                "inference_url": "http://127.0.0.1:8080",
                "capabilities": ["sklearn"],
                "total_memory": 2000000,
                "available_memory": 1000000,
                "reserved_memory": 0,
                "over_commit_percentage": 0,
                "draining": False,
                "connected": True,
                "loaded_models": ["iris"],
            }
        ],
    }
]


@pytest.fixture
def scheduler() -> Iterator[FakeScheduler]:
    with threaded_scheduler() as fake:
        yield fake


def cli(scheduler: FakeScheduler | None, *args: str, stdin: str | None = None):  # type: ignore[no-untyped-def]
    env = {"COLUMNS": "200"}  # rich wraps to the terminal; these tests read whole rows
    if scheduler is not None:
        env["MODELYARD_SCHEDULER"] = scheduler.url
    return CliRunner().invoke(app, list(args), input=stdin, env=env)


def test_apply_sends_every_seldon_model_of_a_file(scheduler, tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(SELDON_MODELS)
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["iris: created (version 1)", "tfsimple1: created (version 1)"]
    iris, tf = scheduler.applied
    assert (iris["name"], iris["memory"], iris["requirements"]) == ("iris", 102400, ["sklearn"])
    assert (tf["name"], tf["replicas"]) == ("tfsimple1", 2)

    result = cli(scheduler, "model", "apply", "-f", "-", stdin=SELDON_MODELS.split("---")[0])
    assert result.stdout.splitlines() == ["iris: unchanged (version 1)"]


def test_apply_and_delete_answer_json_for_scripts(scheduler, tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(SELDON_MODELS)
    result = cli(scheduler, "model", "apply", "-f", str(path), "-o", "json")
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(a["name"], a["change"]) for a in answers] == [("iris", "created"), ("tfsimple1", "created")]
    result = cli(scheduler, "model", "delete", "iris", "-o", "json")
    assert (result.exit_code, json.loads(result.stdout)["state"]) == (0, "ModelTerminating")


def test_tables_piped_keep_one_row_per_line(scheduler):
    names = [f"a-model-with-a-rather-long-name-{i}" for i in range(6)]
    scheduler.servers = [{**SERVERS[0], "replicas": [{**SERVERS[0]["replicas"][0], "loaded_models": names}]}]
    lines = CliRunner().invoke(app, ["server", "list"], env={"MODELYARD_SCHEDULER": scheduler.url}).stdout
    rows = lines.splitlines()
    assert len(rows) == 2 and all(name in rows[1] for name in names), lines
    assert all(row == row.rstrip() for row in rows)


def test_apply_with_a_bad_document_sends_nothing(scheduler, tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(SELDON_MODELS)
    bad.write_text(BAD_SECOND)
    result = cli(scheduler, "model", "apply", "-f", str(good), "-f", str(bad))
    assert result.exit_code == 1
    assert scheduler.applied == []
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert str(bad) in lines[0] and "[document 2]" in lines[0] and "spec.memory" in lines[0]


def test_apply_reports_what_the_scheduler_refuses(scheduler, tmp_path):
    path = tmp_path / "iris.yaml"
    path.write_text(SELDON_MODELS.split("---")[0])
    scheduler.models["iris"] = {
        **model_json({"name": "iris", "replicas": 1}, 1, "ModelTerminating"),
        "deleted": True,
    }
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: iris: model 'iris' is being deleted"


def test_list_status_delete_and_servers(scheduler):
    scheduler.models["iris"] = model_json({"name": "iris", "replicas": 2}, 3, "ModelAvailable")
    scheduler.models["old"] = {
        **model_json({"name": "old", "replicas": 1}, 1, "ModelTerminated"),
        "deleted": True,
    }
    scheduler.servers = SERVERS

    result = cli(scheduler, "model", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "STATE", "READY", "SERVER", "REASON"]
    assert lines[1].split() == ["iris", "3", "ModelAvailable", "2/2", "mlserver"]
    assert len(lines) == 2
    assert "old" in cli(scheduler, "model", "list", "--all").stdout

    listed = json.loads(cli(scheduler, "model", "list", "-o", "json").stdout)
    assert listed == {"models": list(scheduler.models.values())}  # the API's JSON, unchanged

    result = cli(scheduler, "model", "status", "iris")
    assert result.stdout.splitlines()[0] == "iris: ModelAvailable (version 3, 2/2 available)"
    assert [line.split()[3:5] for line in result.stdout.splitlines()[2:]] == [
        ["0", "Available"],
        ["1", "Available"],
    ]
    assert (
        json.loads(cli(scheduler, "model", "status", "iris", "-o", "json").stdout) == scheduler.models["iris"]
    )

    result = cli(scheduler, "model", "delete", "iris")
    assert (result.exit_code, result.stdout.strip()) == (0, "iris: deleted (ModelTerminating)")
    result = cli(scheduler, "model", "status", "nope")
    assert (result.exit_code, result.stderr.strip()) == (1, "error: model 'nope' not found")

    result = cli(scheduler, "server", "list")
    row = result.stdout.splitlines()[1].split()
    assert row[:3] == ["mlserver", "0", "http://127.0.0.1:8080"] and "iris" in row
    assert json.loads(cli(scheduler, "server", "list", "-o", "json").stdout) == {"servers": SERVERS}


def test_status_watch_until_a_state(scheduler):
    scheduler.models["iris"] = model_json({"name": "iris", "replicas": 1}, 1, "ModelProgressing")
    available = model_json({"name": "iris", "replicas": 1}, 1, "ModelAvailable")
    scheduler.after_get = lambda: scheduler.models.update(iris=available)  # the next poll sees it
    args = ["model", "status", "iris", "--watch", "--until", "ModelAvailable", "--interval", "0.05"]
    result = cli(scheduler, *args, "--timeout", "10")
    assert result.exit_code == 0, result.output
    headings = [line for line in result.stdout.splitlines() if line.startswith("iris:")]
    assert headings == [
        "iris: ModelProgressing (version 1, 0/1 available)",
        "iris: ModelAvailable (version 1, 1/1 available)",
    ]


def test_status_watch_times_out_with_exit_1(scheduler):
    scheduler.models["iris"] = model_json({"name": "iris", "replicas": 1}, 1, "ModelProgressing")
    args = ["model", "status", "iris", "--watch", "--until", "ModelAvailable", "--interval", "0.05"]
    result = cli(scheduler, *args, "--timeout", "0.2")
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: model 'iris' did not reach ModelAvailable within 0.2s"


def test_status_watch_json_is_one_object_per_line(scheduler):
    scheduler.models["iris"] = model_json({"name": "iris", "replicas": 1}, 1, "ModelProgressing")
    available = model_json({"name": "iris", "replicas": 1}, 1, "ModelAvailable")
    scheduler.after_get = lambda: scheduler.models.update(iris=available)
    args = [
        "model",
        "status",
        "iris",
        "--watch",
        "--until",
        "ModelAvailable",
        "--interval",
        "0.05",
        "-o",
        "json",
    ]
    result = cli(scheduler, *args, "--timeout", "10")
    assert result.exit_code == 0, result.output
    states = [json.loads(line)["state"] for line in result.stdout.splitlines()]
    assert states == ["ModelProgressing", "ModelAvailable"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--watch", "--until", "Available"], "error: --until: 'Available' is not a model state; one of: "),
        (["--until", "ModelAvailable"], "error: --until needs --watch"),
    ],
)
def test_status_until_is_checked_before_waiting(scheduler, args, message):
    scheduler.models["iris"] = model_json({"name": "iris", "replicas": 1}, 1, "ModelProgressing")
    result = cli(scheduler, "model", "status", "iris", *args)
    assert result.exit_code == 1
    assert result.stderr.startswith(message) and len(result.stderr.splitlines()) == 1


def test_apply_of_a_binary_file_is_one_line(scheduler, tmp_path):
    path = tmp_path / "b.yaml"
    path.write_bytes(b"name: x\n\xff\xfe\x00garbage")
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: {path}: not a text file (byte 8 is not UTF-8)"
    assert scheduler.applied == []


OVER_A_REQUEST = "more than the 1 MiB (1048576 bytes) the scheduler takes in one request"
ONE_EACH = "each document is sent as its own request, so this model's must be smaller"


def big_plain_model(name: str, size: int) -> str:
    """A plain spec of about `size` bytes: a long parameter, quick to parse."""
    return f"name: {name}\nstorage_uri: ./models/{name}\nparameters:\n  notes: {'n' * size}\n"


# What PyYAML reads as separators and what it does not: a comment before the first marker, a %YAML
# directive, an explicit end (...), a document of comments only, `---` indented in a block scalar.
FRAMED = """\
# the models of issue 27
%YAML 1.1
---
name: first
storage_uri: ./models/first
parameters:
  notes: |
    ---
    not a marker: indented
...
%YAML 1.1
--- # a comment only
# nothing else
---
"""


def test_apply_sends_a_file_of_many_models_larger_than_one_request(scheduler, tmp_path):
    # Each model is its own request: a file over the scheduler's 1 MiB is fine when each one fits.
    assert SchedulerConfig().max_body_bytes == MAX_BODY_BYTES  # one limit, the scheduler's and model apply's
    third = MAX_BODY_BYTES // 3
    text = FRAMED + "---\n".join(big_plain_model(f"m{i}", third) for i in range(4)) + "---\n" + SELDON_MODELS
    assert len(text) > MAX_BODY_BYTES
    path = tmp_path / "many.yaml"
    path.write_text(text)
    names = ["first", "m0", "m1", "m2", "m3", "iris", "tfsimple1"]
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [f"{name}: created (version 1)" for name in names]
    result = cli(scheduler, "model", "apply", "-f", "-", stdin=text)
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [f"{name}: unchanged (version 1)" for name in names]
    assert [body.get("name") or body["metadata"]["name"] for body in scheduler.applied] == names * 2


def test_apply_refuses_a_document_over_the_schedulers_limit_before_parsing_it(scheduler, tmp_path):
    # Issue 27: one spec of a huge list took half a minute and half a gigabyte to parse, to be
    # refused for its size. The tab after `spec:` is invalid YAML: a parse would have said so first.
    huge = (
        "apiVersion: mlops.seldon.io/v1alpha1\nkind: Model\nmetadata:\n  labels:\n    name: label\n"
        "  name: huge  # the model\nspec:\n\tstorageUri: gs://x\n  requirements:\n"
        + "  - sklearn\n"
        * 100_000
    )
    text = FRAMED + huge + "---\n" + SELDON_MODELS
    path = tmp_path / "huge.yaml"
    path.write_text(text)
    size = len(huge.encode()) + len("---\n")  # the document starts at its marker
    refusal = (
        f"document 2 (model 'huge'): {size / 2**20:.1f} MiB ({size} bytes), {OVER_A_REQUEST}; {ONE_EACH}"
    )
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert (result.exit_code, result.stderr.splitlines()) == (1, [f"error: {path}: {refusal}"])
    result = cli(scheduler, "model", "apply", "-f", "-", stdin=text)
    assert (result.exit_code, result.stderr.splitlines()) == (1, [f"error: <stdin>: {refusal}"])
    # A plain spec is named by its name; JSON is one document, named by none.
    plain = big_plain_model("wide", MAX_BODY_BYTES)
    path.write_text(plain)
    size = len(plain)
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert result.stderr.splitlines() == [
        f"error: {path}: document 1 (model 'wide'): {size / 2**20:.1f} MiB ({size} bytes), {OVER_A_REQUEST}; "
        + ONE_EACH
    ]
    assert scheduler.applied == []


def test_apply_refuses_a_model_whose_request_is_over_the_limit_though_its_document_is_not(
    scheduler, tmp_path
):
    # A backslash is one byte of plain YAML and two of JSON: the request is what must fit.
    wide = "name: wide\nstorage_uri: ./x" + "\\" * (MAX_BODY_BYTES * 3 // 5) + "\n"
    path = tmp_path / "wide.yaml"
    path.write_text(SELDON_MODELS + "---\n" + wide)
    size = len(orjson.dumps(spec_to_plain(spec_from_manifest(yaml.safe_load(wide)))))
    assert len(wide) < MAX_BODY_BYTES < size
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert (result.exit_code, result.stderr.splitlines()) == (
        1,
        [
            f"error: {path}: model 'wide': its request is {size / 2**20:.1f} MiB ({size} bytes) of JSON, "
            + OVER_A_REQUEST
        ],
    )
    assert scheduler.applied == []  # nothing sent, the models that fit neither


@contextlib.contextmanager
def fifo_writing(path: Path, data: bytes) -> Iterator[None]:
    """A FIFO at `path` (what `-f <(...)` gives: its size is 0) that a thread fills with `data`."""
    os.mkfifo(path)

    def write() -> None:
        # A BrokenPipeError: the reader stopped reading, as a bounded read does.
        with contextlib.suppress(BrokenPipeError), path.open("wb") as fifo:
            fifo.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield
    finally:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # frees a writer still waiting for a reader
        writer.join(timeout=10)
        assert not writer.is_alive()


def test_apply_reads_a_bounded_amount_of_a_fifo_or_stdin(scheduler, tmp_path):
    # No size to ask a FIFO or a pipe for: what is read is counted. Past the bound it stops, before
    # decoding or parsing anything (the bytes after the models are not UTF-8).
    data = SELDON_MODELS.encode() + b"\xff" * MAX_FILE_BYTES
    refusal = (
        "more than the 16 MiB (16777216 bytes) model apply reads of one file: split its models into several "
        "files (-f takes each)"
    )
    fifo = tmp_path / "models.fifo"
    with fifo_writing(fifo, data):
        result = cli(scheduler, "model", "apply", "-f", str(fifo))
    assert (result.exit_code, result.stderr.splitlines()) == (1, [f"error: {fifo}: {refusal}"])
    result = CliRunner().invoke(
        app, ["model", "apply", "-f", "-"], input=data, env={"MODELYARD_SCHEDULER": scheduler.url}
    )
    assert (result.exit_code, result.stderr.splitlines()) == (1, [f"error: <stdin>: {refusal}"])
    assert scheduler.applied == []
    fifo.unlink()
    with fifo_writing(fifo, SELDON_MODELS.encode()):  # within the bound: read to its end and applied
        result = cli(scheduler, "model", "apply", "-f", str(fifo))
    assert (result.exit_code, result.stdout.splitlines()) == (
        0,
        ["iris: created (version 1)", "tfsimple1: created (version 1)"],
    )


def test_an_unreachable_scheduler_is_one_line_and_exit_1():
    (port,) = free_ports(1)
    for args in (
        ["model", "list"],
        ["model", "status", "iris"],
        ["server", "list"],
        ["model", "delete", "x"],
    ):
        result = CliRunner().invoke(app, [*args, "--scheduler", f"127.0.0.1:{port}"])
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            f"error: cannot reach the scheduler at http://127.0.0.1:{port}: connection refused"
        ]


@pytest.mark.parametrize(
    "args", [["model", "list"], ["model", "status", "iris"], ["model", "delete", "x"], ["server", "list"]]
)
def test_a_bad_scheduler_address_is_named_as_the_variable_or_the_flag(args, tmp_path):
    expected = "expected host:port or http://host:port for the scheduler (got 'bad::x')"
    result = CliRunner().invoke(app, args, env={"MODELYARD_SCHEDULER": "bad::x"})
    assert (result.exit_code, result.stderr.splitlines()) == (
        1,
        [f"error: environment: MODELYARD_SCHEDULER: {expected}"],
    )
    result = CliRunner().invoke(app, [*args, "--scheduler", "bad::x"], env={"MODELYARD_SCHEDULER": "ok:9004"})
    assert (result.exit_code, result.stderr.splitlines()) == (
        1,
        [f"error: command line: --scheduler: {expected}"],
    )


def test_apply_with_a_bad_scheduler_variable_names_it(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(SELDON_MODELS)
    result = CliRunner().invoke(
        app, ["model", "apply", "-f", str(path)], env={"MODELYARD_SCHEDULER": "bad::x"}
    )
    expected = "expected host:port or http://host:port for the scheduler (got 'bad::x')"
    assert (result.exit_code, result.stderr.splitlines()) == (
        1,
        [f"error: environment: MODELYARD_SCHEDULER: {expected}"],
    )


def test_serve_scheduler_precedence_flag_over_env_over_file(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("placement: {scheduler: 'file:9004'}\n")

    def scheduler_of(*args: str, env: dict[str, str] | None = None) -> object:
        result = CliRunner().invoke(app, ["serve", "--print-config", *args], env=env or {})
        assert result.exit_code == 0, result.output
        return yaml.safe_load(result.stdout)["placement"]["scheduler"]

    assert scheduler_of("-c", str(path)) == "http://file:9004"
    assert scheduler_of("-c", str(path), env={"MODELYARD_SCHEDULER": "env:9004"}) == "http://env:9004"
    both = scheduler_of("-c", str(path), "--scheduler", "flag:9004", env={"MODELYARD_SCHEDULER": "env:9004"})
    assert both == "http://flag:9004"
    assert scheduler_of("--scheduler", "flag:9004") == "http://flag:9004"  # no file: not the demo
