"""The one place errors become responses: each protocol's envelope, chosen by path."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from multidict import CIMultiDict

from modelyard.errors import MethodNotAllowed, ModelyardError, NotFound, PayloadTooLarge
from modelyard.protocols import error_body, protocol_for_path

log = logging.getLogger("modelyard.gateway")

# Set by the proxy once it knows the request id, so that errors echo it too.
REQUEST_ID = web.RequestKey("request_id", str)


def _from_aiohttp(exc: web.HTTPException, request: web.Request) -> ModelyardError:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowed(
            f"method {request.method} is not allowed on {request.path}; allowed: {allowed}",
            headers={"Allow": allowed},
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(
            f"request body is larger than limits.max_body_bytes ({request.client_max_size} bytes)"
        )
    if isinstance(exc, web.HTTPNotFound):
        return NotFound(f"no route for {request.method} {request.path}")
    error = ModelyardError(exc.reason or exc.text or "error")
    error.status = exc.status
    return error


def error_answer(path: str, error: ModelyardError, request_id: str | None) -> tuple[CIMultiDict[str], bytes]:
    """The headers and body answering `error` to a request for `path`, in its protocol's envelope."""
    headers = CIMultiDict(error.headers)
    headers["Content-Type"] = "application/json"
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers, error_body(protocol_for_path(path), error)


def render(request: web.Request, error: ModelyardError) -> web.Response:
    request_id = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
    headers, body = error_answer(request.path, error, request_id)
    return web.Response(status=error.status, body=body, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except ModelyardError as error:
        return render(request, error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return render(request, _from_aiohttp(exc, request))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nothing to answer
    except Exception:
        request_id = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
        return render(request, internal_error(request.method, request.path, request_id))


def internal_error(method: str, path: str, request_id: str | None = None) -> ModelyardError:
    """A bug: logged with its traceback and the request's id, answered without the traceback."""
    log.exception(
        "unhandled error on %s %s (request %s)",
        method,
        path,
        request_id or "-",
        extra={"request_id": request_id},
    )
    return ModelyardError("internal gateway error; see the gateway log")
