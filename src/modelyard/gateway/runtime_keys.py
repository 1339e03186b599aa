"""Keys made, listed and revoked at runtime (POST, GET and DELETE /admin/keys; `modelyard key`),
beside the keys file's.

They are kept in a store every worker and gateway reads (state/key_store.py: Redis with the redis
backend, else `auth.runtime_keys_file`). Each worker checks the store's version every
`auth.key_refresh_interval` and loads the table again when it moved, so a lookup on the request
path reads memory only, and a key revoked anywhere is refused everywhere within about that interval.
While the store does not answer, the last table read stays in use (a revocation made elsewhere
meanwhile takes effect when it answers again); a worker that never read it has no runtime keys.

A key belongs to one of the keys file's tenants, and may use at most its tenant's models; its
entry is kept as the keys file would hold it (a name, a tenant, the key's SHA-256, models,
priority, limits), never the key, which the gateway hands out once, when it makes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Collection
from typing import Any

from modelyard.errors import BadRequest, Conflict, ModelyardError, NotFound, StateUnavailable
from modelyard.security.api_keys import Caller, KeyTable, Tenant, parse_key
from modelyard.state.key_store import KeyStore, StoreFull

log = logging.getLogger("modelyard.gateway")

KEY_PREFIX = "sk-my-"
_CREATE_FIELDS = frozenset({"name", "tenant", "models", "priority", "limits", "key"})


class RuntimeKeys:
    def __init__(
        self,
        store: KeyStore,
        file_table: Callable[[], KeyTable],
        known_models: Collection[str] | None,
        refresh_interval: float,
    ) -> None:
        self._store = store
        self._file_table = file_table  # the keys file's current table: its tenants and names
        self._known = known_models
        self._interval = refresh_interval
        self._version: str | None = None
        self._entries: list[dict[str, Any]] = []
        self._callers: dict[bytes, Caller] = {}
        self._tenants_seen: object = None
        self._task: asyncio.Task[None] | None = None

    def get(self, digest: bytes) -> Caller | None:
        return self._callers.get(digest)

    async def start(self) -> None:
        try:
            await self.refresh()
        except StateUnavailable as exc:  # (the keys file's keys work meanwhile; these come when it answers)
            log.warning("runtime keys: cannot read the store yet: %s", exc)
        self._task = asyncio.create_task(self._refreshing(), name="runtime-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._store.close()

    async def refresh(self) -> None:
        """Load the table again when the store's version moved (or the keys file's tenants did)."""
        version = await self._store.version()
        table = self._file_table()
        if version == self._version and table.tenants is self._tenants_seen:
            return
        entries = await self._store.load() if version != self._version else self._entries
        self._entries, self._version, self._tenants_seen = entries, version, table.tenants
        callers: dict[bytes, Caller] = {}
        file_names = {c.key for c in table.callers()}
        for index, entry in enumerate(entries):
            if entry["name"] in file_names:  # (the file's key of that name wins; this one is revocable)
                log.warning("runtime key %r not used: the keys file has a key of that name", entry["name"])
                continue
            problems: list[str] = []
            parsed = parse_key(entry, f"runtime key {index}", table.tenants, self._known, problems)
            if parsed is None:  # its tenant left the keys file, or lost a model the key names
                log.warning("runtime key not used: %s", "; ".join(problems))
                continue
            digest, caller = parsed
            if table.get(digest) is None:  # (the file's entry for one key wins)
                callers[digest] = caller
        self._callers = callers

    async def _refreshing(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
                if failing:
                    log.info("runtime keys: the store answers again")
                failing = False
            except (StateUnavailable, OSError, ValueError) as exc:
                if not failing:
                    log.warning("runtime keys: cannot read the store, keeping the keys read before: %s", exc)
                failing = True

    async def create(self, body: object) -> dict[str, Any]:
        """Make a key from an admin request's body ({name, tenant, models?, priority?, limits?,
        key?}): its entry as listed, with the key itself, shown this once."""
        if not isinstance(body, dict):
            raise BadRequest("expected a JSON object: {name, tenant, models, priority, limits}")
        unknown = sorted(set(map(str, body)) - _CREATE_FIELDS)
        if unknown:
            expected = ", ".join(sorted(_CREATE_FIELDS))
            raise BadRequest(f"unknown field {', '.join(unknown)} (expected {expected})")
        key = body.get("key")
        if key is None:
            key = KEY_PREFIX + secrets.token_urlsafe(32)
        entry = {k: v for k, v in body.items() if k != "key" and v is not None}
        entry["key"] = key  # (checked as the file's keys are, then only its hash is kept)
        table = self._file_table()
        problems: list[str] = []
        parsed = parse_key(entry, "key", table.tenants, self._known, problems)
        if parsed is None:
            raise BadRequest("; ".join(problems))
        digest, caller = parsed
        if any(c.key == caller.key for c in table.callers()) or table.get(digest) is not None:
            raise Conflict(f"the keys file has a key named {caller.key!r} (or this very key)")
        del entry["key"]
        entry["sha256"] = digest.hex()
        entry["created"] = int(time.time())
        try:
            added = await self._store.add(entry)
        except StoreFull as exc:
            raise Conflict(str(exc)) from None
        if not added:
            raise Conflict(f"a runtime key named {caller.key!r} (or this very key) exists already")
        await self._refresh_now()
        return {**_listed(entry, "runtime"), "key": key}

    async def revoke(self, name: str) -> None:
        """Revoke the runtime key `name` (a keys file's key is revoked by editing the file)."""
        if not await self._store.remove(name):
            if any(c.key == name for c in self._file_table().callers()):
                raise Conflict(f"key {name!r} is in the keys file: remove it there (the file is read again)")
            raise NotFound(f"no runtime key named {name!r}")
        await self._refresh_now()

    async def listed(self) -> list[dict[str, Any]]:
        """Every key, the keys file's and the runtime ones, as the admin API lists them."""
        with contextlib.suppress(StateUnavailable):
            await self.refresh()
        table = self._file_table()
        live = {digest.hex() for digest in self._callers}
        shown = [caller_listed(c) for c in table.callers()]
        shown += [_listed(e, "runtime") for e in self._entries if e.get("sha256") in live]
        return sorted(shown, key=lambda e: (str(e["tenant"]), str(e["name"])))

    async def _refresh_now(self) -> None:
        with contextlib.suppress(ModelyardError):  # stored: else this worker sees it at its next refresh
            await self.refresh()


def _listed(entry: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "name": entry.get("name"),
        "tenant": entry.get("tenant"),
        "models": entry.get("models"),
        "priority": entry.get("priority"),
        "limits": entry.get("limits") or {},
        "source": source,
        "created": entry.get("created"),
    }


def caller_listed(caller: Caller) -> dict[str, Any]:
    own = next((s.limits.plain() for s in caller.scopes if s.name == f"key/{caller.key}"), {})
    return {
        "name": caller.key,
        "tenant": caller.tenant,
        "models": sorted(caller.models) if caller.models is not None else None,
        "priority": caller.priority,
        "limits": own,
        "source": "file",
        "created": None,
    }


def tenant_listed(tenant: Tenant) -> dict[str, Any]:
    """A keys file's tenant as GET /admin/keys lists it: its models (None: every one), priority and
    its own limits (only those set)."""
    return {
        "name": tenant.name,
        "models": sorted(tenant.models) if tenant.models is not None else None,
        "priority": tenant.priority,
        "limits": tenant.limits.plain(),
    }
