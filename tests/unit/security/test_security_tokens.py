"""Token files (security/tokens.py): parsed with one-line errors naming the file and line and never
the token, looked up by hash, reloaded when they change; agent identities from SPIFFE URIs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelyard.security.tokens import (
    AgentIdentity,
    TokenFile,
    TokenFileError,
    any_key,
    bearer_token,
    load_token_file,
    read_token,
    role_key,
)

SECRET = "s3cret-0123456789abcdef"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    return str(path)


def test_roles_and_comments(tmp_path: Path) -> None:
    path = write(
        tmp_path, f"# who may do what\n\nread  r-{SECRET}\nwrite\tw-{SECRET}  \n   # indented comment\n"
    )
    table = load_token_file(path, role_key)
    assert table.lookup(f"r-{SECRET}") == "read"
    assert table.lookup(f"w-{SECRET}") == "write"
    assert table.lookup(f"w-{SECRET}x") is None and table.lookup("") is None
    assert len(table) == 2 and table.keys() == {"read", "write"}
    assert all(f"-{SECRET}" not in repr(entry) for entry in table.entries)  # only hashes are kept


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        (f"read a\nwrite {SECRET}\nread {SECRET}\n", 3, "the same token as line 2"),
        (f"admin {SECRET}\n", 1, "unknown role"),
        (f"{SECRET} write\n", 1, "unknown role"),  # written the wrong way round: the token is not quoted
        ("# nothing\nread\n", 2, "one field, expected two"),
        (f"read {SECRET} extra\n", 1, "more fields"),
        ("read tok\u00e9n\n", 1, "printable ASCII"),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_number_and_never_the_token(
    tmp_path: Path, text: str, line: int, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TokenFileError) as caught:
        load_token_file(path, role_key)
    assert caught.value.source == f"{path}:{line}"
    assert problem in caught.value.message and SECRET not in caught.value.message


def test_unreadable_empty_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read the token file: No such file"):
        load_token_file(str(tmp_path / "missing"))
    with pytest.raises(TokenFileError, match="holds no token"):
        load_token_file(write(tmp_path, "# only a comment\n"))
    binary = tmp_path / "binary"
    binary.write_bytes(b"read \xff\xfe\n")
    with pytest.raises(TokenFileError, match="not a text file"):
        load_token_file(str(binary))


def test_agent_tokens_take_any_server_name(tmp_path: Path) -> None:
    table = load_token_file(write(tmp_path, f"mlserver {SECRET}\ntriton t-{SECRET}\n"), any_key)
    assert table.lookup(SECRET) == "mlserver" and table.lookup(f"t-{SECRET}") == "triton"


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, f"read {SECRET}\n")
    tokens = TokenFile(path, role_key, reload_interval=0)
    assert tokens.lookup(SECRET) == "read"
    Path(path).write_text(f"write {SECRET}-new\n")
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
    assert tokens.lookup(f"{SECRET}-new") == "write" and tokens.lookup(SECRET) is None
    Path(path).write_text(f"bogus {SECRET}\n")
    os.utime(path, ns=(2, 2))
    assert tokens.lookup(f"{SECRET}-new") == "write"  # kept
    assert tokens.lookup(f"{SECRET}-new") == "write"
    errors = [r for r in caplog.records if "still using the tokens read before" in r.getMessage()]
    assert len(errors) == 1 and SECRET not in errors[0].getMessage()


def test_bearer_header_and_client_token_file(tmp_path: Path) -> None:
    assert bearer_token(f"Bearer {SECRET}") == SECRET
    assert bearer_token(f"bEaReR   {SECRET} ") == SECRET
    assert bearer_token(f"Basic {SECRET}") is None and bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    path = tmp_path / "token"
    path.write_text(f"# the scheduler's\n\n  {SECRET}  \n")
    assert read_token(str(path)) == SECRET
    path.write_text("\n")
    with pytest.raises(TokenFileError, match="holds no token"):
        read_token(str(path))
    path.write_text(f"{SECRET} {SECRET}\n")
    with pytest.raises(TokenFileError) as caught:
        read_token(str(path))
    assert SECRET not in caught.value.message


@pytest.mark.parametrize(
    ("uri", "identity"),
    [
        ("spiffe://modelyard/server/sim/replica/0", AgentIdentity("sim", 0)),
        ("spiffe://modelyard/server/mlserver/replica/12", AgentIdentity("mlserver", 12)),
        ("spiffe://modelyard/server/sim", AgentIdentity("sim")),
        ("spiffe://other/server/sim/replica/0", None),
        ("https://modelyard/server/sim", None),
        ("spiffe://modelyard/server/", None),
        ("spiffe://modelyard/server/sim/replica/", None),
        ("spiffe://modelyard/server/sim/replica/-1", None),
        ("spiffe://modelyard/server/sim/replica/0/x", None),
        ("spiffe://modelyard/server/sim?replica=0", None),
        ("spiffe://modelyard/model/sim", None),
    ],
)
def test_agent_identities_from_uris(uri: str, identity: AgentIdentity | None) -> None:
    assert AgentIdentity.from_uri(uri) == identity
    if identity is not None:
        assert identity.uri == uri


def test_what_an_identity_allows() -> None:
    assert AgentIdentity("sim", 0).allows("sim", 0)
    assert not AgentIdentity("sim", 0).allows("sim", 1)
    assert not AgentIdentity("sim", 0).allows("other", 0)
    assert AgentIdentity("sim").allows("sim", 7) and not AgentIdentity("sim").allows("simx", 7)
