"""The agent's gRPC client, without a scheduler: its join token from a file, read again when the
file changes and never logged; its TLS files checked at construction."""

from __future__ import annotations

import logging
import os

import pytest

from modelyard.config import TlsClientConfig
from modelyard.errors import ConfigError
from modelyard.rpc import AgentClient

TOKEN = "j-5b0e7c2a9d4f1e8b3a6c"


def test_the_token_goes_as_bearer_metadata_and_a_rotated_file_is_read_again(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "token"
    path.write_text(f"# the join token\n{TOKEN}\n")
    client = AgentClient("127.0.0.1:1", token_file=str(path))
    assert client._metadata() == (("authorization", f"Bearer {TOKEN}"),)
    rotated = "j-rotated-0000000000"
    path.write_text(rotated + "\n")
    os.utime(path, ns=(1, 1))  # a new mtime, whatever the clock's resolution
    assert client._metadata() == (("authorization", f"Bearer {rotated}"),)
    path.write_text("two words\n")  # a broken rotation: the token read before stays, logged once
    os.utime(path, ns=(2, 2))
    assert client._metadata() == (("authorization", f"Bearer {rotated}"),)
    assert client._metadata() == (("authorization", f"Bearer {rotated}"),)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(path) in errors[0] and "printable ASCII" in errors[0]
    assert TOKEN not in caplog.text and rotated not in caplog.text and "two words" not in caplog.text


def test_a_given_token_and_none():
    assert AgentClient("h:1", token=TOKEN)._metadata() == (("authorization", f"Bearer {TOKEN}"),)
    assert AgentClient("h:1")._metadata() is None


def test_unusable_files_are_one_problem_naming_the_file(tmp_path):
    with pytest.raises(ConfigError) as caught:
        AgentClient("h:1", token_file=str(tmp_path / "none"))
    assert caught.value.source == str(tmp_path / "none") and len(caught.value.problems) == 1
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no token"):
        AgentClient("h:1", token_file=str(empty))
    with pytest.raises(ConfigError) as caught:
        AgentClient("h:1", tls=TlsClientConfig(ca_file=str(tmp_path / "ca.pem")))
    assert caught.value.source == str(tmp_path / "ca.pem")
    assert "cannot read the CA certificates" in caught.value.problems[0]
