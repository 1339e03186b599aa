"""The CLI's tables of scheduler JSON (cli/placement_views.py)."""

from __future__ import annotations

from rich.console import Console

from modelyard.cli.placement_views import (
    applied_line,
    format_bytes,
    model_status,
    models_table,
    servers_table,
)


def render(renderable: object) -> str:
    console = Console(width=200, record=True, highlight=False)
    console.print(renderable)
    return console.export_text()


def model(name: str, state: str, **fields: object) -> dict[str, object]:
    return {
        "name": name,
        "deleted": False,
        "version": 2,
        "server": "mlserver",
        "state": state,
        "reason": "",
        "available_replicas": 1,
        "unavailable_replicas": 1,
        "spec": {"replicas": 2},
        "versions": [],
        **fields,
    }


def test_applied_line_names_the_change():
    assert applied_line({"name": "iris", "version": 1, "change": "created"}) == "iris: created (version 1)"
    assert (
        applied_line({"name": "iris", "version": 2, "change": "new_version"})
        == "iris: new version (version 2)"
    )
    assert applied_line({"name": "iris", "version": 2, "change": "scaling"}) == "iris: scaled (version 2)"


def test_models_table_hides_terminated_unless_asked():
    models = [model("iris", "ModelAvailable"), model("old", "ModelTerminated", deleted=True)]
    text = render(models_table(models))
    header = text.splitlines()[0].split()
    assert header == ["NAME", "VERSION", "STATE", "READY", "SERVER", "REASON"]
    assert "iris" in text and "1/2" in text and "old" not in text
    assert "old" in render(models_table(models, show_all=True))


def test_models_table_marks_a_deleted_model_still_unloading():
    text = render(models_table([model("iris", "ModelTerminating", deleted=True, reason="unloading")]))
    assert "ModelTerminating (deleted)" in text and "unloading" in text


def test_model_status_lists_every_replica_of_every_version_newest_first():
    versions = [
        {
            "version": 1,
            "server": "mlserver",
            "state": "ModelAvailable",
            "replicas": {"0": {"state": "Available"}},
        },
        {
            "version": 2,
            "server": "triton",
            "state": "ModelProgressing",
            "replicas": {"1": {"state": "Loading"}, "0": {"state": "LoadFailed", "reason": "no memory"}},
        },
    ]
    text = render(model_status(model("iris", "ModelProgressing", versions=versions)))
    lines = text.splitlines()
    assert lines[0].startswith("iris: ModelProgressing (version 2, 1/2 available)")
    rows = [line.split() for line in lines[2:] if line.strip()]
    assert [r[:5] for r in rows] == [
        ["2", "ModelProgressing", "triton", "0", "LoadFailed"],
        ["2", "ModelProgressing", "triton", "1", "Loading"],
        ["1", "ModelAvailable", "mlserver", "0", "Available"],
    ]
    assert "no memory" in lines[2]


def test_servers_table_shows_memory_and_flags():
    servers = [
        {
            "name": "mlserver",
            "replicas": [
                {
                    "index": 0,
                    "inference_url": "http://127.0.0.1:8080",
                    "capabilities": ["sklearn", "xgboost"],
                    "total_memory": 2 * 1024**3,
                    "available_memory": 1536 * 1024**2,
                    "reserved_memory": 0,
                    "draining": True,
                    "connected": True,
                    "loaded_models": ["iris"],
                }
            ],
        }
    ]
    text = render(servers_table(servers))
    assert "MEMORY tot/avail/resv" in text
    row = text.splitlines()[1]
    assert "0 (draining)" in row and "2Gi/1.5Gi/0" in row and "sklearn, xgboost" in row and "iris" in row


def test_format_bytes():
    assert [format_bytes(v) for v in (512, 2000000, 1024**3, 150 * 1024**2, None)] == [
        "512",
        "1.9Mi",
        "1Gi",
        "150Mi",
        "-",
    ]
