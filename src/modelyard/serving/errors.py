"""The one error middleware of modelyard's aiohttp applications (the gateway, the scheduler's REST API,
the agent's data plane): a modelyard error, one of aiohttp's own HTTP errors (no route: 404; a method
the path does not take: 405 with `Allow`; a body over `client_max_size`: 413) and a bug (logged with
its traceback, answered without it) each become one answer in the service's envelope.

What differs between services is a `ServiceErrors`: its name (its log, `modelyard.<service>`, and the
500's "see the <service> log"), the setting a 413 names, whether every answer takes one envelope or
the one its path speaks, and whether answers echo the request's id. An answer that has begun (a
stream's first bytes are out) is not replaced by another: the error goes on to aiohttp, which logs it
and closes the connection, as the lean listener does.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from multidict import CIMultiDict

from modelyard.errors import MethodNotAllowed, ModelyardError, NotFound, PayloadTooLarge
from modelyard.protocols import error_body, protocol_for_path
from modelyard.types import Protocol

# Set by a handler once it knows the request's id, so that an error answered later echoes it too.
REQUEST_ID = web.RequestKey("request_id", str)


def error_answer(
    protocol: Protocol, error: ModelyardError, request_id: str | None = None
) -> tuple[CIMultiDict[str], bytes]:
    """The headers and body answering `error` in `protocol`'s envelope."""
    headers = CIMultiDict(error.headers)
    headers["Content-Type"] = "application/json"
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers, error_body(protocol, error)


def error_response(protocol: Protocol, error: ModelyardError, request_id: str | None = None) -> web.Response:
    headers, body = error_answer(protocol, error, request_id)
    return web.Response(status=error.status, body=body, headers=headers)


class ServiceErrors:
    """How one service answers errors. `body_limit` is the setting a 413 names ("limits.max_body_bytes";
    None: only the bytes); `protocol` the one envelope of every answer (None: the path's,
    `protocol_for_path`); with `request_ids`, answers and the log line of a bug carry the request's id
    (`REQUEST_ID`, else the client's X-Request-Id)."""

    __slots__ = ("_log", "body_limit", "middleware", "protocol", "request_ids", "service")

    def __init__(
        self,
        service: str,
        *,
        body_limit: str | None = None,
        protocol: Protocol | None = None,
        request_ids: bool = False,
    ) -> None:
        self.service = service
        self.body_limit = body_limit
        self.protocol = protocol
        self.request_ids = request_ids
        self._log = logging.getLogger(f"modelyard.{service}")
        self.middleware: Middleware = self._middleware()

    def answer(
        self, path: str, error: ModelyardError, request_id: str | None
    ) -> tuple[CIMultiDict[str], bytes]:
        """The headers and body answering `error` to a request for `path`."""
        protocol = protocol_for_path(path) if self.protocol is None else self.protocol
        return error_answer(protocol, error, request_id)

    def internal_error(self, method: str, path: str, request_id: str | None = None) -> ModelyardError:
        """A bug: logged with its traceback (call it in the `except`), answered without it."""
        if self.request_ids:
            self._log.exception(
                "unhandled error on %s %s (request %s)",
                method,
                path,
                request_id or "-",
                extra={"request_id": request_id},
            )
        else:
            self._log.exception("unhandled error on %s %s", method, path)
        return ModelyardError(f"internal {self.service} error; see the {self.service} log")

    def too_large(self, limit: int, setting: str | None = None) -> PayloadTooLarge:
        """A body over `limit` bytes: the service's body limit, unless another `setting` is named."""
        setting = setting or self.body_limit
        return PayloadTooLarge(
            f"request body is larger than {setting} ({limit} bytes)"
            if setting
            else f"request body is larger than {limit} bytes"
        )

    def from_aiohttp(self, exc: web.HTTPException, request: web.Request) -> ModelyardError:
        """aiohttp's HTTP error (its router's 404 and 405, its body limit's 413) as modelyard's."""
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            return MethodNotAllowed(
                f"method {request.method} is not allowed on {request.path}; allowed: {allowed}",
                headers={"Allow": allowed},
            )
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return self.too_large(request.client_max_size)
        if isinstance(exc, web.HTTPNotFound):
            return NotFound(f"no route for {request.method} {request.path}")
        error = ModelyardError(exc.reason or exc.text or "error")
        error.status = exc.status
        return error

    def _middleware(self) -> Middleware:
        def request_id(request: web.Request) -> str | None:
            if not self.request_ids:
                return None
            return request.get(REQUEST_ID) or request.headers.get("X-Request-Id")

        def render(request: web.Request, error: ModelyardError, request_id: str | None) -> web.Response:
            headers, body = self.answer(request.path, error, request_id)
            return web.Response(status=error.status, body=body, headers=headers)

        @web.middleware
        async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                return await handler(request)
            except ModelyardError as error:
                if request.writer.output_size:
                    raise  # the answer has begun
                return render(request, error, request_id(request))
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return render(request, self.from_aiohttp(exc, request), request_id(request))
            except (asyncio.CancelledError, ConnectionResetError):
                raise  # the client went away: nothing to answer
            except Exception:
                if request.writer.output_size:
                    raise  # aiohttp logs it and closes the connection
                rid = request_id(request)
                return render(request, self.internal_error(request.method, request.path, rid), rid)

        return errors
