"""A SchedulerState with a fake agent side: operations are recorded, sends can be made to fail."""

from __future__ import annotations

from typing import Any

from modelyard.placement import ModelSpec
from modelyard.scheduler import AgentEventKind, LoadedVersion, Operation, OperationKind, ReplicaConfig
from modelyard.scheduler.state import SchedulerState
from modelyard.store import Store


def spec(name: str = "iris", **fields: Any) -> ModelSpec:
    return ModelSpec(name=name, storage_uri=f"file:///models/{name}", **fields)


class Harness:
    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self.sent: list[Operation] = []
        self.lines: list[dict[str, Any]] = []
        self.send_error: str | None = None
        self.state = SchedulerState.restore(self.store, self._send, self.lines.append)
        self.state.server_views = self._checked_views  # type: ignore[method-assign]

    def _checked_views(self) -> Any:
        """Every placement in these tests checks the scheduler's running reservations against a sum
        over every model, so an update path that forgets to refresh them fails a test."""
        views = SchedulerState.server_views(self.state)
        running = {(s.name, r.index): r.reserved_memory for s in views for r in s.replicas}
        recomputed = self.state.reservations_recomputed()
        assert running == {key: recomputed.get(key, 0) for key in running}
        return views

    def _send(self, operation: Operation) -> str | None:
        if self.send_error is not None:
            return self.send_error
        self.sent.append(operation)
        return None

    def connect(
        self,
        server: str = "mlserver",
        index: int = 0,
        *,
        memory: int = 1000,
        capabilities: tuple[str, ...] = (),
        loaded: tuple[LoadedVersion, ...] = (),
        now: float = 1.0,
    ) -> None:
        url = f"http://{server}-{index}.test"
        config = ReplicaConfig(server, index, url, memory, capabilities)
        self.state.connect(config, loaded, memory, now)

    def take(self) -> list[tuple[str, str, int, str, int]]:
        """The operations sent since the last take, as (kind, server, index, model, version)."""
        taken = [(op.kind.value, op.server, op.index, op.model, op.version) for op in self.sent]
        self.sent.clear()
        return taken

    def answer(self, now: float = 2.0, *, fail: str | None = None) -> None:
        """The fake agents do every pending operation: LOADED/UNLOADED (or the failure)."""
        pending, self.sent = self.sent, []
        for op in pending:
            if op.kind is OperationKind.LOAD:
                kind = AgentEventKind.LOAD_FAILED if fail else AgentEventKind.LOADED
            else:
                kind = AgentEventKind.UNLOAD_FAILED if fail else AgentEventKind.UNLOADED
            self.state.event(op.server, op.index, op.model, op.version, kind, message=fail or "", now=now)

    def replicas(self, name: str, version: int | None = None) -> dict[int, str]:
        model = self.state.model(name)
        found = model.latest if version is None else model.version(version)
        assert found is not None
        return {index: status.state.value for index, status in found.replicas.items()}

    def model_state(self, name: str) -> str:
        return self.state.model(name).latest.status.state.value

    def endpoints(self, name: str) -> list[str]:
        lines = [line for line in self.lines if line.get("name") == name and line["type"] == "model"]
        return [e["name"] for e in lines[-1]["endpoints"]] if lines else []

    def reserved(self) -> dict[tuple[str, int], int]:
        return {
            (view.name, r.index): r.reserved_memory
            for view in self.state.server_views()
            for r in view.replicas
        }
