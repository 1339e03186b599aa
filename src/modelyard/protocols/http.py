"""HTTP facts every server and client here shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter

# Hop-by-hop headers (RFC 9110 section 7.6.1, and the non-standard Proxy-Connection): they describe
# one connection, never the message, so they never cross a proxy. Lower case.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Request fields a proxy never passes on: hop-by-hop, recomputed by the next hop (Host,
# Content-Length), or already settled with the client (Expect: the whole body is held; Content-Encoding:
# a gzip/deflate body has been decoded by aiohttp's server). Lower case.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding"}
# Those, and the request id, which a proxy sets apart (the client's, or one it makes) and sends itself.
NOT_FORWARDED_WITH_ID = NOT_FORWARDED | {"x-request-id"}
# A Connection field's value that names only a field dropped anyway (the usual one).
PLAIN_CONNECTION = frozenset({b"keep-alive", b"Keep-Alive"})
_CONNECTION_TOKENS = frozenset({b"", b"keep-alive"})


def connection_options(fields: Sequence[tuple[bytes, bytes]], indexes: Iterable[int]) -> set[bytes]:
    """The names the Connection fields at `indexes` list (RFC 9110 7.6.1: those fields are
    hop-by-hop for this message too), lower case, less "keep-alive" (a field dropped anyway).
    "close" stays among them, so that a field named Close goes, as the text rules in
    upstream/headers.py have it."""
    names: set[bytes] = set()
    for index in indexes:
        value = fields[index][1]
        if value not in PLAIN_CONNECTION:  # (most say just that)
            names.update(token.strip().lower() for token in value.split(b","))
    names -= _CONNECTION_TOKENS
    return names


Fields = list[tuple[bytes, bytes]]
# A head shape (the names of its fields) is remembered only if it is this small: a client sending
# heads of ever new names cannot make a parser keep much (each parser keeps a bounded number).
_SHAPE_NAMES = 32
_SHAPE_BYTES = 1024


def worth_keeping(names: tuple[bytes, ...]) -> bool:
    """Whether a parser remembers what a head with fields of these names holds."""
    return len(names) <= _SHAPE_NAMES and sum(map(len, names)) <= _SHAPE_BYTES


def fields_at(indexes: Sequence[int]) -> Callable[[Fields], Fields]:
    """A function that takes the fields at `indexes` of a head's, as a new list: made once per
    shape of head (a parser's), it runs per message, in C where it can."""
    if len(indexes) > 1:
        take = itemgetter(*indexes)
        return lambda fields: list(take(fields))
    if indexes:
        only = indexes[0]
        return lambda fields: [fields[only]]
    return lambda fields: []


# How header fields are decoded, as aiohttp does: UTF-8, with any other byte kept as a surrogate so
# that a value encoded again comes out as the bytes that came in.
HEADER_TEXT = ("utf-8", "surrogateescape")
_FIELD_JOIN = b": ".join  # a field's name and value as one line's text


class RawHeaders:
    """Header fields as bytes (name, value), written out again as they came: the proxy forwards a
    request's headers and relays an answer's without decoding and encoding each field. Iterating
    decodes them (HEADER_TEXT) for whoever needs text (tracing, gRPC metadata, aiohttp).

    No field may hold CR, LF or NUL. Fields parsed by llhttp or aiohttp cannot (both refuse them);
    `encode_fields` refuses them in what the gateway adds.
    """

    __slots__ = ("fields",)

    def __init__(self, fields: list[tuple[bytes, bytes]]) -> None:
        self.fields = fields

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for name, value in self.fields:
            yield name.decode(*HEADER_TEXT), value.decode(*HEADER_TEXT)

    def block(self) -> bytes:
        """The fields as lines of a message head, each ended by CRLF."""
        fields = self.fields
        # (one C pass; a formatted line per field in Python costs more per field)
        return b"\r\n".join(map(_FIELD_JOIN, fields)) + b"\r\n" if fields else b""


def encode_fields(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[bytes, bytes], ...]:
    """Text fields as RawHeaders holds them; ValueError if a name or value holds CR, LF or NUL."""
    encoded = []
    for name, value in pairs:
        if "\r" in value or "\n" in value or "\0" in value or "\r" in name or "\n" in name or "\0" in name:
            raise ValueError(f"header {name[:100]!r}: a header name or value may not hold CR, LF or NUL")
        encoded.append((name.encode(*HEADER_TEXT), value.encode(*HEADER_TEXT)))
    return tuple(encoded)


def field_value(fields: Iterable[tuple[bytes, bytes]], lowered: bytes) -> bytes | None:
    """The first value of the field named `lowered` (given in lower case), or None."""
    for name, value in fields:
        if name.lower() == lowered:
            return value
    return None


class HeaderView(Mapping[str, str]):
    """A request's raw header fields read as a case-insensitive mapping (first value wins, as
    CIMultiDict.get), decoding only what is looked up: most proxied requests look up nothing."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Sequence[tuple[bytes, bytes]]) -> None:
        self._fields = fields

    def __getitem__(self, name: str) -> str:
        value = field_value(self._fields, name.lower().encode(*HEADER_TEXT))
        if value is None:
            raise KeyError(name)
        return value.decode(*HEADER_TEXT)

    def __contains__(self, name: object) -> bool:
        return (
            isinstance(name, str) and field_value(self._fields, name.lower().encode(*HEADER_TEXT)) is not None
        )

    def __iter__(self) -> Iterator[str]:
        return (name.decode(*HEADER_TEXT) for name, _value in self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]  # every field, repeats too
        return list(RawHeaders(list(self._fields)))
