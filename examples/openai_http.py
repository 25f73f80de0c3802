"""The same question through the OpenAI-compatible HTTP API, with the `openai` client.

epd serve &                       # HTTP API on 8000 (epd serve gateway --http-port 8000)
python examples/openai_http.py samples/sample.mp4 "what colour is the circle?"
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import os

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("video", nargs="?", default="samples/sample.mp4")
    p.add_argument("question", nargs="?", default="what colour is the circle?")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument(
        "--api-key",
        default=os.environ.get("EPD_API_KEY") or "none",
        help="the gateway's --api-key (default: $EPD_API_KEY; any string when it has none)",
    )
    p.add_argument("--model", default="epd", help="the gateway's --served-model-name")
    args = p.parse_args()

    mime = mimetypes.guess_type(args.video)[0] or "video/mp4"
    with open(args.video, "rb") as f:
        url = f"data:{mime};base64," + base64.b64encode(f.read()).decode()
    part = "image_url" if mime.startswith("image/") else "video_url"
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    stream = client.chat.completions.create(
        model=args.model,
        messages=[
            {
                "role": "user",
                # Video first, as `epd ask` and the SDK's question form send it (the default model
                # was trained on that order; the chat template renders the parts as given).
                "content": [{"type": part, part: {"url": url}}, {"type": "text", "text": args.question}],
            }
        ],
        max_tokens=32,
        stream=True,
        extra_body={"media": {"num_frames": 8}},  # frame sampling: fps, max_frames, num_frames, ...
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        epd = (chunk.model_extra or {}).get("epd")  # the last chunk: the SDK's AskResult fields, as JSON
        if epd:
            print(
                f"\n{epd['num_frames']} frames, TTFT {epd['timings_ms']['ttft']:.0f} ms, "
                f"video decode {epd['timings_ms']['video_decode']:.0f} ms, "
                f"encoder cache hit: {epd['encoder_cache_hit']}"
            )


if __name__ == "__main__":
    main()
