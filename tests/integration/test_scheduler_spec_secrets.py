"""Credentials in a model's storageUri (issue 28 item 4): never from the spec, never shown. A
storageUri with `user:password@` is refused at apply; a presigned URL's query (its signature) goes
to the agent that fetches it, but the model's status shows the URL without it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler

PRESIGNED = "https://bucket.example.com/models/iris?X-Amz-Credential=AKIA123&X-Amz-Signature=secret123"


@pytest.fixture
async def scheduler(tmp_path: Path) -> AsyncIterator[RunningScheduler]:
    running = await start_scheduler(SchedulerConfig(port=0, agent_port=0, db=str(tmp_path / "s.db")))
    yield running
    await running.stop()


async def test_credentials_in_the_uri_are_refused_at_apply(scheduler):
    body = {"storage_uri": "https://alice:hunter2@bucket.example.com/iris"}
    async with aiohttp.ClientSession() as http, http.put(f"{scheduler.url}/v1/models/iris", json=body) as r:
        assert r.status == 400
        text = await r.text()
    assert "storage_uri: must not carry credentials (user:password@)" in text
    assert "hunter2" not in text


async def test_a_presigned_query_is_not_shown_in_the_models_status(scheduler):
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{scheduler.url}/v1/models/iris", json={"storage_uri": PRESIGNED}) as r:
            assert r.status in (200, 201), await r.text()
        for path in ("/v1/models/iris", "/v1/models"):
            async with http.get(scheduler.url + path) as r:
                text = await r.text()
            assert "secret123" not in text and "AKIA123" not in text, path
        async with http.get(f"{scheduler.url}/v1/models/iris") as r:
            assert (await r.json())["spec"]["storage_uri"] == "https://bucket.example.com/models/iris"
