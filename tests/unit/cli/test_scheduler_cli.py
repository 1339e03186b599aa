"""`modelyard scheduler` refuses a database it cannot read in one line, before it listens."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modelyard.cli.main import app


@pytest.mark.parametrize(
    ("statement", "problem"),
    [
        ("CREATE TABLE models (name TEXT PRIMARY KEY, spec TEXT)", "not a modelyard scheduler database"),
        ("PRAGMA user_version = 7", "its schema version 7 is newer than this modelyard reads"),
    ],
)
def test_an_unusable_database_is_one_line_and_exit_1(tmp_path: Path, statement: str, problem: str) -> None:
    db = tmp_path / "s.db"
    raw = sqlite3.connect(db)
    raw.execute(statement)
    raw.commit()
    raw.close()
    result = CliRunner().invoke(app, ["scheduler", "--db", str(db), "--port", "0", "--agent-port", "0"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --db {db}: {problem}")
