"""The keys file: tenants and their API keys, kept hashed; every problem named by its field path and
the file, never quoting a key; read again when it changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from modelyard.errors import ConfigError
from modelyard.security.api_keys import ApiKeys, Caller, parse_keys, presented_key

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"
MODELS = {"chat", "embed", "pipeline"}


def keys_file(**overrides: object) -> dict[str, object]:
    data: dict[str, object] = {
        "tenants": [{"name": "team-a", "models": ["chat", "embed"]}, {"name": "team-b", "models": ["*"]}],
        "keys": [
            {"name": "a-ci", "tenant": "team-a", "key": KEY_A, "models": ["chat"]},
            {"name": "b-all", "tenant": "team-b", "sha256": hashlib.sha256(KEY_B.encode()).hexdigest()},
        ],
    }
    data.update(overrides)
    return data


def problems(data: object, known: set[str] | None = MODELS) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_keys(data, "keys.yaml", known)
    assert caught.value.source == "keys.yaml"
    return caught.value.problems


def test_keys_name_their_tenant_and_the_models_they_may_use() -> None:
    table = parse_keys(keys_file(), "keys.yaml", MODELS)
    a = table.lookup(KEY_A)
    assert a == Caller("team-a", "a-ci", frozenset({"chat"}))
    assert a.may_use("chat") and not a.may_use("embed")  # narrower than its tenant
    b = table.lookup(KEY_B)  # given by its SHA-256 only
    assert b is not None and b.tenant == "team-b" and b.models is None and b.may_use("anything")
    assert table.lookup("sk-nobody-0000000") is None and table.lookup(KEY_A + " ") is None


def test_a_key_without_models_may_use_its_tenants() -> None:
    data = keys_file(keys=[{"name": "a", "tenant": "team-a", "key": KEY_A}])
    caller = parse_keys(data, "keys.yaml", MODELS).lookup(KEY_A)
    assert caller is not None and caller.models == frozenset({"chat", "embed"})


def key(name: str = "x", tenant: str = "team-a", **fields: object) -> dict[str, object]:
    return {"name": name, "tenant": tenant, **fields}


def tenant(name: str, *models: str) -> dict[str, object]:
    return {"name": name, "models": list(models)}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"keys": [key(key=KEY_A), key("y", "team-b", key=KEY_A)]}, "keys[1]: the same key as keys[0]: each"),
        ({"keys": [key(tenant="team-c", key=KEY_A)]},
         "keys[0].tenant: expected one of the tenants (team-a, team-b), got 'team-c'"),
        ({"tenants": [tenant("team-a", "chat", "nope")]}, "tenants[0].models: unknown model 'nope'"),
        ({"keys": [key(key=KEY_A, models=["pipeline"])]},
         "keys[0].models: pipeline not among the models of tenant 'team-a'"),
        ({"keys": [key(key=KEY_A, sha256="ab" * 32)]}, "keys[0]: give the key (key:) or its SHA-256"),
        ({"keys": [key(sha256="not-hex")]}, "keys[0].sha256: expected 64 hexadecimal"),
        ({"keys": [key(key=KEY_A, owner="x")]}, "keys[0].owner: unknown field"),
        ({"keys": [key(key=KEY_A, limits={"requests_per_minute": 0})]}, "keys[0].limits.requests_per_minute"),
        ({"keys": [key(key=KEY_A, limits={"rpm": 5})]}, "keys[0].limits.rpm: unknown limit"),
        ({"keys": [key(key=KEY_A, priority="high")]}, "keys[0].priority: expected a whole number"),
        ({"tenants": [tenant("team-a", "*", "chat")]}, 'tenants[0].models: "*" means every model'),
        ({"tenants": [tenant("t", "*"), tenant("t", "*")]}, "tenants[1].name: tenant 't' is defined twice"),
        ({"tenants": [tenant("team a", "*")]}, "tenants[0].name: expected a name"),
        ({"keys": [key(key=KEY_A), key(key=KEY_B)]}, "keys[1].name: 'x' names keys[0] too"),
        ({"extra": 1}, "extra: unknown field (expected tenants, keys)"),
        ({"keys": None}, "keys: missing (a list)"),
    ],
)  # fmt: skip
def test_every_problem_is_named_by_its_field(change: dict[str, object], expected: str) -> None:
    found = problems(keys_file(**change))
    assert any(p.startswith(expected) for p in found), found


def test_a_bad_key_is_never_quoted() -> None:
    secret = "sk live with spaces"  # not a key a header can carry
    found = problems(keys_file(keys=[{"name": "x", "tenant": "team-a", "key": secret}]))
    assert found == ["keys[0].key: expected 8 to 512 printable ASCII characters without spaces"]
    assert not any(secret in p for p in found)


def test_models_are_not_checked_when_the_gateway_follows_a_scheduler() -> None:
    data = keys_file(
        tenants=[{"name": "team-a", "models": ["placed-later"]}, {"name": "team-b", "models": ["*"]}]
    )
    data["keys"] = [{"name": "a", "tenant": "team-a", "key": KEY_A}]
    assert parse_keys(data, "keys.yaml", None).lookup(KEY_A) is not None
    assert any("unknown model 'placed-later'" in p for p in problems(data))


def test_the_file_is_read_again_when_it_changes_and_a_bad_change_keeps_the_last_good_keys(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_file()))
    keys = ApiKeys(str(path), MODELS, reload_interval=0.0)
    assert keys.lookup(KEY_A) is not None
    revoked = keys_file()
    revoked["keys"] = revoked["keys"][1:]  # type: ignore[index]
    path.write_text(yaml.safe_dump(revoked))
    os.utime(path, ns=(1, 1))  # (a new mtime even within the filesystem's granularity)
    assert keys.lookup(KEY_A) is None and keys.lookup(KEY_B) is not None
    path.write_text("keys: [")  # not YAML: logged, the keys read before stay
    os.utime(path, ns=(2, 2))
    assert keys.lookup(KEY_B) is not None


def test_a_kubernetes_secret_volume_update_is_seen(tmp_path: Path) -> None:
    """The kubelet updates a Secret's (projected) volume as its AtomicWriter does: the files in a
    new timestamped folder, then the `..data` link swapped to it by a rename; the path the config
    names is a link through `..data`. The file's stat, links followed, is a new inode, even with
    the same size and modification time."""
    first = tmp_path / "..2026_12_05_17_00_00.1"
    first.mkdir()
    (first / "api-keys.yaml").write_text(yaml.safe_dump(keys_file()))
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "api-keys.yaml").symlink_to("..data/api-keys.yaml")
    path = tmp_path / "api-keys.yaml"
    keys = ApiKeys(str(path), MODELS, reload_interval=0.0)
    assert keys.lookup(KEY_A) is not None
    swapped = keys_file()
    swapped["keys"][0]["key"] = KEY_A.replace("0", "1")  # type: ignore[index]  # same size
    second = tmp_path / "..2026_12_05_17_01_00.2"
    second.mkdir()
    (second / "api-keys.yaml").write_text(yaml.safe_dump(swapped))
    old = (first / "api-keys.yaml").stat()
    os.utime(second / "api-keys.yaml", ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (second / "api-keys.yaml").stat().st_size == old.st_size
    (tmp_path / "..data_tmp").symlink_to(second.name)
    os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
    (first / "api-keys.yaml").unlink()
    first.rmdir()
    assert keys.lookup(KEY_A) is None
    assert keys.lookup(KEY_A.replace("0", "1")) is not None


def test_a_missing_or_unreadable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        ApiKeys(str(tmp_path / "absent.yaml"), MODELS)
    assert "absent.yaml" in str(caught.value)


@pytest.mark.parametrize(
    ("authorization", "api_key", "expected"),
    [
        ("Bearer sk-1", None, "sk-1"),
        ("bearer   sk-1 ", None, "sk-1"),
        (None, "sk-2", "sk-2"),
        ("Bearer sk-1", "sk-2", "sk-1"),  # OpenAI's header first
        (None, None, None),
        (None, "  ", None),
    ],
)
def test_the_key_a_request_shows(
    authorization: str | None, api_key: str | None, expected: str | None
) -> None:
    assert presented_key(authorization, api_key) == expected


@pytest.mark.parametrize("authorization", ["Basic dXNlcjpwdw==", "Bearer", "Bearer a b", "sk-1"])
def test_an_authorization_field_that_is_not_a_bearer_token_is_refused(authorization: str) -> None:
    with pytest.raises(ValueError, match="Bearer <API key>"):
        presented_key(authorization, None)
