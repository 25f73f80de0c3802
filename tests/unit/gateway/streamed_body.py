"""A streamed chat question about 64 bytes of "video" (`BODY`) and the header to post it with
(`JSON`), for the HTTP server's tests over pipelines that answer without a model (its shutdown, and
clients that hang up)."""

from __future__ import annotations

import base64
import json

JSON = {"Content-Type": "application/json"}
BODY = json.dumps(
    {
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "video_url",
                        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"v" * 64).decode()},
                    },
                    {"type": "text", "text": "what happens?"},
                ],
            }
        ],
    }
).encode()
