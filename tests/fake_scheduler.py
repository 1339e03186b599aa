"""A small fake of the scheduler's REST API and feed (docs/placement.md), on a free port.

It serves exactly the documented shapes and lets a test drive the feed: `place()` / `remove()`
change an entry and push the line to every open feed, `drop_feeds()` breaks the connections (the
next one starts with a snapshot), `refuse_feeds` answers new ones 503, `silence()` keeps them
open but stops even the pings. Specs PUT to it are validated with the real manifest parser, so
the CLI sees the real error envelopes.

`FakeScheduler` runs in the test's loop (gateway tests); `threaded_scheduler()` runs one in a
thread of its own for CLI tests, whose commands run their own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from aiohttp import web

from modelyard.errors import ModelSpecInvalid
from modelyard.placement.manifest import spec_from_manifest, spec_to_plain

_STOP = object()
_DROP = object()


def envelope(status: int, message: str, code: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def model_json(spec: dict[str, Any], version: int, state: str, change: str | None = None) -> dict[str, Any]:
    replicas = {
        str(i): {"state": "Available", "reason": "", "timestamp": 1.0} for i in range(spec["replicas"])
    }
    available = len(replicas) if state == "ModelAvailable" else 0
    model = {
        "name": spec["name"],
        "deleted": False,
        "version": version,
        "server": "mlserver",
        "state": state,
        "reason": "",
        "available_replicas": available,
        "unavailable_replicas": spec["replicas"] - available,
        "spec": spec,
        "versions": [
            {
                "version": version,
                "server": "mlserver",
                "state": state,
                "reason": "",
                "available_replicas": available,
                "unavailable_replicas": spec["replicas"] - available,
                "timestamp": 1.0,
                "replicas": replicas,
            }
        ],
    }
    if change is not None:
        model["change"] = change
    return model


class FakeScheduler:
    def __init__(self, *, ping_interval: float = 0.2) -> None:
        self.models: dict[str, dict[str, Any]] = {}  # name -> the API's model JSON
        self.servers: list[dict[str, Any]] = []
        self.entries: dict[str, dict[str, Any]] = {}  # name -> feed entry
        self.applied: list[dict[str, Any]] = []  # bodies of every PUT, in order
        self.feed_connections = 0  # feeds opened so far
        self.ping_interval = ping_interval
        self.after_get: Callable[[], None] | None = None  # runs after each GET /v1/models/{name}
        self.refuse_feeds = False  # answer /v1/feed with 503 (a scheduler still starting)
        self._feeds: list[asyncio.Queue[object]] = []
        self._silent = False
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- driving the feed ----------------------------------------------------------------------

    def place(self, name: str, state: str, endpoints: list[tuple[str, str]], reason: str = "") -> None:
        """Set a model's feed entry; `endpoints` are (name, url) pairs."""
        entry = {
            "name": name,
            "version": 1,
            "state": state,
            "reason": reason,
            "endpoints": [{"name": n, "url": u} for n, u in endpoints],
        }
        self.entries[name] = entry
        self._push({"type": "model", **entry})

    def remove(self, name: str) -> None:
        self.entries.pop(name, None)
        self._push({"type": "removed", "name": name})

    def push_raw(self, line: object) -> None:
        self._push(line)

    def drop_feeds(self) -> None:
        for queue in self._feeds:
            queue.put_nowait(_DROP)

    def silence(self, silent: bool = True) -> None:
        self._silent = silent

    @property
    def open_feeds(self) -> int:
        return len(self._feeds)

    def _push(self, line: object) -> None:
        for queue in self._feeds:
            queue.put_nowait(line)

    # --- the server ----------------------------------------------------------------------------

    async def start(self) -> FakeScheduler:
        app = web.Application()
        app.router.add_get("/v1/feed", self._feed)
        app.router.add_get("/v1/models", self._list)
        app.router.add_get("/v1/models/{name}", self._get)
        app.router.add_put("/v1/models/{name}", self._put)
        app.router.add_delete("/v1/models/{name}", self._delete)
        app.router.add_get("/v1/servers", self._servers)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self._push(_STOP)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _feed(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_feeds:
            return envelope(503, "starting", "not_ready", "service_unavailable")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        queue: asyncio.Queue[object] = asyncio.Queue()
        self.feed_connections += 1
        self._feeds.append(queue)
        try:
            await response.write(_line({"type": "snapshot", "models": list(self.entries.values())}))
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self.ping_interval)
                except TimeoutError:
                    item = {"type": "ping"}
                if item is _STOP:
                    break
                if item is _DROP:
                    assert request.transport is not None
                    request.transport.close()  # a broken connection, not a clean end
                    break
                if not self._silent:
                    await response.write(item if isinstance(item, bytes) else _line(item))
        finally:
            self._feeds.remove(queue)
        return response

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"models": list(self.models.values())})

    async def _get(self, request: web.Request) -> web.Response:
        model = self.models.get(request.match_info["name"])
        if self.after_get is not None:
            self.after_get()
        if model is None:
            return envelope(
                404, f"model {request.match_info['name']!r} not found", "model_not_found", "not_found_error"
            )
        return web.json_response(model)

    async def _put(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = orjson.loads(await request.read())
        self.applied.append(body)
        try:
            spec = spec_to_plain(spec_from_manifest(body, name))
        except ModelSpecInvalid as exc:
            return envelope(400, exc.message, "invalid_model_spec")
        old = self.models.get(name)
        if old is not None and old["deleted"]:
            return envelope(409, f"model {name!r} is being deleted", "model_being_deleted", "conflict")
        if old is None:
            version, change = 1, "created"
        elif old["spec"] == spec:
            version, change = old["version"], "unchanged"
        else:
            version, change = old["version"] + 1, "new_version"
        self.models[name] = model_json(spec, version, "ModelProgressing")
        return web.json_response({**self.models[name], "change": change})

    async def _delete(self, request: web.Request) -> web.Response:
        model = self.models.get(request.match_info["name"])
        if model is None:
            return envelope(
                404, f"model {request.match_info['name']!r} not found", "model_not_found", "not_found_error"
            )
        model.update(deleted=True, state="ModelTerminating")
        return web.json_response(model)

    async def _servers(self, request: web.Request) -> web.Response:
        return web.json_response({"servers": self.servers})


def _line(data: object) -> bytes:
    return orjson.dumps(data) + b"\n"


@contextlib.contextmanager
def threaded_scheduler() -> Iterator[FakeScheduler]:
    """A FakeScheduler in a thread with its own loop. The test may change its `models` and
    `servers` from its own thread: handlers only read them, each in one step."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-scheduler", daemon=True)
    thread.start()
    scheduler = FakeScheduler()
    try:
        asyncio.run_coroutine_threadsafe(scheduler.start(), loop).result(timeout=10)
        yield scheduler
    finally:
        asyncio.run_coroutine_threadsafe(scheduler.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
