"""Go's encoding/json as KServe's router shows it (compat spec 3.1 step 2, 3.3)."""

from __future__ import annotations

import pytest

from modelyard.graph import go_json


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (1.0, "1"),
        (100.0, "100"),
        (2.5, "2.5"),
        (0.1, "0.1"),
        (-3.0, "-3"),
        (12345678901234567890.0, "12345678901234567000"),
        (1e20, "100000000000000000000"),
        (1e21, "1e+21"),
        (-1e21, "-1e+21"),
        (1.5e300, "1.5e+300"),
        (1e100, "1e+100"),
        (1e-7, "1e-7"),
        (1.5e-7, "1.5e-7"),
        (1e-10, "1e-10"),
        (0.000001, "0.000001"),
        (0.00001, "0.00001"),
        (0.0, "0"),
        (-0.0, "-0"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
    ],
)
def test_format_float_follows_go(number: float, text: str) -> None:
    assert go_json.format_float(number) == text


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
def test_format_float_rejects_what_go_cannot_encode(number: float) -> None:
    with pytest.raises(ValueError):
        go_json.format_float(number)


def test_marshal_is_compact_sorted_and_float_reencoded() -> None:
    value = {"b": [1.0, 2.5, None, True, False], "a": {"z": 1e21, "y": "x"}, "": 0.0}
    assert go_json.marshal(value) == b'{"":0,"a":{"y":"x","z":1e+21},"b":[1,2.5,null,true,false]}'


def test_marshal_sorts_keys_by_bytes_at_every_level() -> None:
    value = {"b": {"é": 1, "z": 2, "Z": 3}, "B": 1, "a": 2, "10": 3, "9": 4}
    assert go_json.marshal(value) == '{"10":3,"9":4,"B":1,"a":2,"b":{"Z":3,"z":2,"é":1}}'.encode()


def test_marshal_roundtrips_a_decoded_body() -> None:
    decoded = go_json.decode_object(b'{ "m": 12345678901234567890, "n": 1e21, "f": 1.0, "s": "<a & b>" }')
    assert (
        go_json.marshal(decoded)
        == b'{"f":1,"m":12345678901234567000,"n":1e+21,"s":"\\u003ca \\u0026 b\\u003e"}'
    )


def test_marshal_empty_containers_and_null() -> None:
    assert go_json.marshal({}) == b"{}"
    assert go_json.marshal([]) == b"[]"
    assert go_json.marshal(None) == b"null"
    assert go_json.marshal({"instances": [{}]}) == b'{"instances":[{}]}'


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("plain", '"plain"'),
        ("<script>&</script>", '"\\u003cscript\\u003e\\u0026\\u003c/script\\u003e"'),
        ('quote " and \\ backslash', '"quote \\" and \\\\ backslash"'),
        ("line\nfeed\rtab\t", '"line\\nfeed\\rtab\\t"'),
        ("\x00\x01\x1f", '"\\u0000\\u0001\\u001f"'),
        ("\u2028\u2029", '"\\u2028\\u2029"'),
        ("é😀\x7f", '"é😀\x7f"'),
        ("/", '"/"'),
    ],
)
def test_quote_escapes_as_go_does(text: str, quoted: str) -> None:
    assert go_json.quote(text) == quoted


def test_quote_uses_go_short_escapes_for_backspace_and_formfeed() -> None:
    assert go_json.quote("\b\f") == '"\\b\\f"'


def test_quote_writes_invalid_utf8_bytes_as_replacement_character() -> None:
    decoded = go_json.decode_object(b'{"a":"x\xffy"}')
    assert go_json.marshal(decoded) == '{"a":"x\ufffdy"}'.encode()


def test_lone_surrogate_escape_becomes_replacement_character() -> None:
    decoded = go_json.decode_object(b'{"a":"\\ud800"}')
    assert go_json.marshal(decoded) == '{"a":"\ufffd"}'.encode()


def test_surrogate_pair_escape_is_one_character() -> None:
    decoded = go_json.decode_object(b'{"a":"\\ud83d\\ude00"}')
    assert go_json.marshal(decoded) == '{"a":"😀"}'.encode()


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'{"a":1}', {"a": 1.0}),
        (b' \n{"a":{"b":[1,"x",null]}}\t', {"a": {"b": [1.0, "x", None]}}),
        (b"null", None),
        (b"{}", {}),
    ],
)
def test_decode_object_accepts_objects_and_null(body: bytes, value: object) -> None:
    assert go_json.decode_object(body) == value


def test_decode_object_reads_numbers_as_float64() -> None:
    decoded = go_json.decode_object(b'{"i":1,"big":12345678901234567890}')
    assert decoded is not None
    assert type(decoded["i"]) is float
    assert decoded["big"] == 12345678901234567890.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1,2]", "json: cannot unmarshal array into Go value of type map[string]interface {}"),
        (b'"text"', "json: cannot unmarshal string into Go value of type map[string]interface {}"),
        (b"42", "json: cannot unmarshal number into Go value of type map[string]interface {}"),
        (b"true", "json: cannot unmarshal bool into Go value of type map[string]interface {}"),
        (b"Internal Server Error", "invalid character 'I' looking for beginning of value"),
        (b"<html></html>", "invalid character '<' looking for beginning of value"),
        (b"'x'", "invalid character '\\'' looking for beginning of value"),
        (b"", "unexpected end of JSON input"),
        (b"  \n", "unexpected end of JSON input"),
    ],
)
def test_decode_object_errors_read_like_go(body: bytes, message: str) -> None:
    with pytest.raises(go_json.GoJsonError) as caught:
        go_json.decode_object(body)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"a":', "unexpected end of JSON input"),
        (b'{"a":1}x', "invalid character 'x' after top-level value"),
        (b'{"a":1,}', "invalid character '}' looking for beginning of object key string"),
    ],
)
def test_decode_object_malformed_json_errors_read_like_go(body: bytes, message: str) -> None:
    with pytest.raises(go_json.GoJsonError) as caught:
        go_json.decode_object(body)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("body", "predictions"),
    [
        (b'{"predictions":[1,2.5]}', [1.0, 2.5]),
        (b'{"predictions":[{"label":"dog"}],"other":1}', [{"label": "dog"}]),
        (b'{"predictions":["a"],"instances":[9,9]}', ["a"]),
        (b'{"predictions":[1],"instances":null}', [1.0]),
        (b'{"predictions":[null]}', [None]),
    ],
)
def test_decode_predictions_maps_a_non_empty_list(body: bytes, predictions: list[object]) -> None:
    assert go_json.decode_predictions(body) == predictions


@pytest.mark.parametrize(
    "body",
    [
        b'{"predictions":[]}',  # empty
        b'{"predictions":null}',
        b'{"instances":[1]}',  # missing
        b'{"predictions":"dog"}',  # not a list: Go's decode fails
        b'{"predictions":{"a":1}}',
        b'{"predictions":[1],"instances":"x"}',  # instances not a list: the whole decode fails
        b'{"predictions":[1],"instances":{}}',
        b"[1,2]",
        b"null",
        b'"predictions"',
        b"not json",
        b"",
    ],
)
def test_decode_predictions_leaves_other_bodies_unchanged(body: bytes) -> None:
    assert go_json.decode_predictions(body) is None


def test_decode_predictions_out_of_range_number_fails_the_decode() -> None:
    assert go_json.decode_predictions(b'{"predictions":[1e400]}') is None


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        (b"{}", True),
        (b' \t\r\n{"a":[1,2,{"b":null}]} \n', True),
        (b'"x"', True),
        (b"[1]", True),
        (b"1e400", True),
        (b"-0", True),
        (b'{"a":"\xff"}', True),  # Go accepts invalid UTF-8 inside strings
        (b"", False),
        (b"   ", False),
        (b"NaN", False),
        (b'{"a":NaN}', False),
        (b"Infinity", False),
        (b"[-Infinity]", False),
        (b"{} {}", False),
        (b"{'a':1}", False),
        (b"\xff", False),
        (b"plain text", False),
        (b'{"a":1,}', False),
        (b"01", False),
    ],
)
def test_valid_is_go_json_valid(body: bytes, ok: bool) -> None:
    assert go_json.valid(body) is ok


def test_valid_survives_deep_nesting() -> None:
    assert go_json.valid(b"[" * 100_000) is False


def test_map_predictions_matches_keys_as_go_does_case_insensitively() -> None:
    assert go_json.decode_predictions(b'{"Predictions": [1, 2]}') == [1.0, 2.0]
