"""A model load joins one trace across the control plane: the client's PUT -> the scheduler's span
for the change -> its span for the LOAD sent to the agent (the traceparent travels in the
operation message) -> the agent's load span -> the inference server's repository load call,
which carries the agent's context. Each role exports as its own service to a real OTLP receiver."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modelyard.agent import AgentConfig, start_agent
from modelyard.scheduler import SchedulerConfig, start_scheduler
from otlp_receiver import OtlpReceiver, ReceivedSpan
from support import free_ports, wait_for_model, wait_until

MB = 1_000_000
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    started = await OtlpReceiver().start()
    yield started
    await started.stop()


def only(spans: list[ReceivedSpan]) -> ReceivedSpan:
    assert len(spans) == 1, spans
    return spans[0]


async def test_a_load_is_one_trace_from_the_client_through_scheduler_and_agent_to_the_server(
    sim_workers, http, tmp_path: Path, receiver: OtlpReceiver
):
    telemetry = {"otlp_endpoint": receiver.url}
    rest_port, agent_port = free_ports(2)
    scheduler = await start_scheduler(
        SchedulerConfig(port=rest_port, agent_port=agent_port, db=str(tmp_path / "s.db"), telemetry=telemetry)
    )
    repository = tmp_path / "repository"
    repository.mkdir()
    (worker,) = await sim_workers(1, repository=repository)
    agent = await start_agent(
        AgentConfig(
            scheduler=scheduler.agent_address,
            server_name="sim",
            inference_url=worker.url,
            memory_bytes=10 * MB,
            repository=repository,
            fetch_roots=(tmp_path / "source",),  # the model's source, beside the repository
            telemetry=telemetry,
        )
    )
    try:
        source = tmp_path / "source"
        source.mkdir()
        settings = {"name": "m", "parameters": {"extra": {"memory_bytes": 1000}}}
        (source / "model-settings.json").write_text(json.dumps(settings))

        async def connected() -> bool:
            async with http.get(f"{scheduler.url}/v1/servers") as response:
                servers = (await response.json())["servers"]
            return any(r["connected"] for s in servers for r in s["replicas"])

        await wait_until(connected, attempts=300, interval=0.05)
        body = {"name": "m", "storage_uri": str(source), "memory": MB}
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        async with http.put(f"{scheduler.url}/v1/models/m", json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
        await wait_for_model(http, scheduler.url, "m", lambda m: m["state"] == "ModelAvailable", "available")

        async def settled() -> bool:  # the agent's span ends with its operation's task
            return agent.pending_operations == 0

        await wait_until(settled)
        for tracer in (scheduler.service.tracer, agent.tracer):
            assert tracer is not None and await asyncio.to_thread(tracer.force_flush)
        async with http.get(f"{worker.url}/sim/stats") as response:
            sent_to_server = (await response.json())["traceparents"]
    finally:
        await agent.stop()
        await scheduler.stop()

    apply = only(receiver.named("apply m"))
    assert (apply.service, apply.kind) == ("modelyard-scheduler", "server")
    assert (apply.trace_id, apply.parent_span_id) == (TRACE_ID, CLIENT_SPAN)
    sent = only([s for s in receiver.named("load m") if s.service == "modelyard-scheduler"])
    assert (sent.kind, sent.parent_span_id, sent.trace_id) == ("client", apply.span_id, TRACE_ID)
    assert sent.attributes["modelyard.server"] == "sim"
    loaded = only([s for s in receiver.named("load m") if s.service == "modelyard-agent"])
    assert (loaded.kind, loaded.parent_span_id, loaded.trace_id) == ("server", sent.span_id, TRACE_ID)
    assert not loaded.error
    assert any(t.split("-")[1:3] == [TRACE_ID, loaded.span_id] for t in sent_to_server), sent_to_server
