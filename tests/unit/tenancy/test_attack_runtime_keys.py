"""Attack: runtime keys (gateway/runtime_keys.py, state/key_store.py)."""

import contextlib
import os

import orjson
import pytest
import redis.asyncio as aioredis

from modelyard.errors import ModelyardError
from modelyard.gateway.runtime_keys import RuntimeKeys
from modelyard.security.api_keys import key_digest, parse_keys
from modelyard.state.key_store import FileKeyStore, RedisKeyStore

TENANTS = [{"name": "team-a", "models": ["*"]}]


def table(keys):
    return parse_keys({"tenants": TENANTS, "keys": keys}, "keys.yaml", None)


async def test_a_runtime_key_stays_revocable_when_the_keys_file_gains_a_key_of_its_name(tmp_path):
    current = {"table": table([])}
    runtime = RuntimeKeys(FileKeyStore(str(tmp_path / "rk.json")), lambda: current["table"], None, 60.0)
    made = await runtime.create({"name": "ci", "tenant": "team-a"})
    # the operator adds a key of the same name to the keys file (another key)
    current["table"] = table([{"name": "ci", "tenant": "team-a", "key": "sk-file-key-0001"}])
    await runtime.refresh()
    with contextlib.suppress(ModelyardError):
        await runtime.revoke("ci")
    await runtime.refresh()
    assert runtime.get(key_digest(made["key"])) is None, (
        "the runtime key can no longer be revoked, and still works"
    )


async def test_unwritable_runtime_keys_file_is_a_clean_error_not_an_oserror(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    runtime = RuntimeKeys(FileKeyStore(str(blocker / "rk.json")), lambda: table([]), None, 60.0)
    with pytest.raises(ModelyardError):  # (anything else is a 500)
        await runtime.create({"name": "ci", "tenant": "team-a"})


async def test_a_stray_entry_in_the_runtime_keys_file_does_not_break_listing_and_creating(tmp_path):
    path = tmp_path / "rk.json"
    path.write_bytes(orjson.dumps([None]))  # a hand edit, a bad merge
    runtime = RuntimeKeys(FileKeyStore(str(path)), lambda: table([]), None, 60.0)
    await runtime.start()
    try:
        await runtime.listed()  # GET /admin/keys
        await runtime.create({"name": "ci", "tenant": "team-a"})  # POST /admin/keys
    finally:
        await runtime.stop()


async def test_a_tampered_redis_entry_does_not_stop_the_gateway_or_listing(redis_url):
    prefix = f"atk-{os.urandom(4).hex()}:"
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(prefix + "keys", "ab" * 32, "{not json")
    await client.incr(prefix + "keys:version")
    await client.aclose()
    runtime = RuntimeKeys(
        RedisKeyStore(redis_url, key_prefix=prefix, timeout=2.0), lambda: table([]), None, 60.0
    )
    await runtime.start()  # the gateway's startup
    try:
        await runtime.listed()
    finally:
        await runtime.stop()


async def test_a_stray_field_in_the_redis_usage_hash_does_not_break_get_admin_usage(redis_url):
    import time

    from modelyard.state.quotas import RedisQuotas, usage_day

    prefix = f"atk-{os.urandom(4).hex()}:"
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(f"{prefix}quota:usage:{usage_day(time.time())}", "junk", "x")
    await client.aclose()
    store = RedisQuotas(redis_url, key_prefix=prefix, timeout=2.0)
    try:
        await store.usage(usage_day(time.time()))  # GET /admin/usage: a 500 for the whole day otherwise
    finally:
        await store.close()
