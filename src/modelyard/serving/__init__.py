"""Serving HTTP: the I/O adapter that runs an aiohttp application as a server process, shared by the
gateway, the stand-alone graph router and the sim worker. It owns the listener's limits (a deadline
on request heads, keep-alive, a bound on open connections), the error envelope for requests that
never reach the application, the one error middleware of the services' applications (errors.py),
the drain on SIGTERM/SIGINT and the bounded stop after it; and, for the gateway, the lean HTTP/1.1
connection (h1.py) that serves the proxied routes, answering through `Reply` (reply.py) as aiohttp's
server does."""

from modelyard.serving.connection import ListenerStats
from modelyard.serving.drain import draining
from modelyard.serving.process import run, serve_until_signal
from modelyard.serving.responses import answer_response, envelope
from modelyard.serving.server import HttpServer

__all__ = [
    "HttpServer",
    "ListenerStats",
    "answer_response",
    "draining",
    "envelope",
    "run",
    "serve_until_signal",
]
