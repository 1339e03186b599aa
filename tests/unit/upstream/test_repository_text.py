"""error_text: the server's error message out of MLServer's, Triton's or FastAPI's error bodies."""

from __future__ import annotations

import pytest

from modelyard.upstream.repository import RepositoryModel, error_text


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"error": "Model iris not found"}', "Model iris not found"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"plain failure\n", "plain failure"),
        (b"", "(empty body)"),
        (b'{"error": 3}', '{"error": 3}'),
    ],
)
def test_error_text(body, text):
    assert error_text(body) == text


def test_error_text_is_bounded():
    assert len(error_text(b"x" * 10_000)) == 2000


def test_ready_is_case_insensitive():
    assert RepositoryModel("m", "", "ready", "").ready
    assert not RepositoryModel("m", "", "UNAVAILABLE", "").ready
