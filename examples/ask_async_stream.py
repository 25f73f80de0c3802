"""Stream an answer with the asyncio client: stage events as they happen, then tokens, then the
summary; several questions run concurrently on one channel.

    epd serve &
    python examples/ask_async_stream.py samples/sample.mp4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from epd.client import AskResult, AsyncEpdClient, RetryPolicy, StageEvent, TokenDelta


async def stream_one(client: AsyncEpdClient, video: str, question: str) -> None:
    async for event in client.stream(video, question, num_frames=8, max_new_tokens=32, timeout_s=60):
        if isinstance(event, StageEvent):
            print(
                f"[{event.at_ms:7.1f} ms] {event.stage} {event.state} {event.details or ''}", file=sys.stderr
            )
        elif isinstance(event, TokenDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, AskResult):
            print(
                f"\n-> {event.finish_reason}, TTFT {event.timings_ms.ttft_ms:.0f} ms "
                f"(video decode {event.timings_ms.video_decode_ms:.0f} ms), {event.num_attempts} attempt(s)"
            )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("video", nargs="?", default="samples/sample.mp4")
    p.add_argument("--endpoint", default="127.0.0.1:50050")
    p.add_argument("--api-key", default=os.environ.get("EPD_API_KEY", ""), help="default: $EPD_API_KEY")
    args = p.parse_args()

    # Retries UNAVAILABLE (e.g. the gateway still starting) up to 10 times before the first token.
    retry = RetryPolicy(max_attempts=10, initial_backoff_s=0.5, max_backoff_s=5.0)
    async with AsyncEpdClient(args.endpoint, api_key=args.api_key, retry=retry) as client:
        await stream_one(client, args.video, "what colour is the circle?")
        answers = await asyncio.gather(
            *(
                client.ask(args.video, q, num_frames=8, max_new_tokens=16)
                for q in ("how many objects are there in the video?", "which object is seen last?")
            )
        )
        for answer in answers:
            print(answer.answer, "| cache hit:", answer.encoder_cache_hit)


if __name__ == "__main__":
    asyncio.run(main())
