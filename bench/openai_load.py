"""Streaming load on an OpenAI-compatible server (epd's HTTP API, vLLM, `transformers serve`):
where and how to send (`OpenAITarget`), the request bodies (chat completions with media or the
questions alone, legacy completions of the prompts the server renders) and the client that sends
them at a concurrency or a rate and times each stream (`run_openai`)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from epd.bench.serve_requests import DEFAULT_QUESTIONS, RequestResult
from epd.bench.sse import async_stream_chunks


@dataclass(frozen=True)
class OpenAITarget:
    """An OpenAI-compatible /v1/chat/completions endpoint and how to talk to it."""

    base_url: str
    """e.g. http://127.0.0.1:8000 (with or without a trailing /v1)."""
    dialect: str = "epd"
    """'epd': frames in the `media` object, `ignore_eos` sent when asked; 'transformers'
    (`transformers serve`): frames in `chat_template_kwargs`, no `ignore_eos` (it answers 422:
    force the length with `min_new_tokens` in the served model's generation_config.json)."""
    media_as: str = "data"
    """How the media travel: 'data' (a data: URL; epd's default), 'path' (a local file path, what
    `transformers serve` takes for video) or 'file-url' (file:///...)."""
    model: str = ""
    """The body's `model` ('' = leave it out: the server's only/forced model)."""
    api_key: str = ""

    @property
    def url(self) -> str:
        return self.v1 + "/chat/completions"

    @property
    def completions_url(self) -> str:
        return self.v1 + "/completions"

    @property
    def v1(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def root(self) -> str:
        """The server's root, where vLLM's /tokenize and /detokenize are (not under /v1)."""
        return self.v1.removesuffix("/v1")


_MIME = {
    ".mp4": "video/mp4",
    ".mkv": "video/x-matroska",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
    ".avi": "video/x-msvideo",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
}


def media_url(path: str | Path, media_as: str) -> tuple[str, str]:
    """(url, content part type) of one media file: 'video_url', or 'image_url' for stills."""
    p = Path(path).resolve()
    mime = _MIME.get(p.suffix.lower(), "video/mp4")
    kind = "image_url" if mime.startswith("image/") else "video_url"
    if media_as == "data":
        return f"data:{mime};base64," + base64.b64encode(p.read_bytes()).decode(), kind
    if media_as == "file-url":
        return p.as_uri(), kind
    if media_as == "path":
        return str(p), kind
    raise ValueError(f"media_as must be data, path or file-url, got {media_as!r}")


def openai_bodies(
    target: OpenAITarget,
    videos: list[str],
    questions: list[str],
    num_requests: int,
    num_frames: int,
    max_new_tokens: int,
    ignore_eos: bool,
    with_media: bool = True,
) -> list[bytes]:
    """One streaming chat-completions body per request (videos and questions cycled), greedy;
    `with_media` False: the questions alone (no media part)."""
    if target.dialect not in ("epd", "transformers"):
        raise ValueError(f"dialect must be epd or transformers, got {target.dialect!r}")
    if ignore_eos and target.dialect == "transformers":
        raise ValueError(
            "transformers serve answers 422 to ignore_eos: serve a model directory whose "
            "generation_config.json sets min_new_tokens (bench/bench_vs_transformers_serve.py "
            "--ignore-eos does) and leave --ignore-eos off"
        )
    urls = [media_url(v, target.media_as) for v in videos]
    questions = questions or DEFAULT_QUESTIONS
    bodies = []
    for i in range(num_requests):
        url, kind = urls[i % len(urls)]
        media = [{"type": kind, kind: {"url": url}}] if with_media else []
        body = streaming_body(
            target,
            max_new_tokens,
            messages=[
                {"role": "user", "content": [*media, {"type": "text", "text": questions[i % len(questions)]}]}
            ],
        )
        if target.dialect == "epd":
            body["media"] = {"num_frames": num_frames}
            if ignore_eos:
                body["ignore_eos"] = True
        else:
            body["chat_template_kwargs"] = {"num_frames": num_frames}
        bodies.append(json.dumps(body).encode())
    return bodies


def streaming_body(target: OpenAITarget, max_new_tokens: int, **fields) -> dict:
    """A greedy streaming body with its usage at the end, and `fields` (messages or prompt)."""
    body: dict = {
        **fields,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.model:
        body["model"] = target.model
    if target.dialect == "epd":
        body["return_token_ids"] = True  # vLLM's field: each chunk's ids, for per-token gaps
    return body


def chat_message(question: str) -> dict:
    """The user message of a text-only request (openai_bodies' with_media=False)."""
    return {"role": "user", "content": [{"type": "text", "text": question}]}


def rendered_chat_prompts(target: OpenAITarget, questions: list[str], timeout_s: float = 60.0) -> list[str]:
    """Each question's text-only chat prompt as the server renders it (chat template, generation
    prompt): its token ids from POST /tokenize {"messages"}, their text from POST /detokenize
    (special tokens kept). Sent as a raw completions prompt, it is the same tokens again."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
        req = urllib.request.Request(target.root + path, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    model = {"model": target.model} if target.model else {}
    prompts = []
    for question in questions:
        tokens = post("/tokenize", {"messages": [chat_message(question)], **model})["tokens"]
        prompts.append(post("/detokenize", {"tokens": tokens, **model})["prompt"])
    return prompts


def completion_bodies(
    target: OpenAITarget, prompts: list[str], num_requests: int, max_new_tokens: int, ignore_eos: bool
) -> list[bytes]:
    """One streaming legacy completions body per request (prompts cycled), greedy."""
    bodies = []
    for i in range(num_requests):
        body = streaming_body(target, max_new_tokens, prompt=prompts[i % len(prompts)])
        if ignore_eos:
            body["ignore_eos"] = True
        bodies.append(json.dumps(body).encode())
    return bodies


async def _one_openai(session, target: OpenAITarget, body: bytes, url: str = "") -> RequestResult:
    """One streaming request (to `url`, default chat completions): TTFT and inter-token gaps from
    the chunks that carry text (a chat chunk's delta, a completion chunk's `text`; epd's chunks
    also carry `token_ids`, asked for with `return_token_ids`, counted exactly); the token count from the final usage."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    r = RequestResult(ok=False)
    t0 = last = time.perf_counter()
    counted = 0
    usage_tokens = 0
    try:
        async with session.post(url or target.url, data=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for chunk in async_stream_chunks(resp.content.iter_any()):
                usage = chunk.get("usage") or {}
                if usage:
                    r.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    usage_tokens = int(usage.get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    n = len(ids) if ids else (1 if text else 0)
                    if not n:
                        continue
                    now = time.perf_counter()
                    if counted == 0:
                        r.ttft_ms = (now - t0) * 1e3
                    else:
                        r.itl_ms.append((now - last) * 1e3)
                    last = now
                    counted += n
        r.e2e_ms = (time.perf_counter() - t0) * 1e3
        r.num_output_tokens = usage_tokens or counted
        r.ok = counted > 0
        if not r.ok:
            r.error = "the stream carried no tokens"
    except Exception as exc:  # noqa: BLE001 - recorded per request
        r.error = f"{type(exc).__name__}: {exc}"[:200]
    return r


async def run_openai(
    target: OpenAITarget,
    bodies: list[bytes],
    concurrency: int,
    progress=None,
    request_rate: float = 0.0,
    seed: int = 0,
    timeout_s: float = 600.0,
    url: str = "",
) -> tuple[list[RequestResult], float]:
    """The bodies against `target` (`url`, default its chat completions), at most `concurrency` in
    flight (0 = all at once), or arriving at `request_rate` per second (Poisson) when > 0."""
    import aiohttp

    results: list[RequestResult] = []
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency if concurrency > 0 else max(1, len(bodies)))

    async def one(session, body):
        async with semaphore:
            results.append(await _one_openai(session, target, body, url))
            if progress is not None:
                progress.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as session:
        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(one(session, body)))
            if request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration
