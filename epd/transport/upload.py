"""Reading a client-streamed upload (a header message, then byte chunks) under a byte limit."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.transport.convert import media_sha256_from_proto

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def media_input(header, data: bytes) -> MediaInput:
    """The upload as the encoder sees it: bytes, or a reference by sha256 when no bytes came.
    A zero-byte file is an (empty, refused) upload, not a reference, even with its hash set."""
    sha = media_sha256_from_proto(header.media_sha256)
    by_reference = not data and sha and sha != _EMPTY_SHA256
    return MediaInput(None if by_reference else data, sha)


async def read_upload(request_iterator, max_bytes: int, reserve_bytes: Callable[[int], None] | None = None):
    """Returns (header, bytes): `read_header`, then `read_media`."""
    header = await read_header(request_iterator)
    return header, await read_media(request_iterator, header, max_bytes, reserve_bytes)


async def read_header(request_iterator):
    """The first message, which must carry `header`."""
    async for msg in request_iterator:
        if msg.WhichOneof("kind") != "header":
            raise InvalidRequest("the first message of the stream must be the header")
        return msg.header
    raise InvalidRequest("the stream ended before its header")


async def read_media(
    request_iterator, header, max_bytes: int, reserve_bytes: Callable[[int], None] | None = None
):
    """The media bytes after `header`: only `media_chunk` messages may follow it. Refuses as soon
    as the declared or received size passes `max_bytes`. `reserve_bytes(n)` is called before each
    chunk is kept and may raise to refuse the upload (a memory budget)."""
    if header.media_num_bytes < 0:
        await drain(request_iterator)
        raise InvalidRequest(
            f"media_num_bytes must be the upload's size (or 0: not announced), got {header.media_num_bytes}"
        )
    if header.media_num_bytes > max_bytes:
        await drain(request_iterator)
        raise ResourceExhausted(_too_big(header.media_num_bytes, max_bytes))
    parts: list[bytes] = []
    received = 0
    async for msg in request_iterator:
        if msg.WhichOneof("kind") != "media_chunk":
            raise InvalidRequest("only media_chunk messages may follow the header")
        received += len(msg.media_chunk)
        if header.media_num_bytes and received > header.media_num_bytes:
            await drain(request_iterator)
            raise InvalidRequest(
                f"the header announced {header.media_num_bytes} bytes but more arrived; "
                "set media_num_bytes to the file's size, or 0"
            )
        if received > max_bytes:
            await drain(request_iterator)
            raise ResourceExhausted(_too_big(received, max_bytes))
        if reserve_bytes is not None:
            try:
                reserve_bytes(len(msg.media_chunk))
            except Exception:
                await drain(request_iterator)
                raise
        parts.append(msg.media_chunk)
    if header.media_num_bytes and received != header.media_num_bytes:
        raise InvalidRequest(
            f"the header announced {header.media_num_bytes} bytes but {received} arrived; the upload was cut short"
        )
    return b"".join(parts)


MAX_DRAINED_MESSAGES = 256
"""Messages read and dropped after a refusal, before the call ends (see `drain`)."""


async def drain(request_iterator) -> None:
    """Read (and drop) what the client is still sending: a grpc.aio client whose send is in
    flight when the server ends the call sees INTERNAL "Internal error from Core" instead of our
    status. Nothing is kept, and at most MAX_DRAINED_MESSAGES messages are read."""
    num_messages = 0
    async for _ in request_iterator:
        num_messages += 1
        if num_messages >= MAX_DRAINED_MESSAGES:
            return


def _too_big(num_bytes: int, max_bytes: int) -> str:
    return (
        f"the upload is {num_bytes} bytes but this server accepts at most {max_bytes}; "
        "send a shorter or more compressed video (the server's limit is --max-upload-bytes)"
    )
