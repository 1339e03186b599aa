"""A raw HTTP/1.1 client for tests where a client must misbehave or be watched byte by byte:
pipelining, heads split across writes, keep-alive and `Connection: close`."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson

TIMEOUT = 30  # bound on every wait below; a healthy run takes a fraction of it


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if body or method in ("POST", "PUT"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"

    def json(self) -> Any:
        return orjson.loads(self.body)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """One HTTP/1.1 response (Content-Length or chunked) from a raw connection."""
    async with asyncio.timeout(TIMEOUT):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *header_lines = head.split("\r\n")
        headers = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")
        else:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Reply(int(status_line.split(" ")[1]), headers, body)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True when the server closed the connection (EOF or reset) within TIMEOUT."""
    try:
        async with asyncio.timeout(TIMEOUT):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True


class Client:
    """One raw keep-alive connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, url: str, *, receive_buffer: int | None = None) -> Client:
        """`receive_buffer`: a small kernel receive buffer, so that what the client leaves unread
        stays with the server."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        if receive_buffer is None:
            reader, writer = await asyncio.open_connection(host, int(port))
            return cls(reader, writer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=2**16)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def exchange(self, data: bytes) -> Reply:
        await self.send(data)
        return await read_reply(self.reader)

    def close(self) -> None:
        self.writer.close()


async def send(url: str, data: bytes) -> Reply:
    """`data` (a whole request, which may hold bytes no HTTP client would send) on a connection of
    its own to `url` (http://host:port), and the reply."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        return await read_reply(reader)
    finally:
        writer.close()
