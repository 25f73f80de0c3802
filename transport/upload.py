"""Reading a client-streamed upload (a header message, then byte chunks) under a byte limit."""

from __future__ import annotations

from transport.errors import InvalidRequest, ResourceExhausted


async def read_upload(request_iterator, max_bytes: int):
    """Returns (header, bytes). The first message must carry `header`; the rest `media_chunk`.
    Refuses as soon as the declared or received size passes `max_bytes`."""
    header = None
    parts: list[bytes] = []
    received = 0
    async for msg in request_iterator:
        kind = msg.WhichOneof("kind")
        if header is None:
            if kind != "header":
                raise InvalidRequest("the first message of the stream must be the header")
            header = msg.header
            if header.media_num_bytes > max_bytes:
                raise ResourceExhausted(_too_big(header.media_num_bytes, max_bytes))
            continue
        if kind != "media_chunk":
            raise InvalidRequest("only media_chunk messages may follow the header")
        received += len(msg.media_chunk)
        if received > max_bytes:
            raise ResourceExhausted(_too_big(received, max_bytes))
        parts.append(msg.media_chunk)
    if header is None:
        raise InvalidRequest("the stream ended before its header")
    if header.media_num_bytes and received != header.media_num_bytes:
        raise InvalidRequest(
            f"the header announced {header.media_num_bytes} bytes but {received} arrived; the upload was cut short"
        )
    return header, b"".join(parts)


def _too_big(num_bytes: int, max_bytes: int) -> str:
    return (
        f"the upload is {num_bytes} bytes but this server accepts at most {max_bytes}; "
        "send a shorter or more compressed video"
    )
