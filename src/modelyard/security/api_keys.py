"""API keys and the tenants they belong to, from a keys file (the gateway's `auth.keys_file`).

    tenants:
      - name: team-a
        models: [chat, embedder]     # the models (and graphs) its keys may use; ["*"]: all
        priority: 0                  # under overload higher is served first, lower shed first
    keys:
      - name: team-a-ci              # how lists, logs and usage name the key: never the key
        tenant: team-a
        key: sk-...                  # or sha256: <64 hex digits>, so the file never holds the key
        models: [chat]               # optional: fewer than its tenant's
        priority: 1                  # optional: its tenant's otherwise

Only each key's SHA-256 is kept. A key a client shows is hashed and looked up by that hash (a
dictionary: what its timing could tell is about the hash, which says nothing of the key). A problem
with the file is a ConfigError naming the file and the field (`keys[2].tenant`), never quoting a
key. `ApiKeys` reads the file again when it changes (a rotated Kubernetes Secret, a key revoked by
editing the file), keeping the last good table when the new file cannot be used.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from modelyard.config import read_yaml
from modelyard.errors import ConfigError
from modelyard.security.tokens import WatchedFile, bearer_token
from modelyard.tenancy import Limits, Scope, parse_limits

ALL_MODELS = "*"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")  # what a label or log line may carry
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[\x21-\x7e]{8,512}")  # printable ASCII, no spaces: what a header carries
_TENANT_FIELDS = frozenset({"name", "models", "priority", "limits"})
_KEY_FIELDS = frozenset({"name", "tenant", "key", "sha256", "models", "priority", "limits", "created"})
_PRIORITIES = range(-100, 101)


class Caller(NamedTuple):
    """Who a key says is calling: its tenant, the key's name, the models it may use (None: every
    one), its priority under overload (higher is served first and shed last), and the limits it
    counts against (its tenant's, its own: only those that set any)."""

    tenant: str
    key: str
    models: frozenset[str] | None
    priority: int = 0
    scopes: tuple[Scope, ...] = ()

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class Tenant(NamedTuple):
    name: str
    models: frozenset[str] | None
    priority: int
    limits: Limits


def key_digest(key: str) -> bytes:
    # (header values arrive decoded with surrogateescape: a key of stray bytes hashes, never raises)
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyTable:
    """The keys of one keys file, by their SHA-256, and its tenants."""

    def __init__(self, callers: Mapping[bytes, Caller], tenants: Mapping[str, Tenant]) -> None:
        self._callers = dict(callers)
        self.tenants = dict(tenants)

    def lookup(self, key: str) -> Caller | None:
        return self._callers.get(key_digest(key))

    def get(self, digest: bytes) -> Caller | None:
        return self._callers.get(digest)

    def callers(self) -> list[Caller]:
        return list(self._callers.values())

    def __len__(self) -> int:
        return len(self._callers)


def parse_keys(data: object, source: str, known_models: Collection[str] | None) -> KeyTable:
    """The table of a keys file's contents; a ConfigError naming `source` and the field path of every
    problem. `known_models`: the models and graphs a key may name (None: any, as when the gateway
    follows a scheduler whose models are not known until placed)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError(source, ["expected a mapping with tenants: and keys:"])
    for field in sorted(set(data) - {"tenants", "keys"}):
        problems.append(f"{field}: unknown field (expected tenants, keys)")
    tenants: dict[str, Tenant] = {}
    for index, entry in enumerate(_list(data.get("tenants"), "tenants", problems)):
        where = f"tenants[{index}]"
        if not _mapping(entry, where, _TENANT_FIELDS, problems):
            continue
        name = _name(entry.get("name"), f"{where}.name", problems)
        models = _models(entry.get("models"), f"{where}.models", known_models, problems, required=True)
        priority = _priority(entry.get("priority", 0), f"{where}.priority", problems)
        limits = parse_limits(entry.get("limits"), f"{where}.limits", problems)
        if name is not None:
            if name in tenants:
                problems.append(f"{where}.name: tenant {name!r} is defined twice")
            tenants[name] = Tenant(name, models, priority, limits)
    callers: dict[bytes, Caller] = {}
    first: dict[bytes, int] = {}
    names: dict[str, int] = {}
    for index, entry in enumerate(_list(data.get("keys"), "keys", problems)):
        where = f"keys[{index}]"
        parsed = parse_key(entry, where, tenants, known_models, problems)
        if parsed is None:
            continue
        digest, caller = parsed
        if caller.key in names:
            problems.append(
                f"{where}.name: {caller.key!r} names keys[{names[caller.key]}] too: each key's name once"
            )
        names.setdefault(caller.key, index)
        if digest in first:
            problems.append(f"{where}: the same key as keys[{first[digest]}]: each key once")
        first.setdefault(digest, index)
        callers[digest] = caller
    if problems:
        raise ConfigError(source, problems)
    return KeyTable(callers, tenants)


def parse_key(
    entry: object,
    where: str,
    tenants: Mapping[str, Tenant],
    known_models: Collection[str] | None,
    problems: list[str],
) -> tuple[bytes, Caller] | None:
    """One key's entry (of the keys file, or made at runtime) as its hash and its Caller; None,
    with its problems added, when it cannot be used."""
    if not _mapping(entry, where, _KEY_FIELDS, problems):
        return None
    assert isinstance(entry, dict)
    before = len(problems)
    name = _name(entry.get("name"), f"{where}.name", problems)
    tenant = tenants.get(entry["tenant"]) if isinstance(entry.get("tenant"), str) else None
    if tenant is None:
        known = ", ".join(sorted(tenants)) or "none"
        problems.append(
            f"{where}.tenant: expected one of the tenants ({known}), got {_shown(entry.get('tenant'))}"
        )
    digest = _digest(entry, where, problems)
    models = _models(entry.get("models"), f"{where}.models", known_models, problems, required=False)
    if tenant is not None and models is not None and tenant.models is not None:
        beyond = sorted(models - tenant.models)
        if beyond:
            problems.append(
                f"{where}.models: {', '.join(beyond)} not among the models of tenant {tenant.name!r}"
            )
    priority = entry.get("priority")
    if priority is not None:
        priority = _priority(priority, f"{where}.priority", problems)
    limits = parse_limits(entry.get("limits"), f"{where}.limits", problems)
    if len(problems) > before or name is None or tenant is None or digest is None:
        return None
    scopes = tuple(
        scope
        for scope in (Scope(f"tenant/{tenant.name}", tenant.limits), Scope(f"key/{name}", limits))
        if scope.limits.any
    )
    return digest, Caller(
        tenant.name,
        name,
        models if models is not None else tenant.models,
        priority if priority is not None else tenant.priority,
        scopes,
    )


def load_keys(path: str, known_models: Collection[str] | None) -> KeyTable:
    """The keys file's table; a ConfigError naming the file otherwise."""
    return parse_keys(read_yaml(Path(path)), path, known_models)


def _list(value: object, where: str, problems: list[str]) -> list[Any]:
    if value is None:
        problems.append(f"{where}: missing (a list)")
        return []
    if not isinstance(value, list):
        problems.append(f"{where}: expected a list, got {type(value).__name__}")
        return []
    return value


def _mapping(entry: object, where: str, fields: frozenset[str], problems: list[str]) -> bool:
    if not isinstance(entry, dict):
        problems.append(f"{where}: expected a mapping, got {type(entry).__name__}")
        return False
    for field in sorted(set(map(str, entry)) - fields):
        problems.append(f"{where}.{field}: unknown field (expected {', '.join(sorted(fields))})")
    return True


def _name(value: object, where: str, problems: list[str]) -> str | None:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    problems.append(f"{where}: expected a name of letters, digits and ._:@/- (1-128), got {_shown(value)}")
    return None


def _priority(value: object, where: str, problems: list[str]) -> int:
    if type(value) is int and value in _PRIORITIES:
        return value
    problems.append(
        f"{where}: expected a whole number from -100 to 100 (higher: served first), got {_shown(value)}"
    )
    return 0


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _models(
    value: object, where: str, known: Collection[str] | None, problems: list[str], *, required: bool
) -> frozenset[str] | None:
    """The names listed (None: all, from ["*"], or nothing listed where that is allowed)."""
    if value is None:
        if required:
            problems.append(f'{where}: missing (a list of models, or ["*"] for all)')
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        problems.append(f"{where}: expected a list of model names, got {_shown(value)}")
        return None
    if ALL_MODELS in value:
        if len(value) > 1:
            problems.append(f'{where}: "*" means every model: list it alone')
        return None
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            problems.append(
                f"{where}: unknown model {', '.join(map(repr, unknown))} "
                f"(models and graphs: {', '.join(sorted(known)) or 'none'})"
            )
    return frozenset(value)


def _digest(entry: Mapping[str, Any], where: str, problems: list[str]) -> bytes | None:
    key, hashed = entry.get("key"), entry.get("sha256")
    if (key is None) == (hashed is None):
        problems.append(f"{where}: give the key (key:) or its SHA-256 (sha256:), one of them")
        return None
    if key is not None:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            # (never quoted: it may be a real key, put on the wrong line)
            problems.append(f"{where}.key: expected 8 to 512 printable ASCII characters without spaces")
            return None
        return key_digest(key)
    if not isinstance(hashed, str) or not _SHA256.fullmatch(hashed.lower()):
        problems.append(f"{where}.sha256: expected 64 hexadecimal digits (sha256sum of the key)")
        return None
    return bytes.fromhex(hashed)


class ApiKeys(WatchedFile[KeyTable]):
    """A keys file's table, read again when it changes (WatchedFile: a change that cannot be used
    keeps the keys read before)."""

    def __init__(
        self, path: str, known_models: Collection[str] | None, *, reload_interval: float = 2.0
    ) -> None:
        super().__init__(
            path, lambda p: load_keys(p, known_models), "API keys", reload_interval=reload_interval
        )

    def lookup(self, key: str) -> Caller | None:
        return self.table.lookup(key)


def presented_key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a request shows: `Authorization: Bearer <key>` (OpenAI's clients), else `api-key:
    <key>` (Azure OpenAI's). None when neither is there; ValueError, saying what is wrong, for an
    Authorization field that is not a bearer token."""
    if authorization is not None:
        token = bearer_token(authorization)
        if token is None or " " in token:
            raise ValueError("the Authorization header must be 'Bearer <API key>'")
        return token
    if api_key is not None:
        return api_key.strip() or None
    return None


def known_names(models: Iterable[str], graphs: Iterable[str]) -> frozenset[str]:
    return frozenset((*models, *graphs))
