"""upstream.download: size bounds (declared and streamed), nothing left behind, error text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from modelyard.errors import ModelServerRefused
from modelyard.upstream.download import ArtefactTooLarge, download


@pytest.fixture
async def files() -> AsyncIterator[str]:
    app = web.Application()

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 1000)

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length to judge by
        await response.prepare(request)
        for _ in range(10):
            await response.write(b"y" * 100)
        await response.write_eof()
        return response

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": "no such object"}, status=404)

    app.router.add_get("/sized", sized)
    app.router.add_get("/streamed", streamed)
    app.router.add_get("/missing", missing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_download_within_the_bound_lands_in_place(files, tmp_path):
    dest = await download(f"{files}/streamed", tmp_path / "f", max_bytes=1000, deadline=10)
    assert dest.read_bytes() == b"y" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("path", ["/sized", "/streamed"])
async def test_over_the_bound_fails_and_leaves_nothing(files, tmp_path, path):
    with pytest.raises(ArtefactTooLarge):
        await download(files + path, tmp_path / "f", max_bytes=999, deadline=10)
    assert list(tmp_path.iterdir()) == []


async def test_an_error_answer_carries_the_servers_text(files, tmp_path):
    with pytest.raises(ModelServerRefused, match="404: no such object"):
        await download(f"{files}/missing", tmp_path / "f", max_bytes=999, deadline=10)
