"""A minimal HTTP/1.1 client on asyncio streams, for tests that need what ordinary clients will
not do: send headers and hold the body back, announce a length and send less, send bytes that
are not UTF-8 in a header, watch for "100 Continue"."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Connection:
    """One TCP connection to 127.0.0.1:port."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send_head(self, method: str, path: str, headers: dict[str, str | bytes]) -> None:
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
        for name, value in headers.items():
            lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
        self.writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
        await self.writer.drain()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_chunk(self, data: bytes) -> None:
        """One chunk of a `Transfer-Encoding: chunked` body (b"" ends the body)."""
        await self.send(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def read_response(self, head: bool = False) -> Response:
        """The next response, interim ones (100 Continue) included; `head`: the answer to a HEAD,
        whose Content-Length is its GET's, with no body."""
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection without a response")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status < 200 or head:
            return Response(status, headers, b"")
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int((await self.reader.readline()).strip(), 16):
                body += await self.reader.readexactly(size)
                await self.reader.readline()
            await self.reader.readline()
        else:
            body = await self.reader.read()
        return Response(status, headers, body)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass  # the server may have reset a connection it refused


async def request(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str | bytes] | None = None
) -> Response:
    """One request on its own connection; the body is sent whole with its Content-Length."""
    conn = await Connection.open(port)
    try:
        head = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close"}
        await conn.send_head(method, path, {**head, **(headers or {})})
        await conn.send(body)
        return await conn.read_response(head=method == "HEAD")
    finally:
        await conn.close()
