"""Where keys made at runtime (POST /admin/keys, `modelyard key create`) are kept: a Redis hash
every gateway on that Redis reads, or a JSON file every worker of one gateway reads.

An entry is the keys file's entry for one key (name, tenant, sha256, models, priority, limits) plus
when it was made; never the key itself. Each store has a `version` that changes with every change,
cheap to read: the gateways poll it (security/api_keys.py RuntimeKeys) and load the whole table
when it moved, so that a key revoked on one gateway is refused by every other within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from modelyard.errors import StateUnavailable

Entry = dict[str, Any]
log = logging.getLogger("modelyard.state")
MAX_KEYS = 100_000


class KeyStore(Protocol):
    async def version(self) -> str: ...

    async def load(self) -> list[Entry]: ...

    async def add(self, entry: Entry) -> bool:
        """Keep `entry`; False when a key of its name (or its hash) is there already."""
        ...

    async def remove(self, name: str) -> bool:
        """Forget the key named `name`; False when there is none."""
        ...

    async def close(self) -> None: ...


# KEYS: the entries (sha256 -> entry), the names (name -> sha256), the version counter.
_ADD = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then
  return 0
end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[3])
return 1
"""
_REMOVE = """
local digest = redis.call('HGET', KEYS[2], ARGV[1])
if not digest then return 0 end
redis.call('HDEL', KEYS[1], digest)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
return 1
"""


class StoreFull(Exception):
    pass


def _entries(values: list[Any], where: str) -> list[Entry]:
    """The entries that are ones (a mapping with a name and a hash), each as it was kept; anything
    else (a hand edit, another program's key) is logged and left out, never a failure of all."""
    entries = []
    for value in values:
        try:
            entry = orjson.loads(value) if isinstance(value, str | bytes) else value
        except orjson.JSONDecodeError:
            entry = None
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("sha256"), str)
        ):
            entries.append(entry)
        else:
            log.warning("%s: a runtime key entry that is not one is left out: %.80r", where, value)
    return entries


class RedisKeyStore:
    def __init__(self, url: str, *, key_prefix: str = "modelyard:", timeout: float = 0.25) -> None:
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
        self._keys = [key_prefix + "keys", key_prefix + "keys:names", key_prefix + "keys:version"]
        self._timeout = timeout
        self._add = self._client.register_script(_ADD)
        self._remove = self._client.register_script(_REMOVE)

    async def version(self) -> str:
        return str(await self._call(self._client.get(self._keys[2])) or "0")

    async def load(self) -> list[Entry]:
        values = await self._call(self._client.hvals(self._keys[0]), slow=True)
        return _entries(values, "redis")

    async def add(self, entry: Entry) -> bool:
        added = await self._call(
            self._add(keys=self._keys, args=[entry["name"], entry["sha256"], orjson.dumps(entry), MAX_KEYS])
        )
        if added == -1:
            raise StoreFull(f"the store holds {MAX_KEYS} keys already")
        return bool(added)

    async def remove(self, name: str) -> bool:
        return bool(await self._call(self._remove(keys=self._keys, args=[name])))

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, call: Any, *, slow: bool = False) -> Any:
        try:
            async with asyncio.timeout(self._timeout * (8 if slow else 1)):
                return await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis key store failed: {exc!r}") from exc


class FileKeyStore:
    """A JSON file of entries, changed under an exclusive lock of a file beside it and replaced
    whole (a reader sees the old file or the new one, never half of one)."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    async def version(self) -> str:
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return "0"
        except OSError as exc:
            raise StateUnavailable(f"{self._path}: cannot read the runtime keys: {exc}") from exc
        return f"{stat.st_ino}:{stat.st_mtime_ns}:{stat.st_size}"

    async def load(self) -> list[Entry]:
        return await asyncio.to_thread(self._read)

    async def add(self, entry: Entry) -> bool:
        return await asyncio.to_thread(self._changing, self._add_locked, entry)

    async def remove(self, name: str) -> bool:
        return await asyncio.to_thread(self._changing, self._remove_locked, name)

    def _changing(self, change: Callable[[Any], bool], argument: Any) -> bool:
        try:
            return change(argument)
        except OSError as exc:  # (its folder or lock file unwritable, a full disk: 503, not a 500)
            raise StateUnavailable(f"{self._path}: cannot change the runtime keys: {exc}") from exc

    async def close(self) -> None:
        pass

    def _read(self) -> list[Entry]:
        try:
            data = orjson.loads(self._path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, orjson.JSONDecodeError) as exc:
            raise StateUnavailable(f"{self._path}: cannot read the runtime keys: {exc}") from exc
        if not isinstance(data, list):
            raise StateUnavailable(f"{self._path}: expected a JSON list of keys")
        return _entries(data, str(self._path))

    def _add_locked(self, entry: Entry) -> bool:
        with self._locked():
            entries = self._read()
            if any(e["name"] == entry["name"] or e["sha256"] == entry["sha256"] for e in entries):
                return False
            if len(entries) >= MAX_KEYS:
                raise StoreFull(f"the store holds {MAX_KEYS} keys already")
            self._write([*entries, entry])
            return True

    def _remove_locked(self, name: str) -> bool:
        with self._locked():
            entries = self._read()
            kept = [e for e in entries if e["name"] != name]
            if len(kept) == len(entries):
                return False
            self._write(kept)
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self._path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, entries: list[Entry]) -> None:
        temporary = self._path.with_name(self._path.name + ".new")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # hashes only, still private
        with os.fdopen(fd, "wb") as file:
            file.write(orjson.dumps(entries, option=orjson.OPT_INDENT_2))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self._path)
