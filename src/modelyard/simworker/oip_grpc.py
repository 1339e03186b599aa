"""The sim worker's OIP v2 over gRPC (`--grpc-port`): the same inference as its REST `/v2` routes,
for trying and testing the gateway's gRPC relay (`grpc_url`) without a real inference server.

Calls are counted in `requests_by_endpoint` as `oip_infer_grpc`, apart from REST's `oip_infer`, so
a test can tell which way a request came. In repository mode only loaded models answer, as over REST.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from modelyard.errors import ModelServerAnswered, NotFound
from modelyard.rpc import OipCall
from modelyard.simworker.app import (
    ENGINE,
    SERVER_NAME,
    SERVER_VERSION,
    Rejected,
    oip_answer,
    oip_model_metadata,
)
from modelyard.simworker.repository import REPOSITORY

Headers = Sequence[tuple[str, str]]


class SimOip:
    """The sim worker's app as an `rpc.OipHandler`."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._engine = app[ENGINE]

    def ready(self) -> bool:
        return True

    def request_id(self, headers: Headers) -> str:
        return ""  # a model server makes none (as Triton and MLServer): nothing added, none sent back

    def server_metadata(self) -> tuple[str, str, list[str]]:
        return SERVER_NAME, SERVER_VERSION, []

    async def model_ready(self, model: str, version: str, headers: Headers, call: OipCall) -> bool:
        return self._served(model)

    def admit(self, model: str, version: str, headers: Headers) -> None:
        if not self._served(model):
            raise NotFound(f"Model {model} not found")

    async def model_metadata(self, model: str, version: str, headers: Headers, call: OipCall) -> object:
        self.admit(model, version, headers)
        return oip_model_metadata(model, version or None)

    async def infer(self, model: str, version: str, call: OipCall, headers: Headers) -> object:
        self._engine.count("oip_infer_grpc")
        try:
            return await oip_answer(self._engine, model, version or None, call.json())
        except Rejected as exc:
            raise ModelServerAnswered(exc.status, exc.message) from None

    def stream_relay(self, model: str, headers: Headers) -> None:
        return None  # a stream's requests are answered one by one, as ModelInfer calls

    def _served(self, model: str) -> bool:
        repository = self._app.get(REPOSITORY)
        return repository is None or repository.is_loaded(model)
