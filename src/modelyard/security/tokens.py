"""Bearer tokens from files, checked in constant time, and the identities agents prove.

A token file holds one credential a line, `KEY TOKEN` (the key is a role, `read` or `write`, for the
scheduler's REST API; a server's name for agents' join tokens), with blank lines and `#` comment
lines. `load_token_file` reads one into a `TokenTable`, which keeps only each token's SHA-256: a
token given is hashed and compared with every entry by `hmac.compare_digest`, none skipped, so the
time taken says nothing of how much of a token matched, nor which line. A problem with a file is a
`TokenFileError` naming the file and the line, never the token; nothing here logs a token.
`TokenFile` reads the file again when it changes (a rotated Kubernetes Secret), keeping the last
good table when the new one cannot be used.

Agents prove who they are with a client certificate whose URI SAN is
`spiffe://modelyard/server/<server>[/replica/<replica>]` (`AgentIdentity.from_uri`), or with a
join token for their server. A client of the scheduler's REST API shows its role in a URI SAN
`spiffe://modelyard/role/read` or `spiffe://modelyard/role/write` (`role_from_uri`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from modelyard.errors import ConfigError

log = logging.getLogger("modelyard.security")
T = TypeVar("T")

READ = "read"
WRITE = "write"
ROLES = (READ, WRITE)
# A token is printable ASCII without spaces (RFC 6750's b64token is a subset): what a header carries.
_TOKEN = re.compile(r"[\x21-\x7e]+")


class TokenFileError(ConfigError):
    """A token file that cannot be used: `source` is the file (and line), the problem never quotes
    a token."""

    def __init__(self, path: str, problem: str, line: int | None = None) -> None:
        super().__init__(f"{path}:{line}" if line is not None else path, [problem])


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class TokenTable:
    """(SHA-256 of a token, its key) for every line of a file."""

    entries: tuple[tuple[bytes, str], ...] = ()

    def lookup(self, token: str) -> str | None:
        """The key of `token`, or None: every entry is compared, in constant time."""
        given = digest(token)
        found: str | None = None
        for entry, key in self.entries:
            if hmac.compare_digest(given, entry):
                found = key
        return found

    def keys(self) -> frozenset[str]:
        return frozenset(key for _, key in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


KeyCheck = Callable[[str], str | None]
"""What is wrong with a line's key (a sentence), or None when it is one the file may name."""


def role_key(key: str) -> str | None:
    """The REST API's keys: a role."""
    # The key is not quoted: a line written the wrong way round would put its token in the message.
    return None if key in ROLES else f"unknown role: the first field must be {' or '.join(ROLES)}"


def any_key(key: str) -> str | None:
    return None


def parse_token_lines(lines: Iterable[str], path: str, check_key: KeyCheck = any_key) -> TokenTable:
    """The table of `KEY TOKEN` lines; TokenFileError naming `path` and the line of the first problem
    (an empty token, a key `check_key` refuses, more than two fields, a token given twice)."""
    entries: list[tuple[bytes, str]] = []
    seen: dict[bytes, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) == 1:
            raise TokenFileError(path, "one field, expected two: KEY TOKEN", number)
        if len(fields) > 2:
            raise TokenFileError(
                path, "expected KEY TOKEN, found more fields (a token has no spaces)", number
            )
        key, token = fields
        problem = check_key(key)
        if problem is not None:
            raise TokenFileError(path, problem, number)
        if not _TOKEN.fullmatch(token):
            raise TokenFileError(path, "the token must be printable ASCII", number)
        hashed = digest(token)
        if hashed in seen:
            raise TokenFileError(path, f"the same token as line {seen[hashed]}: each token once", number)
        seen[hashed] = number
        entries.append((hashed, key))
    return TokenTable(tuple(entries))


def load_token_file(path: str, check_key: KeyCheck = any_key, *, allow_empty: bool = False) -> TokenTable:
    """The file's table; TokenFileError naming the file when it cannot be read or has no token."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise TokenFileError(path, f"cannot read the token file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TokenFileError(path, f"not a text file (byte {exc.start} is not UTF-8)") from None
    table = parse_token_lines(text.splitlines(), path, check_key)
    if not table and not allow_empty:
        raise TokenFileError(path, "holds no token (lines KEY TOKEN)")
    return table


def _stat(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class WatchedFile(Generic[T]):
    """What `load` makes of a file, made again when the file changes (looked at, at most, every
    `reload_interval` seconds, when `table` is read). A change that cannot be used (`load` raises
    ConfigError) is logged once and what was read before stays. `what` names it in the log."""

    def __init__(
        self, path: str, load: Callable[[str], T], what: str, *, reload_interval: float = 10.0
    ) -> None:
        self.path = path
        self._load = load
        self._what = what
        self._interval = reload_interval
        self._seen = _stat(path)
        self._table = load(path)
        self._checked = time.monotonic()
        self._failed: tuple[int, int, int, int] | None = None

    @property
    def table(self) -> T:
        now = time.monotonic()
        if now - self._checked >= self._interval:
            self._checked = now
            self.reload()
        return self._table

    def reload(self) -> bool:
        """Read the file again if it changed and can be used; True if it did."""
        seen = _stat(self.path)
        if seen == self._seen or seen is None:
            return False
        try:
            table = self._load(self.path)
        except ConfigError as exc:
            if seen != self._failed:
                log.error("%s; still using the %s read before", exc, self._what)
                self._failed = seen
            return False
        self._table, self._seen = table, seen
        log.info("%s reloaded from %s (%d)", self._what, self.path, len(table))  # type: ignore[arg-type]
        return True


class TokenFile(WatchedFile[TokenTable]):
    """A token file's table, read again when it changes (WatchedFile)."""

    def __init__(self, path: str, check_key: KeyCheck = any_key, *, reload_interval: float = 10.0) -> None:
        super().__init__(
            path, lambda p: load_token_file(p, check_key), "tokens", reload_interval=reload_interval
        )

    def lookup(self, token: str) -> str | None:
        return self.table.lookup(token)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (`bearer` in any letter case), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def read_token(path: str) -> str:
    """A client's token from a file: its first line that is not blank or a comment, stripped (a
    Kubernetes Secret's file, or `echo TOKEN > file`). TokenFileError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(64 * 1024)
    except OSError as exc:
        raise TokenFileError(path, f"cannot read the token file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TokenFileError(path, f"not a text file (byte {exc.start} is not UTF-8)") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not _TOKEN.fullmatch(line):
            raise TokenFileError(path, "the token must be printable ASCII without spaces", number)
        return line
    raise TokenFileError(path, "holds no token")


# --- identities in certificates ---------------------------------------------------------------

TRUST_DOMAIN = "modelyard"
_ROLE_URIS = {f"spiffe://{TRUST_DOMAIN}/role/{role}": role for role in ROLES}


def role_uri(role: str) -> str:
    """The URI SAN that gives a REST client's certificate `role`."""
    return f"spiffe://{TRUST_DOMAIN}/role/{role}"


def role_from_uri(uri: str) -> str | None:
    """The role a REST client's certificate URI SAN names (exactly `spiffe://modelyard/role/read` or
    `.../role/write`), or None."""
    return _ROLE_URIS.get(uri)


@dataclass(frozen=True)
class AgentIdentity:
    """Who an agent proved to be: a server and one replica of it, or (`replica` None) any replica."""

    server: str
    replica: int | None = None

    def allows(self, server: str, replica: int) -> bool:
        return server == self.server and (self.replica is None or replica == self.replica)

    def __str__(self) -> str:
        return f"{self.server}-{self.replica}" if self.replica is not None else f"{self.server} (any replica)"

    @property
    def uri(self) -> str:
        """As a certificate's URI SAN names it."""
        base = f"spiffe://{TRUST_DOMAIN}/server/{self.server}"
        return base if self.replica is None else f"{base}/replica/{self.replica}"

    @classmethod
    def from_uri(cls, uri: str) -> AgentIdentity | None:
        """`spiffe://modelyard/server/<server>[/replica/<n>]` as an identity; None for anything else."""
        try:
            parts = urlsplit(uri)
        except ValueError:
            return None
        if parts.scheme != "spiffe" or parts.netloc != TRUST_DOMAIN or parts.query or parts.fragment:
            return None
        segments = parts.path.split("/")
        # "", "server", <server> [, "replica", <n>]
        if len(segments) not in (3, 5) or segments[0] != "" or segments[1] != "server" or not segments[2]:
            return None
        if len(segments) == 3:
            return cls(segments[2])
        if segments[3] != "replica" or not segments[4].isascii() or not segments[4].isdigit():
            return None
        return cls(segments[2], int(segments[4]))
