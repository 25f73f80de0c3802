"""gRPC clients of the front door: `AsyncEpdClient` (asyncio) and `EpdClient` (blocking).

    with EpdClient("127.0.0.1:50050") as client:
        result = client.ask("clip.mp4", "what colour is the circle?", max_new_tokens=16)
        print(result.answer, result.timings_ms)
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import grpc

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

CHUNK_BYTES = 1 << 20
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 4 << 20), ("grpc.max_send_message_length", 4 << 20)]


class EpdError(Exception):
    """A call failed; `code` is the gRPC status, `message` says what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class AskResult:
    answer: str
    token_ids: list[int]
    finish_reason: str
    num_frames: int
    num_visual_tokens: int
    num_prompt_tokens: int
    timings_ms: dict[str, float]
    kv_num_bytes: int
    encoder_cache_hit: bool
    media_sha256: str
    events: list[common_pb2.StageEvent] = field(default_factory=list)


def _read_media(video: str | Path | bytes | BinaryIO) -> bytes:
    if isinstance(video, bytes):
        return video
    if isinstance(video, (str, Path)):
        return Path(video).read_bytes()
    return video.read()


def _header(question: str, data: bytes, sha256: str, options: dict) -> gateway_pb2.AskHeader:
    sampling = common_pb2.VideoSampling(
        fps=options.pop("fps", 0.0),
        max_frames=options.pop("max_frames", 0),
        min_frames=options.pop("min_frames", 0),
        num_frames=options.pop("num_frames", 0),
        start_time_s=options.pop("start_time_s", 0.0),
        end_time_s=options.pop("end_time_s", 0.0),
        max_pixels=options.pop("max_pixels", 0),
    )
    generation = common_pb2.GenerationParams(
        max_new_tokens=options.pop("max_new_tokens", 0),
        temperature=options.pop("temperature", 0.0),
        top_p=options.pop("top_p", 0.0),
        top_k=options.pop("top_k", 0),
        seed=options.pop("seed", 0),
        stop=options.pop("stop", []),
        ignore_eos=options.pop("ignore_eos", False),
    )
    request_id = options.pop("request_id", "")
    if options:
        raise TypeError(f"unknown options: {sorted(options)}")
    return gateway_pb2.AskHeader(
        request_id=request_id,
        question=question,
        media_num_bytes=len(data),
        media_sha256=sha256,
        sampling=sampling,
        generation=generation,
    )


class AsyncEpdClient:
    def __init__(self, endpoint: str, timeout_s: float = 600.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    async def ask_stream(
        self, video: str | Path | bytes | BinaryIO | None, question: str, *, media_sha256: str = "", **options
    ) -> AsyncIterator[gateway_pb2.AskResponse]:
        """Yields AskResponse messages (events, token deltas, then the summary)."""
        data = _read_media(video) if video is not None else b""
        sha = media_sha256 or (hashlib.sha256(data).hexdigest() if data else "")
        header = _header(question, data, sha, dict(options))

        async def requests():
            yield gateway_pb2.AskRequest(header=header)
            for i in range(0, len(data), CHUNK_BYTES):
                yield gateway_pb2.AskRequest(media_chunk=data[i : i + CHUNK_BYTES])

        try:
            async for msg in self._stub.Ask(requests(), timeout=self.timeout_s):
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise EpdError(exc.code(), exc.details() or "") from None

    async def ask(self, video, question: str, **options) -> AskResult:
        events = []
        async for msg in self.ask_stream(video, question, **options):
            kind = msg.WhichOneof("kind")
            if kind == "event":
                events.append(msg.event)
            elif kind == "summary":
                s = msg.summary
                return AskResult(
                    answer=s.answer,
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    num_frames=s.num_frames,
                    num_visual_tokens=s.num_visual_tokens,
                    num_prompt_tokens=s.num_prompt_tokens,
                    timings_ms=dict(s.timings_ms),
                    kv_num_bytes=s.kv_num_bytes,
                    encoder_cache_hit=s.encoder_cache_hit,
                    media_sha256=s.media_sha256,
                    events=events,
                )
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEpdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class EpdClient:
    """Blocking wrapper: runs the async client on a private event loop."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(self._make(endpoint, timeout_s))

    @staticmethod
    async def _make(endpoint: str, timeout_s: float) -> AsyncEpdClient:
        return AsyncEpdClient(endpoint, timeout_s)

    def ask(self, video, question: str, **options) -> AskResult:
        return self._loop.run_until_complete(self._client.ask(video, question, **options))

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()

    def __enter__(self) -> EpdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
