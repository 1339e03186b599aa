"""Admission: who is calling an inference route, and whether they may use the model they named,
before anything is routed (auth.enabled; off, nothing here runs).

A call shows an API key as OpenAI's clients send it (`Authorization: Bearer <key>`) or as Azure
OpenAI's do (`api-key: <key>`); the keys and their tenants come from `auth.keys_file`
(security/api_keys.py). No key, or one the file does not hold: 401 (ApiKeyMissing, ApiKeyInvalid),
with `WWW-Authenticate`; a model or graph the key's tenant may not use: 403 (ModelNotAllowed).
Each in the protocol's own envelope (the error middleware, the lean connection and gRPC render
them). The key goes no further than here: the proxy does not forward it to the servers.

Keys made at runtime (gateway/runtime_keys.py) are looked up after the file's. Then `take` lets
the request in against its tenant's and key's limits (gateway/quotas.py), or refuses it with 429.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from modelyard.config import AuthConfig
from modelyard.errors import ApiKeyInvalid, ApiKeyMissing, ModelNotAllowed, ModelyardError
from modelyard.gateway.ledger import ended_with
from modelyard.gateway.quotas import Permit, Quotas
from modelyard.gateway.runtime_keys import RuntimeKeys
from modelyard.security.api_keys import ApiKeys, Caller, key_digest, presented_key

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="modelyard"'}
# Request fields that carry a client's key: never forwarded upstream when auth is on.
CREDENTIAL_FIELDS = frozenset({b"authorization", b"api-key"})


class Admission:
    def __init__(self, config: AuthConfig, known_models: Collection[str] | None) -> None:
        assert config.keys_file is not None  # (AuthConfig refuses enabled without it)
        self.keys = ApiKeys(config.keys_file, known_models)
        self.runtime: RuntimeKeys | None = None  # (set by the gateway when a key store is configured)
        self.quotas: Quotas | None = None  # (set by the gateway)

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """Who the call's key says is calling; 401 without a key the keys file holds."""
        try:
            key = presented_key(headers.get("Authorization"), headers.get("api-key"))
        except ValueError as exc:
            raise ApiKeyInvalid(str(exc), headers=_CHALLENGE) from None
        if key is None:
            raise ApiKeyMissing(
                "this gateway needs an API key: 'Authorization: Bearer <key>' or 'api-key: <key>'",
                headers=_CHALLENGE,
            )
        digest = key_digest(key)
        caller = self.keys.table.get(digest)
        if caller is None and self.runtime is not None:
            caller = self.runtime.get(digest)
        if caller is None:
            raise ApiKeyInvalid(
                "the API key is not one this gateway holds (or it was revoked)", headers=_CHALLENGE
            )
        return caller

    @staticmethod
    def allow(caller: Caller, model: str) -> None:
        """403 when the caller's tenant (or key) may not use `model`."""
        if not caller.may_use(model):
            raise ModelNotAllowed(f"key {caller.key!r} of tenant {caller.tenant!r} may not use {model!r}")

    def admit(self, headers: Mapping[str, str], model: str) -> Caller:
        caller = self.caller(headers)
        self.allow(caller, model)
        return caller

    async def take(self, caller: Caller) -> Permit:
        """Let the caller's request in against its limits (429 when it is over one)."""
        assert self.quotas is not None
        return await self.quotas.take(caller)

    def quotas_end(self, permit: Permit, failed: BaseException | None = None) -> None:
        """The request `take` let in is over (Quotas.end): counted once, its slot freed. `failed`:
        what ended it when it raised; an error the gateway answers itself carries the key's
        x-ratelimit-* fields too, as a relayed answer does."""
        assert self.quotas is not None
        if failed is None:
            self.quotas.end(permit)
            return
        self.quotas.end(permit, ended_with(failed))
        if isinstance(failed, ModelyardError) and permit.fields:
            failed.headers = {**{k.decode(): v.decode() for k, v in permit.fields}, **failed.headers}

    def admit_metadata(self, metadata: Sequence[tuple[str, str]], model: str) -> Caller:
        """`admit` for a gRPC call's metadata (keys lower case)."""
        fields = {k.lower(): v for k, v in reversed(metadata)}  # (the first of a repeated key, as HTTP)
        shown = {name: fields[name] for name in ("authorization", "api-key") if name in fields}
        return self.admit(
            {"Authorization" if k == "authorization" else k: v for k, v in shown.items()}, model
        )
