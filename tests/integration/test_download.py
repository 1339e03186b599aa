"""upstream.download: size bounds (declared and streamed), nothing left behind, error text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from modelyard.errors import ModelServerRefused
from modelyard.upstream.download import ArtefactTooLarge, download

_HUGE = 64  # MiB an endless error or redirect body offers
SENT = web.AppKey("sent", dict)  # status asked for -> bytes the huge handler managed to send
DONE = web.AppKey("done", asyncio.Event)


@pytest.fixture
async def files() -> AsyncIterator[str]:
    app = web.Application()
    app[SENT] = {}
    app[DONE] = asyncio.Event()

    async def huge(request: web.Request) -> web.StreamResponse:
        """A 500 or a 302 (to /sized) with a 64 MiB body, counting what the client took."""
        redirect = request.query.get("status") == "302"
        headers = {"Location": "/sized"} if redirect else {}
        response = web.StreamResponse(status=302 if redirect else 500, headers=headers)
        response.content_length = _HUGE << 20
        sent = 0
        try:
            await response.prepare(request)
            for _ in range(_HUGE):
                await response.write(b"e" * (1 << 20))
                sent += 1 << 20
        except (ConnectionError, OSError):
            pass  # the client stopped reading and closed: what we want
        finally:
            app[SENT][request.query.get("status")] = sent
            app[DONE].set()
        return response

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
    app.router.add_get("/huge", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield app, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_download_within_the_bound_lands_in_place(files, tmp_path):
    _app, files = files
    dest = await download(f"{files}/streamed", tmp_path / "f", max_bytes=1000, deadline=10)
    assert dest.read_bytes() == b"y" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("path", ["/sized", "/streamed"])
async def test_over_the_bound_fails_and_leaves_nothing(files, tmp_path, path):
    _app, files = files
    with pytest.raises(ArtefactTooLarge):
        await download(files + path, tmp_path / "f", max_bytes=999, deadline=10)
    assert list(tmp_path.iterdir()) == []


async def test_an_error_answer_carries_the_servers_text(files, tmp_path):
    _app, files = files
    with pytest.raises(ModelServerRefused, match="404: no such object"):
        await download(f"{files}/missing", tmp_path / "f", max_bytes=999, deadline=10)


@pytest.mark.parametrize("status", ["500", "302"])
async def test_an_error_or_redirect_body_is_not_read_whole(files, tmp_path, status):
    # Before: the whole body was read into memory (any size) before the answer was judged.
    app, base = files
    if status == "500":
        with pytest.raises(ModelServerRefused) as refused:
            await download(f"{base}/huge?status=500", tmp_path / "f", max_bytes=1000, deadline=30)
        assert len(refused.value.message) < 70_000  # the first 64 KiB of the text at most
    else:
        dest = await download(f"{base}/huge?status=302", tmp_path / "f", max_bytes=1000, deadline=30)
        assert dest.read_bytes() == b"x" * 1000
    await asyncio.wait_for(app[DONE].wait(), 30)
    assert app[SENT][status] < (_HUGE // 2) << 20  # socket buffers, never the whole body


async def test_an_fsspec_fetch_over_the_bound_is_refused_before_copying(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from modelyard.upstream import download as module

    copied: list[str] = []

    class FakeFs:  # an object store holding one 5000-byte prefix
        def isdir(self, path):
            return True

        def du(self, path):
            return 5000

        def get(self, source, dest, recursive=False):
            copied.append(source)

    fake = SimpleNamespace(core=SimpleNamespace(url_to_fs=lambda uri: (FakeFs(), "bucket/iris")))
    monkeypatch.setattr(module, "_fsspec", lambda: fake)
    with pytest.raises(ArtefactTooLarge, match="5000 bytes is over the limit of 1000"):
        await module.fetch_with_fsspec("s3://bucket/iris", tmp_path / "d", deadline=10, max_bytes=1000)
    assert copied == [] and list(tmp_path.iterdir()) == []
