"""upstream.download against real servers on ephemeral ports: size bounds (declared and streamed,
an endless body), cancellation, error text (status and URL, never the body, query or userinfo),
addresses refused (loopback, private, metadata, each redirect, a name that resolves elsewhere on
the next connection), credentials from files (https only, their host only)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from artefact_server import SECRET_BODY, ArtefactServer, endless_closed, endless_started, tls_files
from modelyard.upstream import addresses as addresses_module
from modelyard.upstream.addresses import AddressPolicy, AddressRefused
from modelyard.upstream.download import (
    ArtefactTooLarge,
    DownloadFailed,
    HostCredential,
    download,
    redact,
)

LOOPBACK = AddressPolicy(networks=(ipaddress.ip_network("127.0.0.0/8"),))
_HUGE = 64  # MiB an endless error or redirect body offers
SENT = web.AppKey("sent", dict)  # status asked for -> bytes the huge handler managed to send
DONE = web.AppKey("done", asyncio.Event)


@pytest.fixture
async def files() -> AsyncIterator[tuple[web.Application, str]]:
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


@pytest.fixture
async def serve() -> AsyncIterator[object]:
    """`await serve(host="127.0.0.1", ssl_context=None)`: a started ArtefactServer."""
    started: list[ArtefactServer] = []

    async def start(host: str = "127.0.0.1", **fields: object) -> ArtefactServer:
        server = await ArtefactServer(host=host, **fields).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


async def test_download_within_the_bound_lands_in_place(files, tmp_path):
    _app, files = files
    dest = await download(
        f"{files}/streamed", tmp_path / "f", max_bytes=1000, deadline=10, addresses=LOOPBACK
    )
    assert dest.read_bytes() == b"y" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("path", ["/sized", "/streamed"])
async def test_over_the_bound_fails_and_leaves_nothing(files, tmp_path, path):
    _app, files = files
    with pytest.raises(ArtefactTooLarge):
        await download(files + path, tmp_path / "f", max_bytes=999, deadline=10, addresses=LOOPBACK)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("status", ["500", "302"])
async def test_an_error_or_redirect_body_is_not_read_whole(files, tmp_path, status):
    # Before: the whole body was read into memory (any size) before the answer was judged.
    app, base = files
    url = f"{base}/huge?status={status}"
    if status == "500":
        with pytest.raises(DownloadFailed) as refused:
            await download(url, tmp_path / "f", max_bytes=1000, deadline=30, addresses=LOOPBACK)
        assert refused.value.message == f"download of {base}/huge: answered 500 Internal Server Error"
    else:
        dest = await download(url, tmp_path / "f", max_bytes=1000, deadline=30, addresses=LOOPBACK)
        assert dest.read_bytes() == b"x" * 1000
    await asyncio.wait_for(app[DONE].wait(), 30)
    assert app[SENT][status] < (_HUGE // 2) << 20  # socket buffers, never the whole body


async def test_an_endless_body_stops_at_the_bound(serve, tmp_path):
    # Before: an endless body was written at 1.4-2.0 GiB/s until the 16 GiB bound or 1,800 s.
    server = await serve()
    started = time.monotonic()
    with pytest.raises(ArtefactTooLarge, match=r"more than the limit of 4194304 bytes"):
        await download(
            f"{server.url}/endless", tmp_path / "f", max_bytes=4 << 20, deadline=30, addresses=LOOPBACK
        )
    endless = await endless_closed(server, within=5)
    assert time.monotonic() - started < 5
    assert endless.sent < 64 << 20  # the bound and socket buffers, not more
    assert list(tmp_path.iterdir()) == []


async def test_a_cancelled_download_stops_within_a_second_and_leaves_nothing(serve, tmp_path):
    server = await serve()
    task = asyncio.create_task(
        download(f"{server.url}/endless", tmp_path / "f", max_bytes=1 << 40, deadline=600, addresses=LOOPBACK)
    )
    await endless_started(server)
    cancelled = time.monotonic()
    task.cancel()
    endless = await endless_closed(server, within=1)
    assert endless.closed_at is not None and endless.closed_at - cancelled < 1
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(tmp_path.iterdir()) == []


async def test_an_error_answer_names_status_and_url_never_the_body_query_or_userinfo(serve, tmp_path, caplog):
    # Before: `download of URL?query: answered 403: <the body>`, and the body was the model's reason.
    server = await serve()
    caplog.set_level(logging.DEBUG)
    url = f"{server.url}/forbidden/model.tar.gz?X-Amz-Signature=query-secret#frag"
    with pytest.raises(DownloadFailed) as refused:
        await download(url, tmp_path / "f", max_bytes=1000, deadline=10, addresses=LOOPBACK)
    assert refused.value.message == f"download of {server.url}/forbidden/model.tar.gz: answered 403 Forbidden"
    assert refused.value.status == 403
    for text in (refused.value.message, _our_logs(caplog)):
        assert SECRET_BODY not in text and "query-secret" not in text


def test_redact_keeps_scheme_host_port_and_path_only():
    assert redact("https://user:pw@h.example:8443/a/b.tgz?sig=s#f") == "https://h.example:8443/a/b.tgz"
    assert redact("s3://bucket/prefix?versionId=1") == "s3://bucket/prefix"
    assert redact("http://[::1]:80/x") == "http://[::1]:80/x"
    assert redact("/models/iris") == "/models/iris"


async def test_credentials_in_the_url_are_refused_and_not_shown(serve, tmp_path):
    server = await serve()
    url = server.url.replace("://", "://user:url-secret@") + "/sized"
    with pytest.raises(DownloadFailed, match="credentials in the URL are refused") as refused:
        await download(url, tmp_path / "f", max_bytes=1000, deadline=10, addresses=LOOPBACK)
    assert "url-secret" not in refused.value.message
    assert server.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/x",
        "http://localhost:{port}/x",  # a name: refused on what it resolves to
        "http://[::ffff:127.0.0.1]:{port}/x",  # IPv4 inside IPv6
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://100.100.100.200/latest/meta-data/",
        "http://10.0.0.1/x",
        "http://0.0.0.0:{port}/x",
    ],
)
async def test_loopback_private_and_metadata_addresses_are_refused_by_default(serve, tmp_path, url):
    server = await serve()
    started = time.monotonic()
    with pytest.raises(AddressRefused) as refused:
        await download(url.format(port=server.port), tmp_path / "f", max_bytes=1000, deadline=30)
    assert time.monotonic() - started < 5  # refused before connecting, not timed out
    assert "address" in refused.value.message and "allowed only" in refused.value.message
    assert server.requests == []


async def test_metadata_stays_refused_with_allow_private_unless_its_network_is_listed():
    policy = AddressPolicy(allow_private=True)
    assert policy.refusal("10.1.2.3") is None and policy.refusal("127.0.0.1") is None
    assert policy.refusal("169.254.169.254") == "169.254.169.254, a cloud metadata address"
    assert policy.refusal("fd00:ec2::254") == "fd00:ec2::254, a cloud metadata address"
    assert policy.refusal("168.63.129.16") == "168.63.129.16, a cloud metadata address"  # a global one
    listed = AddressPolicy(networks=(ipaddress.ip_network("169.254.169.254/32"),))
    assert listed.refusal("169.254.169.254") is None
    assert AddressPolicy().refusal("93.184.215.14") is None
    assert AddressPolicy().refusal("::ffff:10.0.0.1") == "::ffff:10.0.0.1, a private address"
    assert AddressPolicy().refusal("2002:7f00:1::1") is not None  # 6to4 of 127.0.0.1


async def test_a_redirect_to_loopback_is_refused(serve, tmp_path):
    # The first server is on an allowed address (127.0.0.2); it redirects to 127.0.0.1 and to
    # localhost, neither allowed: the check runs on every hop, not only on the storageUri.
    target = await serve("127.0.0.1")
    allowed = AddressPolicy(networks=(ipaddress.ip_network("127.0.0.2/32"),))
    origin = await serve("127.0.0.2")
    for to in (f"http://127.0.0.1:{target.port}/secret", f"http://localhost:{target.port}/secret"):
        with pytest.raises(AddressRefused, match="loopback address"):
            await download(
                f"{origin.url}/redirect?to={to}",
                tmp_path / "f",
                max_bytes=1000,
                deadline=10,
                addresses=allowed,
            )
    assert len(origin.requests) == 2 and target.requests == []


async def test_a_name_is_checked_on_every_connection_and_connected_to_as_checked(
    serve, tmp_path, monkeypatch
):
    # DNS rebinding: a name answers an allowed address, then (for the redirect's new connection)
    # a loopback one. And of a mixed answer only the allowed address is connected to.
    allowed_server = await serve("127.0.0.2")
    port = allowed_server.port
    forbidden_server = await serve("127.0.0.1", port=port)  # same port, another address
    elsewhere = await serve("127.0.0.1")
    allowed_server.payloads["/model.bin"] = b"allowed"
    forbidden_server.payloads["/model.bin"] = b"forbidden"
    answers = [["127.0.0.1", "127.0.0.2"], ["127.0.0.2"], ["127.0.0.1"]]

    async def resolve(self, host, port=0, family=0):
        assert host == "rebind.test"
        return [
            {"hostname": host, "host": a, "port": port, "family": 2, "proto": 6, "flags": 0}
            for a in answers.pop(0)
        ]

    monkeypatch.setattr(addresses_module.ThreadedResolver, "resolve", resolve)
    policy = AddressPolicy(networks=(ipaddress.ip_network("127.0.0.2/32"),))
    common = {"max_bytes": 100, "deadline": 10, "addresses": policy}
    dest = await download(f"http://rebind.test:{port}/model.bin", tmp_path / "a", **common)
    assert dest.read_bytes() == b"allowed"
    redirect = f"http://rebind.test:{port}/redirect?to=http://rebind.test:{elsewhere.port}/model.bin"
    with pytest.raises(AddressRefused, match=r"rebind\.test resolves to 127\.0\.0\.1, a loopback address"):
        await download(redirect, tmp_path / "b", **common)
    assert forbidden_server.requests == [] and elsewhere.requests == []
    assert [r[0] for r in allowed_server.requests] == ["/model.bin", redirect.split(str(port), 1)[1]]
    assert answers == []


async def test_a_bearer_token_from_a_file_goes_over_https_to_its_host_only(serve, tmp_path, caplog):
    pytest.importorskip("cryptography")
    tls = tls_files(tmp_path)
    server = await serve(ssl_context=tls["context"])
    server.payloads["/model.bin"] = b"weights"
    token = tmp_path / "token"
    token.write_text("token-secret-1\n")
    credentials = (HostCredential("localhost", bearer_token_file=token),)
    common = {
        "max_bytes": 100,
        "deadline": 10,
        "addresses": LOOPBACK,
        "credentials": credentials,
        "tls": ssl.create_default_context(cafile=tls["ca_file"]),
    }
    url = f"https://localhost:{server.port}"
    assert (await download(f"{url}/model.bin", tmp_path / "a", **common)).read_bytes() == b"weights"
    assert server.requests[-1][1]["Authorization"] == "Bearer token-secret-1"
    # rotated: read again at the next download
    token.write_text("token-secret-2")
    await download(f"{url}/auth", tmp_path / "b", **common)
    assert server.requests[-1][1]["Authorization"] == "Bearer token-secret-2"
    # a redirect to another host (127.0.0.1 is not "localhost") does not take it along
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DownloadFailed, match=r"answered 401 Unauthorized") as refused:
        await download(f"{url}/redirect?to=https://127.0.0.1:{server.port}/auth", tmp_path / "c", **common)
    assert "Authorization" not in server.requests[-1][1]
    for text in (refused.value.message, _our_logs(caplog)):
        assert "token-secret" not in text and SECRET_BODY not in text


async def test_a_credential_is_never_sent_in_clear_text(serve, tmp_path):
    server = await serve()
    token = tmp_path / "token"
    token.write_text("token-secret")
    credentials = (HostCredential(f"127.0.0.1:{server.port}", bearer_token_file=token),)
    with pytest.raises(DownloadFailed, match="401"):
        await download(
            f"{server.url}/auth",
            tmp_path / "f",
            max_bytes=100,
            deadline=10,
            addresses=LOOPBACK,
            credentials=credentials,
        )
    assert "Authorization" not in server.requests[-1][1]


async def test_basic_auth_from_a_file(serve, tmp_path):
    pytest.importorskip("cryptography")
    tls = tls_files(tmp_path)
    server = await serve(ssl_context=tls["context"])
    auth = tmp_path / "auth"
    auth.write_text("reader:pass-secret\n")
    credentials = (HostCredential(f"localhost:{server.port}", basic_auth_file=auth),)
    await download(
        f"https://localhost:{server.port}/auth",
        tmp_path / "f",
        max_bytes=100,
        deadline=10,
        addresses=LOOPBACK,
        credentials=credentials,
        tls=ssl.create_default_context(cafile=tls["ca_file"]),
    )
    assert server.requests[-1][1]["Authorization"] == "Basic cmVhZGVyOnBhc3Mtc2VjcmV0"


async def test_an_https_server_that_does_not_verify_is_refused(serve, tmp_path):
    pytest.importorskip("cryptography")
    tls = tls_files(tmp_path)
    server = await serve(ssl_context=tls["context"])
    with pytest.raises(DownloadFailed, match="certificate does not verify"):
        await download(
            f"https://localhost:{server.port}/x",
            tmp_path / "f",
            max_bytes=100,
            deadline=10,
            addresses=LOOPBACK,
        )


async def test_an_fsspec_fetch_over_the_bound_is_refused_before_copying(tmp_path, monkeypatch):
    from modelyard.upstream import download as module

    opened: list[str] = []
    monkeypatch.setattr(module, "_fsspec", lambda: _fake_fsspec({"bucket/iris/model.bin": 5000}, opened))
    with pytest.raises(ArtefactTooLarge, match="5000 bytes is over the limit of 1000"):
        await module.fetch_with_fsspec("s3://bucket/iris", tmp_path / "d", deadline=10, max_bytes=1000)
    assert opened == [] and list(tmp_path.iterdir()) == []


async def test_an_fsspec_object_larger_than_listed_is_stopped_as_it_streams(tmp_path, monkeypatch):
    from modelyard.upstream import download as module

    # listed as 10 bytes, sends 8 MiB: the bound holds on what arrives, not on what was listed
    fake = _fake_fsspec({"bucket/iris/model.bin": 10}, [], actual=8 << 20)
    monkeypatch.setattr(module, "_fsspec", lambda: fake)
    with pytest.raises(ArtefactTooLarge, match="more than the limit of 1048576 bytes"):
        await module.fetch_with_fsspec("s3://bucket/iris", tmp_path / "d", deadline=10, max_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []


async def test_an_fsspec_object_key_that_climbs_out_is_refused(tmp_path, monkeypatch):
    from modelyard.upstream import download as module

    fake = _fake_fsspec({"bucket/iris/../../../outside": 10}, [])
    monkeypatch.setattr(module, "_fsspec", lambda: fake)
    with pytest.raises(Exception, match="would land outside the model directory"):
        await module.fetch_with_fsspec("s3://bucket/iris", tmp_path / "d", deadline=10, max_bytes=1000)
    assert list(tmp_path.iterdir()) == []


def _our_logs(caplog) -> str:
    """What modelyard logged (the test servers' access logs are theirs)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("modelyard"))


def _fake_fsspec(objects: dict[str, int], opened: list[str], actual: int | None = None):
    """An fsspec module over one prefix, `bucket/iris`, holding `objects` (key -> listed size)."""
    import io
    from types import SimpleNamespace

    class FakeFs:
        def isdir(self, path):
            return True

        def find(self, path, detail=False):
            return {k: {"size": v} for k, v in objects.items()}

        def open(self, path, mode):
            opened.append(path)
            return io.BytesIO(b"\0" * (actual if actual is not None else objects[path]))

    return SimpleNamespace(core=SimpleNamespace(url_to_fs=lambda uri: (FakeFs(), "bucket/iris")))
