"""One error tree; each service translates it into its envelope at the edge (serving/errors.py).

    ModelyardError                      500 internal_error
    ├── ConfigError                     (startup: one line, exit 1)
    ├── BadRequest                      400 invalid_request_error
    │   ├── MalformedRequest            400 (a request head that is not HTTP; the connection closes)
    │   ├── HeaderFieldsTooLarge        431 (a header line over the limit, or too many headers)
    │   ├── MalformedBody               400
    │   ├── UnknownStrategy             400
    │   ├── GraphInvalid                400 (every problem of a graph, with its path)
    │   ├── RoutesInvalid               400 (every problem of a routes update, with its path)
    │   └── ModelSpecInvalid            400 (every problem of a model spec to place, with its path)
    ├── Unauthorized                    401 authentication_error
    │   ├── MissingCredentials          401 (no credential at all)
    │   ├── InvalidToken                401 (a bearer token no table holds)
    │   ├── ApiKeyMissing               401 (an inference call without an API key, auth on)
    │   └── ApiKeyInvalid               401 (an API key no keys file holds, or not a bearer token)
    ├── Forbidden                       403 permission_error (a credential whose role does not allow it)
    │   └── ModelNotAllowed             403 (an API key whose tenant may not use the model)
    ├── NotFound                        404 not_found_error
    │   └── ModelNotFound               404 model_not_found
    ├── MethodNotAllowed                405 method_not_allowed
    ├── Conflict                        409 conflict
    │   └── ModelBeingDeleted           409 (a model applied again while its deletion still unloads)
    ├── RequestTimeout                  408 (the request head took longer than listen.header_timeout)
    ├── PayloadTooLarge                 413 request_too_large
    ├── Overloaded                      429 rate_limit_error (with Retry-After)
    ├── QuotaExceeded                   429 rate_limit_exceeded (a key's or tenant's requests, tokens
    │   │                                    or concurrent requests; Retry-After, x-ratelimit-*)
    │   └── BudgetExceeded              429 insufficient_quota (its spend budget for the period)
    ├── QuotaStoreUnavailable           503 (auth.quota_store_down: refuse, and Redis is away)
    ├── ChangeNotShared                 503 (an admin change the other workers could not be given:
    │                                        not applied anywhere)
    ├── UpstreamError                   502 upstream_error
    │   ├── UpstreamUnreachable         502 (connect failed: nothing was sent, safe to try elsewhere)
    │   ├── UpstreamClosed              502 (the server closed the connection before any answer byte)
    │   ├── EndpointTakenOut            502 (its endpoint failed a health check or was ejected
    │   │                                    before any answer byte: retried elsewhere, as a reset)
    │   ├── ModelServerRefused          502 (an inference server's repository API answered an error;
    │   │                                    the message carries its status and error text)
    │   └── UpstreamTimeout             504 upstream_timeout
    ├── ModelServerAnswered             (the server's status: a model server's error answer to an
    │                                    OIP gRPC call, carried to its gRPC code)
    ├── NoHealthyEndpoint               503 service_unavailable
    ├── ModelNotPlaced                  503 (applied to the scheduler, not yet Available; Retry-After)
    ├── SchedulerUnavailable            503 (the scheduler or an agent stream could not be reached)
    ├── ModelNotResident                503 (an agent could not load an evicted model back for a request)
    ├── TooManyConnections              503 (listen.max_connections open; with Retry-After)
    ├── TooManyLogStreams               503 (admin.max_log_streams live-log streams open; Retry-After)
    ├── StoreWriteFailed                500 (the scheduler could not write its database; the change
    │                                        stays in memory and is written with the next one)
    └── StateUnavailable                503 (internal: the gateway falls back to local state)

Each class carries its HTTP `status` and wire `error_type`; the OpenAI envelope uses
`error_type` as `type` and `code`, the OIP and KServe v1 envelopes carry only the message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class ModelyardError(Exception):
    status: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class ConfigError(ModelyardError):
    """A configuration that cannot be used. `problems` holds one line per field error."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        joined = "; ".join(self.problems)
        super().__init__(f"{source}: {joined}")


class BadRequest(ModelyardError):
    status = 400
    error_type = "invalid_request_error"


class MalformedRequest(BadRequest):
    code = "malformed_request"


class HeaderFieldsTooLarge(BadRequest):
    status = 431
    code = "request_header_fields_too_large"


class MalformedBody(BadRequest):
    code = "invalid_json"


class UnknownStrategy(BadRequest):
    code = "unknown_strategy"

    def __init__(self, name: object, valid: Iterable[str]) -> None:
        super().__init__(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(valid))}")


class GraphInvalid(BadRequest):
    code = "invalid_graph"

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


class RoutesInvalid(BadRequest):
    code = "invalid_routes"

    def __init__(self, model: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"routes of model {model!r}: " + "; ".join(self.problems))


class ModelSpecInvalid(BadRequest):
    code = "invalid_model_spec"

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


class Unauthorized(ModelyardError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_admin_token"


class MissingCredentials(Unauthorized):
    code = "missing_credentials"


class InvalidToken(Unauthorized):
    code = "invalid_token"


class ApiKeyMissing(Unauthorized):
    code = "missing_api_key"


class ApiKeyInvalid(Unauthorized):
    code = "invalid_api_key"


class Forbidden(ModelyardError):
    status = 403
    error_type = "permission_error"
    code = "insufficient_role"


class ModelNotAllowed(Forbidden):
    code = "model_not_allowed"


class NotFound(ModelyardError):
    status = 404
    error_type = "not_found_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: object, known: Iterable[str]) -> None:
        self.model = model if isinstance(model, str) else ""  # as asked: the routing log names it
        names = ", ".join(sorted(known)) or "(none)"
        what = "no model given" if not model else f"model {model!r} not found"
        super().__init__(f"{what}; known models: {names}")


class MethodNotAllowed(ModelyardError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(ModelyardError):
    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class ModelBeingDeleted(Conflict):
    code = "model_being_deleted"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"model {model!r} is being deleted and still unloading; apply it again once it is terminated"
        )


class RequestTimeout(ModelyardError):
    status = 408
    error_type = "invalid_request_error"
    code = "header_timeout"


class PayloadTooLarge(ModelyardError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(ModelyardError):
    """Every endpoint is at its in-flight limit and the wait queue is full or timed out."""

    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class QuotaExceeded(ModelyardError):
    """A key or its tenant is over one of its limits (tenancy/limits.py)."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BudgetExceeded(QuotaExceeded):
    error_type = "insufficient_quota"
    code = "insufficient_quota"


class QuotaStoreUnavailable(ModelyardError):
    status = 503
    error_type = "service_unavailable"
    code = "quota_store_unavailable"


class ChangeNotShared(ModelyardError):
    """An admin change the other workers of the gateway could not be given (listen.workers > 1):
    not applied anywhere."""

    status = 503
    error_type = "service_unavailable"
    code = "change_not_shared"


class UpstreamError(ModelyardError):
    status = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamClosed(UpstreamError):
    code = "upstream_closed"


class EndpointTakenOut(UpstreamError):
    code = "endpoint_taken_out"


class ModelServerRefused(UpstreamError):
    """The inference server answered a repository call (load, unload, index) with an error."""

    code = "model_server_refused"

    def __init__(self, message: str, *, server_status: int, server_text: str) -> None:
        super().__init__(message)
        self.server_status = server_status
        self.server_text = server_text


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class ModelServerAnswered(ModelyardError):
    """A model server answered an OIP call (made for a gRPC client) with an error: `status` is the
    server's, so the gRPC code is the one its answer stands for; `grpc_status`, the name of the
    status a server called over gRPC answered with (e.g. "FAILED_PRECONDITION"), is passed on as
    it was."""

    def __init__(self, status: int, message: str, *, grpc_status: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.grpc_status = grpc_status


class NoHealthyEndpoint(ModelyardError):
    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_endpoint"


class ModelNotPlaced(ModelyardError):
    """A model the scheduler knows but that has no replica to route to yet (or any more)."""

    status = 503
    error_type = "service_unavailable"
    code = "model_not_available"

    def __init__(self, model: str, state: str, reason: str = "", retry_after: int = 2) -> None:
        self.model = model
        self.state = state
        self.reason = reason
        why = f": {reason}" if reason else ""
        super().__init__(
            f"model {model!r} is not available yet (state {state}{why})",
            headers={"Retry-After": str(retry_after)},
        )


class SchedulerUnavailable(ModelyardError):
    status = 503
    error_type = "service_unavailable"
    code = "scheduler_unavailable"


class ModelNotResident(ModelyardError):
    """An agent could not get a model it holds into the server's memory for a request: the reload
    failed, or every model in memory kept serving requests until the agent's room timeout."""

    status = 503
    error_type = "service_unavailable"
    code = "model_not_resident"


class TooManyConnections(ModelyardError):
    status = 503
    error_type = "service_unavailable"
    code = "too_many_connections"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class TooManyLogStreams(ModelyardError):
    """Every live-log stream the gateway allows is open: each one costs every request a queue put."""

    status = 503
    error_type = "service_unavailable"
    code = "too_many_log_streams"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "5"})


class StoreWriteFailed(ModelyardError):
    """The scheduler's database refused a write (locked, disk full, read-only). The change is kept in
    memory, marked unwritten, and written with the next mutation or retry; what it would have sent
    to agents and feed readers waits for that write."""

    code = "store_write_failed"


class StateUnavailable(ModelyardError):
    """The shared store did not answer in time; the gateway falls back to local state."""

    status = 503
    error_type = "service_unavailable"
