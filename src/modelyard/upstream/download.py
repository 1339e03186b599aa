"""Fetching remote model artefacts: `http(s)://` with our HTTP client, `s3://`, `gs://` (and any
other fsspec protocol) through `fsspec` when it is installed.

Both write beside the destination and rename into place, so a reader never sees half a file or
half a directory. Plain local copies are the agent's business (`agent/artefacts.py`).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from modelyard.errors import ModelServerRefused, ModelyardError, UpstreamTimeout
from modelyard.upstream.http1 import Http1Client, UpstreamResponse
from modelyard.upstream.repository import error_text

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_MAX_ERROR_BYTES = 64 * 1024  # enough for any error text; an error body is never the artefact


class ArtefactTooLarge(ModelyardError):
    """A download that went over its size bound; nothing is left behind."""


def _part(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")


async def download(
    url: str, dest: Path, *, max_bytes: int, deadline: float, client: Http1Client | None = None
) -> Path:
    """GET `url` into the file `dest`, following up to 5 redirects; at most `max_bytes`, within
    `deadline` seconds in all. The body goes to a temporary file beside `dest`, renamed on success.

    Writes happen on the event loop: the agent is not on the request path, and a chunk write to
    local disk is short."""
    own = client is None
    http = client or Http1Client(max_connections=2, connect_timeout=10.0)
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline
    part = _part(dest)
    try:
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https"):
                raise ModelyardError(f"cannot download {url}: only http and https URLs")
            origin = f"{parts.scheme}://{parts.netloc}"
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            left = until - loop.time()
            if left <= 0:
                raise UpstreamTimeout(f"download of {url} took longer than {deadline:g}s")
            response = await http.request(origin, "GET", path, (), None, left)
            location = response.header("Location")
            if response.status in _REDIRECTS and location:
                response.close()  # its body is never wanted: closing drops the connection unread
                url = urljoin(url, location)
                continue
            if response.status != 200:
                text = error_text(await _read_at_most(response, _MAX_ERROR_BYTES))
                raise ModelServerRefused(
                    f"download of {url}: answered {response.status}: {text}",
                    server_status=response.status,
                    server_text=text,
                )
            length = response.header("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                response.close()
                raise ArtefactTooLarge(f"download of {url}: {length} bytes is over the limit of {max_bytes}")
            written = 0
            try:
                with part.open("wb") as out:
                    async for chunk in response.iter_chunks():
                        written += len(chunk)
                        if written > max_bytes:
                            raise ArtefactTooLarge(
                                f"download of {url}: more than the limit of {max_bytes} bytes"
                            )
                        out.write(chunk)
            finally:
                response.close()
            os.replace(part, dest)
            return dest
        raise ModelyardError(f"download of {url}: more than {_MAX_REDIRECTS} redirects")
    finally:
        part.unlink(missing_ok=True)
        if own:
            http.close()


async def _read_at_most(response: UpstreamResponse, limit: int) -> bytes:
    """The first `limit` bytes of the body; the rest is not read (the connection is closed)."""
    body = bytearray()
    try:
        async for chunk in response.iter_chunks():
            body += chunk[: limit - len(body)]
            if len(body) >= limit:
                break
    finally:
        response.close()
    return bytes(body)


def _replace_dir(part: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(part, dest)


def _fsspec() -> Any:
    try:
        return importlib.import_module("fsspec")
    except ImportError:
        return None


async def fetch_with_fsspec(uri: str, dest: Path, *, deadline: float, max_bytes: int | None = None) -> Path:
    """Copy the object or prefix `uri` (s3://, gs://, ...) to the directory `dest` with fsspec,
    in a worker thread (fsspec's sync API blocks). Clear error when fsspec is not installed.

    `max_bytes` is checked against the sizes the store lists before anything is copied (fsspec's
    `get` cannot stop a transfer midway): an object that grows during the copy is not caught."""
    fsspec = _fsspec()
    scheme = urlsplit(uri).scheme
    if fsspec is None:
        raise ModelyardError(
            f"cannot fetch {uri}: {scheme}:// needs the fsspec package (and its {scheme} driver, "
            "e.g. s3fs or gcsfs) installed beside modelyard"
        )
    part = _part(dest)

    def copy() -> None:
        fs, path = fsspec.core.url_to_fs(uri)
        is_dir = fs.isdir(path)
        if max_bytes is not None:
            size = fs.du(path) if is_dir else fs.size(path)
            if isinstance(size, int) and size > max_bytes:
                raise ArtefactTooLarge(f"fetch of {uri}: {size} bytes is over the limit of {max_bytes}")
        if is_dir:
            fs.get(path.rstrip("/") + "/", str(part), recursive=True)
        else:
            part.mkdir(parents=True)
            fs.get(path, str(part / Path(path).name))

    try:
        await asyncio.wait_for(asyncio.to_thread(copy), deadline)
        await asyncio.to_thread(_replace_dir, part, dest)
    except Exception as error:
        if isinstance(error, ModelyardError):
            raise
        if isinstance(error, TimeoutError):
            raise UpstreamTimeout(f"fetch of {uri} took longer than {deadline:g}s") from None
        raise ModelyardError(f"cannot fetch {uri}: {error}") from None
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return dest
