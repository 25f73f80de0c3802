"""A chat request's media, loaded for the HTTP API: a data: URL's bytes decoded, a local file's
read or a URL's fetched (`epd.gateway.media_fetch`, its policy), and their sha256, on worker threads
so that the event loop goes on meanwhile."""

from __future__ import annotations

import asyncio
import hashlib

from aiohttp import web

from epd.gateway.chat_request import ChatRequest
from epd.gateway.config import GatewayConfig
from epd.gateway.http_body import TICKET_KEY
from epd.gateway.media_fetch import decode_data_url, load_media
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest


async def load_request_media(
    request: web.Request, chat: ChatRequest, config: GatewayConfig
) -> MediaInput | None:
    """The media `chat` names (None: a text-only conversation, no encoder call): a data: URL's
    bytes, a local file's or a fetched URL's (held on the request's ticket), and their hash."""
    # Decoding and hashing take about 1 s per 64 MB of media: on a worker thread, so that the
    # event loop (every other client's stream, both APIs) goes on meanwhile.
    data = None
    if chat.media_url.startswith("data:"):
        data = await asyncio.to_thread(take_data_url_bytes, chat, config.max_upload_bytes)
    elif chat.media_url:
        # a file's or a fetch's bytes count as a body's
        ticket = request.get(TICKET_KEY)
        data = await load_media(
            chat.media_url,
            config.http.media,
            config.max_upload_bytes,
            ticket.reserve_bytes if ticket is not None else None,
        )
    return None if data is None else MediaInput(data, await asyncio.to_thread(sha256_hex, data))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # hashlib lets go of the GIL while it hashes


def take_data_url_bytes(chat: ChatRequest, max_upload_bytes: int) -> bytes:
    """The media of a base64 data: URL with few copies of a URL that may be hundreds of MB: its
    ASCII bytes replace the text (taken out of `chat`, so the text is freed) and are decoded in
    place (`epd.gateway.media_fetch.decode_data_url`)."""
    try:
        url = chat.media_url.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidRequest("the data: URL must be ASCII: data:video/mp4;base64,<payload>") from None
    chat.media_url = ""
    return decode_data_url(url, max_upload_bytes)
