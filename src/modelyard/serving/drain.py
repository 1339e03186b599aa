"""A server's drain: once begun, readiness answers 503 and every request that starts is answered
with `Connection: close`, so that load balancers stop sending and keep-alive clients reconnect
elsewhere before the listener goes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

RequestFactory = Callable[
    [RawRequestMessage, StreamReader, RequestHandler, AbstractStreamWriter, "asyncio.Task[None]"], BaseRequest
]


class Drain:
    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False


DRAIN = web.AppKey("modelyard_drain", Drain)


def install_drain(app: web.Application) -> Drain:
    """The drain readiness handlers of `app` consult (one per app; an app served again keeps it)."""
    drain = app.get(DRAIN)
    if drain is None:
        drain = app[DRAIN] = Drain()
    return drain


def closing_while_draining(drain: Drain, make: RequestFactory) -> RequestFactory:
    """Wrap a `web.Server`'s request factory: a request that starts during the drain is read as if
    its client had sent `Connection: close`, so aiohttp says so in the response, streamed or not,
    and closes the connection after it. (An on_response_prepare hook would do it too, but costs
    a coroutine per response for the server's whole life; this costs one call and a test.)"""

    def request_factory(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        if drain.active:
            message = message._replace(should_close=True)
        return make(message, payload, protocol, writer, task)

    return request_factory


def draining(request: web.Request) -> bool:
    """Whether the server answering `request` is draining (readiness handlers answer 503)."""
    drain = request.config_dict.get(DRAIN)
    return drain is not None and drain.active
