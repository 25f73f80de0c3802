"""A media upload's affinity key (`epd.transport.remote_encode.media_key`): the sha256 the encoder's
token cache is keyed by (`epd.encoder_svc.engine`), so that an upload goes to the encoder replica
that may hold its tokens, and prefill's early compile to the replica its prefill goes to. No calls
are made: the pools' channels are never used."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import types

from epd.stages.contracts import MediaInput
from epd.transport import remote_encode
from epd.transport.remote_encode import HASH_IN_THREAD_BYTES, media_key
from epd.transport.replica_pool import ReplicaPool

TWO_REPLICAS = ["127.0.0.1:1", "127.0.0.1:2"]


def _key(media: MediaInput, addresses: list[str]) -> str:
    async def scenario() -> str:
        pool = ReplicaPool(addresses)
        try:
            return await media_key(media, pool)
        finally:
            await pool.close()

    return asyncio.run(scenario())


def test_an_upload_is_keyed_by_the_sha256_of_all_its_bytes_small_or_large():
    small = b"a small clip"
    # Past the threshold, hashed on a worker thread; the last byte differs from a copy's, so a
    # key over a prefix (one chunk, the bytes below the threshold) gets the two the same key.
    large = bytes(HASH_IN_THREAD_BYTES) + b"x"
    other = bytes(HASH_IN_THREAD_BYTES) + b"y"
    for data in (small, large, other):
        assert _key(MediaInput(data), TWO_REPLICAS) == hashlib.sha256(data).hexdigest()


def test_a_large_upload_is_hashed_off_the_event_loop(monkeypatch):
    """Hashing a video of hundreds of MB on the loop stalled every other request of the gateway."""
    hashed_on: list[tuple[int, int]] = []  # (bytes, thread id)

    def sha256(data: bytes):
        hashed_on.append((len(data), threading.get_ident()))
        return hashlib.sha256(data)

    monkeypatch.setattr(remote_encode, "hashlib", types.SimpleNamespace(sha256=sha256))
    large = bytes(HASH_IN_THREAD_BYTES)
    small = bytes(HASH_IN_THREAD_BYTES - 1)

    async def scenario() -> int:
        pool = ReplicaPool(TWO_REPLICAS)
        try:
            for data in (small, large):
                assert await media_key(MediaInput(data), pool) == hashlib.sha256(data).hexdigest()
        finally:
            await pool.close()
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert [(size, thread == loop_thread) for size, thread in hashed_on] == [
        (len(small), True),
        (len(large), False),
    ]


def test_a_clients_sha256_is_the_key_and_one_replica_needs_none(monkeypatch):
    """A sha256 the client sent is used as it is (the encoder checks it against the bytes), and an
    upload to a stage of one replica is not hashed here at all (no choice to make; the encoder hashes
    it anyway)."""

    def refuse(data: bytes):
        raise AssertionError("hashed an upload whose key needs no hashing")

    monkeypatch.setattr(remote_encode, "hashlib", types.SimpleNamespace(sha256=refuse))
    sent = "ab" * 32
    assert _key(MediaInput(b"clip", sha256=sent), TWO_REPLICAS) == sent
    assert _key(MediaInput(b"clip"), ["127.0.0.1:1"]) == ""
    assert _key(MediaInput(None, sha256=sent), TWO_REPLICAS) == sent
