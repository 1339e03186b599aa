"""Who may call the scheduler's REST API (`RestAccess`) and the agent port (`agent_credentials`),
and the check that a scheduler others can reach is not left open (`check_exposure`).

REST: a bearer token from `tokens_file` (role read or write; write may do everything read may) or
a client certificate verified against `tls.client_ca_file`, whose role is the one its URI SAN names:
`spiffe://modelyard/role/read` or `spiffe://modelyard/role/write` (both: write). Being signed by
the CA gives no role: one CA often signs agents' certificates too (one cert-manager issuer), and an
agent must never apply or delete models. A certificate naming an agent
(`spiffe://modelyard/server/...`) is refused (403), a bearer token beside it notwithstanding; one
naming no role gives none (the request's bearer token, if any, decides; without one, 403). So the
REST client CA and the agent CA may be the same file: the identity in a certificate, not its
issuer, says what it may do. GET and HEAD need read (model and server lists, a model's status, the
gateway feed, /metrics); every other method needs write (apply, delete). /healthz and /readyz stay
open (Kubernetes probes). No credential, or a token no line holds: 401 with
`WWW-Authenticate: Bearer realm="modelyard-scheduler"`; a role too small: 403. Without any REST
credential configured, the API is open (loopback, or `insecure`).
"""

from __future__ import annotations

import logging

from aiohttp import web

from modelyard.config import on_loopback
from modelyard.errors import ConfigError, Forbidden, InvalidToken, MissingCredentials
from modelyard.rpc.agent_server import AgentCredentials
from modelyard.scheduler.config import SchedulerConfig
from modelyard.security.tokens import (
    READ,
    WRITE,
    AgentIdentity,
    TokenFile,
    any_key,
    bearer_token,
    role_from_uri,
    role_key,
    role_uri,
)

log = logging.getLogger("modelyard.scheduler")

REALM = 'Bearer realm="modelyard-scheduler"'
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class RestAccess:
    """The REST API's admission: `check(request)` returns the caller's role or raises 401/403."""

    def __init__(self, tokens: TokenFile | None, certificates: bool) -> None:
        self.tokens = tokens
        self.certificates = certificates

    def check(self, request: web.Request) -> str:
        needed = READ if request.method in _READ_METHODS else WRITE
        role = self._role(request)
        if needed == WRITE and role != WRITE:
            raise Forbidden(
                f"{request.method} {request.path} needs the role write; this credential has {role}"
            )
        return role

    def _role(self, request: web.Request) -> str:
        header = request.headers.get("Authorization")
        token = bearer_token(header)
        shown = self._certificate(request)
        if shown is not None:
            role = certificate_role(shown)
            if role is not None:
                return role
            if token is None:
                raise Forbidden(
                    f"the client certificate names no role: a URI SAN {role_uri(READ)} or "
                    f"{role_uri(WRITE)}" + (", or a bearer token" if self.tokens is not None else "")
                )
        if token is None:
            how = []
            if self.tokens is not None:
                how.append("a bearer token (Authorization: Bearer <token>)")
            if self.certificates:
                how.append("a client certificate")
            said = "an Authorization header that is not a bearer token" if header else "no credential"
            raise MissingCredentials(
                f"the scheduler's API needs {' or '.join(how)}; the request has {said}",
                headers={"WWW-Authenticate": REALM},
            )
        role = self.tokens.lookup(token) if self.tokens is not None else None
        if role is None:
            raise InvalidToken(
                "the bearer token is not one the scheduler knows", headers={"WWW-Authenticate": REALM}
            )
        return role

    def _certificate(self, request: web.Request) -> dict[str, object] | None:
        """The client certificate verified against tls.client_ca_file (Python's getpeercert form)."""
        transport = request.transport
        if not self.certificates or transport is None:
            return None
        shown = transport.get_extra_info("peercert")
        return shown if isinstance(shown, dict) and shown else None


def certificate_role(certificate: dict[str, object]) -> str | None:
    """The role a REST client's verified certificate names in its URI SANs (write over read), None
    when it names none; Forbidden when it names an agent."""
    names = certificate.get("subjectAltName")
    uris = [
        value
        for kind, value in (names if isinstance(names, tuple) else ())
        if kind == "URI" and isinstance(value, str)
    ]
    agents = [uri for uri in uris if AgentIdentity.from_uri(uri) is not None]
    if agents:
        raise Forbidden(
            f"the client certificate names an agent ({agents[0]}): an agent's certificate is no "
            f"credential for the scheduler's API; a client's names its role ({role_uri(READ)} or "
            f"{role_uri(WRITE)})"
        )
    roles = {role for uri in uris if (role := role_from_uri(uri)) is not None}
    return WRITE if WRITE in roles else READ if READ in roles else None


def rest_access(config: SchedulerConfig) -> RestAccess | None:
    """The REST API's admission, or None when it is open; reads the tokens file (TokenFileError)."""
    tokens = (
        TokenFile(config.tokens_file, role_key, reload_interval=config.credential_recheck)
        if config.tokens_file
        else None
    )
    certificates = config.tls is not None and bool(config.tls.client_ca_file)
    if tokens is None and not certificates:
        return None
    return RestAccess(tokens, certificates)


def agent_credentials(config: SchedulerConfig) -> AgentCredentials | None:
    """What the agent port accepts, or None when anyone may call; reads the agent tokens file."""
    tokens = (
        TokenFile(config.agent_tokens_file, any_key, reload_interval=config.credential_recheck)
        if config.agent_tokens_file
        else None
    )
    if tokens is None and not config.agent_ca_file:
        return None
    return AgentCredentials(certificates=bool(config.agent_ca_file), tokens=tokens)


def exposure(config: SchedulerConfig) -> list[str]:
    """What a scheduler on a non-loopback address lacks: TLS, REST or agent credentials."""
    if on_loopback(config.host):
        return []
    missing = []
    if config.tls is None:
        missing.append("TLS (--tls-cert, --tls-key)")
    if not config.rest_credentials:
        missing.append("REST credentials (--tokens-file or --tls-client-ca)")
    if not config.agent_credentials:
        missing.append("agent credentials (--agent-ca or --agent-tokens-file)")
    return missing


def check_exposure(config: SchedulerConfig) -> None:
    """ConfigError when a scheduler others can reach lacks TLS or credentials, unless `insecure`,
    which warns (one line) instead."""
    missing = exposure(config)
    if not missing:
        return
    where = config.host or "(every address)"
    if config.insecure:
        log.warning(
            "--insecure: listening on %s, reachable from other machines, without %s",
            where,
            ", ".join(missing),
        )
        return
    raise ConfigError(
        f"--host {where}",
        [
            f"reachable from other machines, and there is no {', no '.join(missing)}: anyone there could "
            "place models and act as agents; give them, listen on 127.0.0.1, or pass --insecure"
        ],
    )
