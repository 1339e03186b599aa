"""upstream/http1.py `encode_request`: no header line may break the request head."""

from __future__ import annotations

import pytest

from modelyard.errors import BadRequest
from modelyard.upstream.http1 import encode_request


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-a", "v\r\nX-Injected: yes\r\nContent-Length: 0"),
        ("x-a", "v\nX-Injected: yes"),
        ("x-a", "v\rx"),
        ("x-a", "v\0x"),
        ("x-a\r\nX-Injected", "yes"),
        ("x-a\0", "v"),
    ],
)
def test_cr_lf_or_nul_in_a_header_is_refused(name: str, value: str) -> None:
    with pytest.raises(BadRequest, match="may not hold CR, LF or NUL") as refused:
        encode_request("POST", "/v2/models/m/infer", b"h", [("X-Ok", "1"), (name, value)], b"{}")
    assert refused.value.status == 400


def test_tabs_and_non_ascii_values_pass_as_they_are() -> None:
    head = encode_request("GET", "/", b"h", [("X-A", "a\tb"), ("X-B", "é")], None)
    assert head == "GET / HTTP/1.1\r\nHost: h\r\nX-A: a\tb\r\nX-B: é\r\n\r\n".encode()
