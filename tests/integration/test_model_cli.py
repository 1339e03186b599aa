"""`modelyard model ...` and `modelyard server list` against a fake scheduler (in a thread; each
command runs its own event loop, as from a shell)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml
from typer.testing import CliRunner

from fake_scheduler import FakeScheduler, model_json, threaded_scheduler
from modelyard.cli.main import app
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


def test_apply_refuses_a_file_over_the_schedulers_limit_before_reading_it(scheduler, tmp_path):
    assert SchedulerConfig().max_body_bytes == MAX_BODY_BYTES  # one limit, the scheduler's
    text = SELDON_MODELS + "#" * MAX_BODY_BYTES + "\n"  # valid models, and a comment past the limit
    path = tmp_path / "big.yaml"
    path.write_text(text)
    size = len(text)
    expected = (
        f"error: {path}: {size / 2**20:.1f} MiB ({size} bytes), more than the 1 MiB ({MAX_BODY_BYTES} "
        "bytes) that model apply reads, the scheduler's limit on a request: split it into smaller files"
    )
    result = cli(scheduler, "model", "apply", "-f", str(path))
    assert (result.exit_code, result.stderr.strip()) == (1, expected)
    result = cli(scheduler, "model", "apply", "-f", "-", stdin=text)
    assert (result.exit_code, result.stderr.strip()) == (
        1,
        "error: <stdin>: more than the 1 MiB (1048576 bytes) that model apply reads, the scheduler's "
        "limit on a request: split it into smaller files",
    )
    assert scheduler.applied == []


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
