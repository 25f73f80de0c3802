"""Ask one question with the blocking client, then a follow-up that reuses the uploaded video.

epd serve &                                   # the stack on loopback (gateway on 50050)
python examples/ask_sync.py samples/sample.mp4 "what colour is the circle?"
"""

from __future__ import annotations

import argparse
import os

from epd.client import EpdClient, EpdError


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("video", nargs="?", default="samples/sample.mp4")
    p.add_argument("question", nargs="?", default="what colour is the circle?")
    p.add_argument("--endpoint", default="127.0.0.1:50050")
    p.add_argument(
        "--api-key",
        default=os.environ.get("EPD_API_KEY", ""),
        help="the gateway's --api-key, if it has one (default: $EPD_API_KEY)",
    )
    p.add_argument("--root-cert", default="", help="PEM of the CA that signed the gateway's TLS certificate")
    args = p.parse_args()

    with EpdClient(
        args.endpoint, timeout_s=120, api_key=args.api_key, root_certificates_path=args.root_cert
    ) as client:
        try:
            result = client.ask(args.video, args.question, num_frames=8, max_new_tokens=32)
        except EpdError as exc:  # exc.code is the grpc.StatusCode, exc.message what to change
            raise SystemExit(f"{exc.code.name}: {exc.message}") from None
        print(result.answer)
        t = result.timings_ms
        print(
            f"{result.num_frames} frames, {result.num_visual_tokens} visual tokens (grid {tuple(result.grid_thw)}); "
            f"video decode {t.video_decode_ms:.0f} ms, encode {t.encode_ms:.0f} ms, "
            f"prefill {t.prefill_ms:.0f} ms, TTFT {t.ttft_ms:.0f} ms"
        )

        # The servers keep the video's tokens: send its sha256 instead of the bytes (falls back
        # to uploading when they no longer have it).
        again = client.upload_or_reuse(
            args.video, "and what happens at the end?", num_frames=8, max_new_tokens=32
        )
        print(again.answer)
        print(f"uploaded {again.media_num_bytes_sent} bytes, encoder cache hit: {again.encoder_cache_hit}")


if __name__ == "__main__":
    main()
