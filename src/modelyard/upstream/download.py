"""Fetching remote model artefacts: `http(s)://` with aiohttp, `s3://`, `gs://` (and any other
fsspec protocol the agent allows) through `fsspec` when it is installed.

A storageUri is untrusted input (whoever may apply a model writes it), so a fetch:
- connects only where `AddressPolicy` allows (`addresses.py`: no loopback, private, link-local or
  cloud metadata address unless allowed), checked on the address each connection, redirects
  included, is made to;
- stops at `max_bytes`, counted as the bytes arrive (a declared Content-Length over it is refused
  before the body), and at `deadline` seconds in all; a body that sends nothing for
  `READ_STALL` seconds fails too;
- names in its errors the status and the URL without its userinfo, query or fragment (`redact`),
  never the body: an error body may be anything the server chose (a secret it read for us);
- carries credentials only from files the agent's operator named (`HostCredential`), only over
  https and only to the host they are for (a redirect elsewhere does not take them along).
  s3:// and gs:// credentials are fsspec's own (its drivers read the environment and their
  files: AWS_*, GOOGLE_APPLICATION_CREDENTIALS, ...); nothing fetch-related is read from a model.

Both write beside the destination and rename into place, so a reader never sees half a file or
half a directory. Plain local copies are the agent's business (`agent/artefacts.py`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http
import importlib
import ipaddress
import os
import shutil
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import aiohttp

from modelyard.config import TlsClientConfig
from modelyard.errors import ModelyardError, UpstreamTimeout
from modelyard.security.tls import ClientTls
from modelyard.upstream.addresses import AddressPolicy, AddressRefused, CheckingResolver, remedy

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
CHUNK = 1 << 20
READ_STALL = 60.0  # seconds a body may send nothing before the download is given up
CONNECT_TIMEOUT = 10.0
STOP_GRACE = 1.0  # how long a cancelled fetch waits for its worker thread to notice

T = TypeVar("T")


class ArtefactTooLarge(ModelyardError):
    """A download that went over its size bound; nothing is left behind."""


class DownloadFailed(ModelyardError):
    """A download the server refused or that broke off; `status` is the HTTP status (0: none)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class FetchStopped(ModelyardError):
    """A fetch whose worker thread was told to stop (the fetch was cancelled or timed out)."""


def redact(uri: str) -> str:
    """`uri` as it may be shown: scheme, host, port and path; no userinfo (`user:password@`),
    query or fragment, which may carry credentials (a presigned URL's signature). A local path
    is shown as it is."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # an IPv6 host without its closing bracket, say: nothing of it is shown
        scheme = uri.partition(":")[0]
        return f"{scheme}://(not a valid URL)" if scheme.isalnum() else "(not a valid URL)"
    if not parts.scheme or len(parts.scheme) == 1:  # a path (or a Windows drive letter)
        return uri
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True)
class HostCredential:
    """A credential for one host, read from its file at each use (so a rotated file is picked
    up): `bearer_token_file` holds a token (sent as `Authorization: Bearer ...`), or
    `basic_auth_file` holds `user:password` on its first line. `host` is a host name or address,
    optionally with `:port` (then only that port matches)."""

    host: str
    bearer_token_file: Path | None = None
    basic_auth_file: Path | None = None

    def matches(self, host: str, port: int) -> bool:
        """Whether a URL's host (lower case, IPv6 without brackets) and port are this one's."""
        wanted, wanted_port = _host_port(self.host.lower())
        return wanted == host and wanted_port in (None, port)

    def authorization(self) -> str:
        """The Authorization header's value; ModelyardError naming the file (never its content)
        when it cannot be read or is empty."""
        file = self.bearer_token_file or self.basic_auth_file
        assert file is not None
        try:
            text = file.read_text().strip()
        except (OSError, UnicodeError) as error:
            why = error.strerror if isinstance(error, OSError) else "not text"
            raise ModelyardError(f"credential file for {self.host}: {file}: {why}") from None
        first = text.splitlines()[0].strip() if text else ""
        if not first:
            raise ModelyardError(f"credential file for {self.host}: {file} is empty")
        if self.bearer_token_file is not None:
            return f"Bearer {first}"
        return "Basic " + base64.b64encode(first.encode()).decode()


def _host_port(text: str) -> tuple[str, int | None]:
    """`name`, `name:port`, `[v6]`, `[v6]:port` or a bare IPv6 address, split."""
    if text.startswith("["):
        inside, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
        return inside, int(port) if port.isdigit() else None
    if text.count(":") == 1:
        name, _, port = text.partition(":")
        return name, int(port) if port.isdigit() else None
    return text, None


def _credential(credentials: Sequence[HostCredential], url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return None  # never in clear text
    port = parts.port or 443
    for credential in credentials:
        if credential.matches(parts.hostname.lower(), port):
            return credential.authorization()
    return None


def check_url(url: str, schemes: frozenset[str], addresses: AddressPolicy) -> None:
    """Refuse a URL to fetch (the storageUri or a redirect's target) before connecting: a scheme
    not allowed, credentials in it, an IP address written in it that is not allowed (a name's
    addresses are checked as it is resolved)."""
    shown = redact(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise DownloadFailed(f"download of {shown}: not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or scheme not in schemes:
        raise DownloadFailed(f"download of {shown}: {scheme}:// is not allowed here")
    if parts.username is not None or parts.password is not None:
        raise DownloadFailed(
            f"download of {shown}: credentials in the URL are refused (give them to the agent "
            "in a file: --fetch-bearer-token or --fetch-basic-auth)"
        )
    host = parts.hostname
    if not host:
        raise DownloadFailed(f"download of {shown}: no host")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return  # a name: checked as it resolves (CheckingResolver)
    else:
        why = addresses.refusal(host)
        if why is not None:
            raise AddressRefused(f"download of {shown}: {why}: {remedy(why)}")


_SYSTEM_TLS: ClientTls | None = None


def _system_tls() -> ssl.SSLContext:
    """TLS 1.2 or newer, verified against the system's CAs (security/tls.py builds it)."""
    global _SYSTEM_TLS
    if _SYSTEM_TLS is None:
        _SYSTEM_TLS = ClientTls(TlsClientConfig())
    return _SYSTEM_TLS.context()


def _part(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")


async def download(
    url: str,
    dest: Path,
    *,
    max_bytes: int,
    deadline: float,
    addresses: AddressPolicy | None = None,
    schemes: frozenset[str] = frozenset({"http", "https"}),
    credentials: Sequence[HostCredential] = (),
    tls: ssl.SSLContext | None = None,
) -> Path:
    """GET `url` into the file `dest`, following up to 5 redirects (each checked as `url` is);
    at most `max_bytes`, within `deadline` seconds in all. The body goes to a temporary file
    beside `dest`, renamed on success; cancelling stops it at once and leaves nothing.

    `addresses`: where it may connect (default: global addresses only); `tls`: how https servers
    are verified (default: the system's CAs, TLS 1.2 or newer). Writes happen on the
    event loop: the agent is not on the request path, and a chunk write to local disk is short."""
    policy = addresses if addresses is not None else AddressPolicy()
    part = _part(dest)
    current = [url]  # the URL being fetched, for errors: redirects change it
    connector = aiohttp.TCPConnector(
        resolver=CheckingResolver(policy), use_dns_cache=False, ssl=tls or _system_tls(), limit=2
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=READ_STALL)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # the bytes as stored: what is counted is what lands on disk
        trust_env=False,  # no proxy from the environment: the address checked is the one reached
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    try:
        async with asyncio.timeout(deadline):
            return await _get(session, current, dest, part, max_bytes, schemes, policy, credentials)
    except aiohttp.ClientError as error:  # before TimeoutError: a read stall is both
        raise DownloadFailed(f"download of {redact(current[0])}: {_client_error(error)}") from None
    except TimeoutError:
        raise UpstreamTimeout(f"download of {redact(current[0])} took longer than {deadline:g}s") from None
    except ValueError:  # yarl's, for a URL it cannot hold (its text would show the whole URL)
        raise DownloadFailed(f"download of {redact(current[0])}: not a valid URL") from None
    finally:
        part.unlink(missing_ok=True)
        await session.close()


async def _get(
    session: aiohttp.ClientSession,
    current: list[str],
    dest: Path,
    part: Path,
    max_bytes: int,
    schemes: frozenset[str],
    policy: AddressPolicy,
    credentials: Sequence[HostCredential],
) -> Path:
    for _ in range(_MAX_REDIRECTS + 1):
        url = current[0]
        check_url(url, schemes, policy)
        headers = {"Accept-Encoding": "identity"}
        authorization = _credential(credentials, url)
        if authorization is not None:
            headers["Authorization"] = authorization
        async with session.get(url, headers=headers, allow_redirects=False) as response:
            location = response.headers.get("Location")
            if response.status in _REDIRECTS and location:
                response.close()  # its body is never wanted: closing drops the connection unread
                current[0] = urljoin(url, location)
                continue
            if response.status != 200:
                response.close()  # the body is not read: it is never shown
                raise DownloadFailed(
                    f"download of {redact(url)}: answered {_status(response.status)}", status=response.status
                )
            length = response.content_length
            if length is not None and length > max_bytes:
                response.close()
                raise ArtefactTooLarge(
                    f"download of {redact(url)}: {length} bytes is over the limit of {max_bytes}"
                )
            written = 0
            with part.open("wb") as out:
                async for chunk in response.content.iter_chunked(CHUNK):
                    written += len(chunk)
                    if written > max_bytes:
                        response.close()
                        raise ArtefactTooLarge(
                            f"download of {redact(url)}: more than the limit of {max_bytes} bytes"
                        )
                    out.write(chunk)
            os.replace(part, dest)
            return dest
    raise DownloadFailed(f"download of {redact(current[0])}: more than {_MAX_REDIRECTS} redirects")


def _status(status: int) -> str:
    """`403 Forbidden`: the standard phrase, not the server's (which it may fill with anything)."""
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def _client_error(error: aiohttp.ClientError) -> str:
    """What went wrong, in words that carry no URL (aiohttp's texts hold it, query and all)."""
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        return f"its TLS certificate does not verify ({error.certificate_error})"
    if isinstance(error, aiohttp.ClientSSLError):
        return "the TLS handshake failed"
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"cannot connect: {error.os_error.strerror or type(error.os_error).__name__}"
    if isinstance(error, aiohttp.ServerTimeoutError):
        return f"no data for {READ_STALL:g}s"
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "the connection closed before the whole body arrived"
    if isinstance(error, aiohttp.InvalidURL):
        return "not a valid URL"
    return type(error).__name__


async def in_thread(work: Callable[[threading.Event], T], *, cleanup: Callable[[], None] | None = None) -> T:
    """`work(stop)` in a worker thread, which should check `stop` between chunks. When the caller
    is cancelled (an unload, a deadline), `stop` is set and the thread is waited for at most
    `STOP_GRACE` seconds; if it has not returned by then, `cleanup` runs once it does (whatever
    it was still writing goes with it), and the cancellation goes on at once either way."""
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, work, stop)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        try:
            await asyncio.wait({future}, timeout=STOP_GRACE)
        finally:
            if not future.done():
                future.add_done_callback(lambda done: _after(loop, done, cleanup))
            elif not future.cancelled():
                future.exception()  # retrieved: its outcome no longer matters
        raise


def _after(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], cleanup: Callable[[], None] | None
) -> None:
    if not done.cancelled():
        done.exception()
    if cleanup is not None and not loop.is_closed():
        loop.run_in_executor(None, cleanup)


def _replace_dir(part: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(part, dest)


def _fsspec() -> Any:
    try:
        return importlib.import_module("fsspec")
    except ImportError:
        return None


async def fetch_with_fsspec(uri: str, dest: Path, *, deadline: float, max_bytes: int) -> Path:
    """Copy the object or prefix `uri` (s3://, gs://, ...) to the directory `dest` with fsspec,
    in a worker thread (fsspec's sync API blocks), streaming each object so that `max_bytes`
    and cancellation are honoured between chunks. The sizes the store lists are checked first
    (nothing is copied when they are over the limit); an object that grows meanwhile is caught
    as it streams. Clear error when fsspec is not installed."""
    fsspec = _fsspec()
    shown = redact(uri)
    scheme = urlsplit(uri).scheme
    if fsspec is None:
        raise ModelyardError(
            f"cannot fetch {shown}: {scheme}:// needs the fsspec package (and its {scheme} driver, "
            "e.g. s3fs or gcsfs) installed beside modelyard"
        )
    part = _part(dest)
    until = time.monotonic() + deadline

    def copy(stop: threading.Event) -> None:
        fs, path = fsspec.core.url_to_fs(uri)
        if fs.isdir(path):
            root = path.rstrip("/")
            listed = fs.find(root, detail=True)
            files = [(name, _relative(shown, root, name)) for name in sorted(listed)]
            sizes = [listed[name].get("size") for name in listed]
        else:
            files = [(path, PurePosixPath(PurePosixPath(path).name))]
            sizes = [fs.size(path)]
        declared = sum(s for s in sizes if isinstance(s, int))
        if declared > max_bytes:
            raise ArtefactTooLarge(f"fetch of {shown}: {declared} bytes is over the limit of {max_bytes}")
        part.mkdir(parents=True)
        total = 0
        for source, relative in files:
            target = part.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open(source, "rb") as stream, target.open("wb") as out:
                while chunk := stream.read(CHUNK):
                    if stop.is_set() or time.monotonic() > until:
                        raise FetchStopped(f"fetch of {shown} stopped")
                    total += len(chunk)
                    if total > max_bytes:
                        raise ArtefactTooLarge(f"fetch of {shown}: more than the limit of {max_bytes} bytes")
                    out.write(chunk)

    try:
        async with asyncio.timeout(deadline):
            await in_thread(copy, cleanup=lambda: shutil.rmtree(part, ignore_errors=True))
        await asyncio.to_thread(_replace_dir, part, dest)
    except ModelyardError:
        raise
    except TimeoutError:
        raise UpstreamTimeout(f"fetch of {shown} took longer than {deadline:g}s") from None
    except Exception as error:  # a driver's error: its type and text (no body: drivers parse those)
        raise ModelyardError(f"cannot fetch {shown}: {type(error).__name__}: {error}") from None
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(part, ignore_errors=True)
    return dest


def _relative(shown: str, root: str, name: str) -> PurePosixPath:
    """An object's path under the prefix; one that would land outside the directory (an object
    key holding `..`) is refused."""
    relative = PurePosixPath(name[len(root) :].lstrip("/"))
    if not name.startswith(root) or relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ModelyardError(f"fetch of {shown}: object {name!r} would land outside the model directory")
    return relative
