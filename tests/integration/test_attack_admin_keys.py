"""Attack: the admin keys API of a real gateway (runtime keys in a file)."""

from __future__ import annotations

from pathlib import Path

import yaml

from support import model_config

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
KEY_A = "sk-team-a-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def start(sim_workers, gateways, tmp_path: Path, store: Path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [{"name": "a", "models": ["chat"]}],
                "keys": [{"name": "a-app", "tenant": "a", "key": KEY_A}],
            }
        )
    )
    workers = await sim_workers(1)
    return await gateways(
        [model_config("chat", workers)],
        auth={
            "enabled": True,
            "keys_file": str(path),
            "runtime_keys_file": str(store),
            "key_refresh_interval": 0.1,
        },
        admin={"token": ADMIN},
    )


async def test_a_key_named_with_a_slash_can_be_revoked(sim_workers, gateways, http, tmp_path):
    gateway = await start(sim_workers, gateways, tmp_path, tmp_path / "rk.json")
    async with http.post(
        gateway.url + "/admin/keys", json={"name": "team/ci", "tenant": "a"}, headers=bearer(ADMIN)
    ) as r:
        assert r.status == 201  # the name's rules allow a slash
        key = (await r.json())["key"]
    # as `modelyard key revoke team/ci` sends it (admin_client.revoke_key: quote(name, safe=""))
    async with http.delete(gateway.url + "/admin/keys/team%2Fci", headers=bearer(ADMIN)) as r:
        assert r.status == 200, (r.status, await r.text())
    async with http.post(
        gateway.url + CHAT, json={"model": "chat", "messages": [], "max_tokens": 1}, headers=bearer(key)
    ) as r:
        assert r.status == 401


async def test_an_unwritable_runtime_keys_file_is_not_a_500(sim_workers, gateways, http, tmp_path):
    store = tmp_path / "rk.json"
    gateway = await start(sim_workers, gateways, tmp_path, store)
    # the store cannot be written any more (a read-only volume, a full disk: an OSError all the same)
    (tmp_path / "rk.json.lock").mkdir()
    async with http.post(
        gateway.url + "/admin/keys", json={"name": "ci", "tenant": "a"}, headers=bearer(ADMIN)
    ) as r:
        assert r.status != 500, await r.text()


async def test_a_stray_entry_in_the_runtime_keys_file_is_not_a_500(sim_workers, gateways, http, tmp_path):
    store = tmp_path / "rk.json"
    store.write_text("[null]")
    gateway = await start(sim_workers, gateways, tmp_path, store)
    async with http.get(gateway.url + "/admin/keys", headers=bearer(ADMIN)) as r:
        assert r.status == 200, await r.text()
    async with http.post(
        gateway.url + "/admin/keys", json={"name": "ci", "tenant": "a"}, headers=bearer(ADMIN)
    ) as r:
        assert r.status == 201, await r.text()
