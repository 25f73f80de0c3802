"""Several requests in flight at once each get exactly the tokens they get alone."""

from __future__ import annotations

import asyncio

import pytest

from epd.client import AsyncEpdClient

REQUESTS = [
    ("mp4", "what colour is the square?", 6),
    ("mp4_b", "how many objects are there?", 4),
    ("png", "describe the image", 1),
    ("mp4", "which direction does it move?", 8),
]


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


def test_concurrent_requests_match_sequential(stack, media_files):
    async def one(client, media, question, frames):
        r = await client.ask(media_files[media], question, num_frames=frames, max_new_tokens=12)
        return r.token_ids

    async def run():
        async with AsyncEpdClient(stack.gateway) as client:
            alone = [await one(client, *r) for r in REQUESTS]
            together = await asyncio.gather(*(one(client, *r) for r in REQUESTS))
        return alone, together

    alone, together = asyncio.run(run())
    assert len({tuple(t) for t in alone}) == len(REQUESTS), "requests should differ from each other"
    assert list(together) == alone
