"""Repository mode: the OIP v2 model-repository API as MLServer serves it, over simulated memory.

    POST /v2/repository/index                  [{"name", "version", "state", "reason", "memory_bytes"}]
    POST /v2/repository/models/{name}/load     200 {} | 404 unknown | 500 failed (memory, on request)
    POST /v2/repository/models/{name}/unload   200 {} | 404 not loaded (waits for a load under way)
    GET  /sim/repository                       {"memory_bytes", "memory_used_bytes", "loaded": {name: bytes}}

Only loaded models answer inference (OIP, OpenAI, KServe v1); others get 404 as from MLServer.
With a directory, the models are its subdirectories and each one's memory and failure come from
`<dir>/<name>/model-settings.json` (MLServer's file; `extra` is free-form there):

    {"name": "iris", "parameters": {"extra": {"memory_bytes": 1000000, "fail_load": true}}}

Without one (`repository_api`), any name loads, with `model_memory` bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from modelyard.simworker.config import SimWorkerConfig

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPENAI_POSTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class RepositoryRefusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SimRepository:
    """Which models are loaded and the memory they take; loads sleep `load_delay` first."""

    def __init__(self, config: SimWorkerConfig) -> None:
        self.directory = config.repository
        self.capacity = config.memory
        self.model_memory = config.model_memory
        self.load_delay = config.load_delay
        self.fail_load = frozenset(config.fail_load)
        self.loaded: dict[str, int] = {}  # name -> bytes
        self.loading: dict[str, int] = {}  # reserved while a load sleeps
        self.failed: dict[str, str] = {}  # name -> why its last load failed
        self._load_done: dict[str, asyncio.Event] = {}  # set when the load under way ends
        self.loads: dict[str, int] = {}  # name -> successful loads so far (tests: "nothing reloaded")
        self.unloads: dict[str, int] = {}

    @property
    def used(self) -> int:
        # A reload holds the old model while the new one loads: the name counts the larger of them.
        names = set(self.loaded) | set(self.loading)
        return sum(max(self.loaded.get(n, 0), self.loading.get(n, 0)) for n in names)

    def is_loaded(self, name: str) -> bool:
        return name in self.loaded

    def _settings(self, name: str) -> tuple[int, bool]:
        """(memory bytes, fail on load) for `name`; RepositoryRefusal 404 if the directory lacks it."""
        if self.directory is None:
            return self.model_memory, name in self.fail_load
        model_dir = self.directory / name
        if "/" in name or name.startswith(".") or not model_dir.is_dir():
            raise RepositoryRefusal(404, f"Model {name} not found")
        memory, fail = self.model_memory, name in self.fail_load
        try:
            extra = json.loads((model_dir / "model-settings.json").read_text())["parameters"]["extra"]
        except (OSError, ValueError, KeyError, TypeError):
            return memory, fail
        if isinstance(extra, dict):
            value = extra.get("memory_bytes")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                memory = value
            fail = fail or extra.get("fail_load") is True
        return memory, fail

    async def load(self, name: str) -> None:
        """Load (or reload) `name`. As MLServer's registry does, a reload loads the new model
        before dropping the old one, which serves meanwhile; a reload that fails keeps the old."""
        memory, fail = self._settings(name)
        if name in self.loading:
            raise RepositoryRefusal(409, f"Model {name} is already loading")
        if fail:
            self.failed[name] = "simulated load failure (fail_load)"
            raise RepositoryRefusal(500, f"Model {name} failed to load: simulated load failure (fail_load)")
        needed = memory - self.loaded.get(name, 0)  # a reload replaces the old model's memory
        if self.capacity and self.used + needed > self.capacity:
            free = self.capacity - self.used
            raise RepositoryRefusal(
                500,
                f"Model {name} failed to load: out of memory: needs {memory} bytes, "
                f"{free} of {self.capacity} free",
            )
        self.loading[name] = memory
        done = self._load_done[name] = asyncio.Event()
        try:
            if self.load_delay:
                await asyncio.sleep(self.load_delay)  # the simulated load time
            self.loaded[name] = memory
            self.loads[name] = self.loads.get(name, 0) + 1
            self.failed.pop(name, None)
        finally:
            self.loading.pop(name, None)
            del self._load_done[name]
            done.set()

    async def unload(self, name: str) -> None:
        """Unload `name`. An unload that arrives while `name` loads waits for that load to end,
        then unloads: MLServer registers a model before loading it, so its unload finds the
        loading model and the model ends up not served; waiting reaches that end state without
        the race (a 404 now and the model loaded after would leave it served, unasked)."""
        loading = self._load_done.get(name)
        if loading is not None:
            await loading.wait()
        if self.loaded.pop(name, None) is None:
            raise RepositoryRefusal(404, f"Model {name} not found")
        self.unloads[name] = self.unloads.get(name, 0) + 1

    def _known(self) -> list[str]:
        names = set(self.loaded) | set(self.loading) | set(self.failed)
        if self.directory is not None and self.directory.is_dir():
            names |= {p.name for p in self.directory.iterdir() if p.is_dir() and not p.name.startswith(".")}
        return sorted(names)

    def index(self, ready_only: bool) -> list[dict[str, object]]:
        entries: list[dict[str, object]] = []
        for name in self._known():
            if name in self.loaded:
                state, reason, memory = "READY", "", self.loaded[name]
            elif name in self.loading:
                state, reason, memory = "LOADING", "", self.loading[name]
            else:
                state, reason, memory = "UNAVAILABLE", self.failed.get(name, ""), 0
            if ready_only and state != "READY":
                continue
            entries.append(
                {"name": name, "version": "", "state": state, "reason": reason, "memory_bytes": memory}
            )
        return entries

    def summary(self) -> dict[str, object]:
        return {
            "memory_bytes": self.capacity,
            "memory_used_bytes": self.used,
            "loaded": dict(self.loaded),
            "loads": dict(self.loads),
            "unloads": dict(self.unloads),
        }


REPOSITORY = web.AppKey("modelyard_sim_repository", SimRepository)


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def _index(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return _json({"error": "malformed JSON body"}, 400)
    ready = isinstance(body, dict) and body.get("ready") is True
    return _json(request.app[REPOSITORY].index(ready))


async def _load(request: web.Request) -> web.StreamResponse:
    try:
        await request.app[REPOSITORY].load(request.match_info["model"])
    except RepositoryRefusal as refusal:
        return _json({"error": refusal.message}, refusal.status)
    return _json({})


async def _unload(request: web.Request) -> web.StreamResponse:
    try:
        await request.app[REPOSITORY].unload(request.match_info["model"])
    except RepositoryRefusal as refusal:
        return _json({"error": refusal.message}, refusal.status)
    return _json({})


async def _summary(request: web.Request) -> web.StreamResponse:
    return _json(request.app[REPOSITORY].summary())


@web.middleware
async def only_loaded_models(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Inference and model metadata for a model that is not loaded answer 404, as MLServer does."""
    if request.path.startswith(("/v2/repository/", "/sim/")):
        return await handler(request)
    model = request.match_info.get("model")
    openai = request.method == "POST" and request.path in _OPENAI_POSTS
    if openai:
        try:
            body = orjson.loads(await request.read())  # aiohttp keeps the bytes for the handler
        except orjson.JSONDecodeError:
            return await handler(request)  # the handler answers the malformed body
        model = body.get("model") if isinstance(body, dict) else None
        model = model if isinstance(model, str) else ""
    if model is None or request.app[REPOSITORY].is_loaded(model):
        return await handler(request)
    message = f"Model {model} not found" if model else "no model given"
    if openai or (request.path.startswith("/v1/models/") and request.method == "GET"):
        error = {"message": message, "type": "not_found_error", "param": "model", "code": "model_not_found"}
        return _json({"error": error}, 404)
    return _json({"error": message}, 404)


def install_repository(app: web.Application, config: SimWorkerConfig) -> SimRepository:
    repository = SimRepository(config)
    app[REPOSITORY] = repository
    app.router.add_routes(
        [
            web.post("/v2/repository/index", _index),
            web.post("/v2/repository/models/{model}/load", _load),
            web.post("/v2/repository/models/{model}/unload", _unload),
            web.get("/sim/repository", _summary),
        ]
    )
    return repository
