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


def _run(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(
        app, ["scheduler", "--db", ":memory:", "--port", "0", "--agent-port", "0", *args]
    )
    return result.exit_code, result.stderr.splitlines()


def test_an_address_others_reach_needs_tls_and_credentials_or_insecure() -> None:
    code, lines = _run("--host", "0.0.0.0")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: --host 0.0.0.0: reachable from other machines, and there is no TLS")
    assert "--insecure" in lines[0]


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("read abc\nwrite abc\n", ":2: ", "the same token as line 1"),
        ("admin s3cret\n", ":1: ", "unknown role"),
        ("write\n", ":1: ", "one field, expected two"),
        ("# no tokens\n", ": ", "holds no token"),
    ],
)
def test_a_bad_tokens_file_is_one_line_naming_the_file_and_line(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(text)
    code, lines = _run("--tokens-file", str(tokens))
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {tokens}{where}{problem}") and "s3cret" not in lines[0]


def test_unreadable_token_and_certificate_files_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    for flag in ("--tokens-file", "--agent-tokens-file"):
        code, lines = _run(flag, str(missing))
        assert code == 1 and lines == [
            f"error: {missing}: cannot read the token file: No such file or directory"
        ]
    code, lines = _run("--tls-cert", str(missing), "--tls-key", str(missing))
    assert (
        code == 1
        and len(lines) == 1
        and lines[0].startswith(f"error: {missing}: cannot read the certificate")
    )
    code, lines = _run("--agent-ca", str(missing))
    assert code == 1 and lines == ["error: --agent-ca: needs --tls-cert and --tls-key (mutual TLS is TLS)"]
    code, lines = _run("--tls-cert", str(missing))
    assert code == 1 and lines == ["error: --tls-cert and --tls-key go together"]


def test_the_tokens_file_may_come_from_the_environment(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("reader s3cret\n")
    result = CliRunner().invoke(
        app,
        ["scheduler", "--db", ":memory:", "--port", "0", "--agent-port", "0"],
        env={"MODELYARD_SCHEDULER_TOKENS_FILE": str(tokens)},
    )
    assert result.exit_code == 1 and result.stderr.startswith(f"error: {tokens}:1: unknown role")
