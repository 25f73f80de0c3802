"""OpenAI chat-completions JSON <-> the pipeline's request and results (no HTTP in here).

A request is one user message whose content parts are text and exactly one `video_url` or
`image_url` part. Generation options are OpenAI's own fields (max_completion_tokens or
max_tokens, temperature, top_p, seed, stop) plus `top_k` and `ignore_eos`; frame sampling goes in
one extra object, `"media": {"fps", "max_frames", "min_frames", "num_frames", "max_pixels",
"start_time_s", "end_time_s"}` (with the openai client: `extra_body={"media": {...}}`), and token
dropping in `"pruning": {"preset": "balanced", "knobs": {"kv_keep_ratio": 0.25}}`.
Fields left out take the server's defaults, which are greedy: unlike OpenAI, a missing
`temperature` means 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import grpc

from gateway.pipeline import AskSummary
from model_runtime.sampling import GenerationConfig
from protos.epd.v1 import common_pb2
from token_pruning import PruningConfig
from transport.convert import pruning_from_proto
from transport.errors import InvalidRequest, NotFound
from video.types import SamplingOptions

# gRPC status (from transport.errors.status_of) -> HTTP status and OpenAI error type.
_HTTP_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (413, "request_too_large"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

_MEDIA_OPTIONS = {
    "fps": float,
    "max_frames": int,
    "min_frames": int,
    "num_frames": int,
    "max_pixels": int,
    "start_time_s": float,
    "end_time_s": float,
}


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def http_status_of(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status code."""
    return _HTTP_OF_STATUS.get(code, (500, "server_error"))


def error_body(message: str, error_type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


@dataclass
class ChatRequest:
    """What one chat-completions body asks for, in the pipeline's terms."""

    model: str
    question: str
    media_url: str
    modality: str  # "video" | "image": which content part carried the URL
    sampling: SamplingOptions
    generation: GenerationConfig
    stream: bool
    include_usage: bool
    pruning: PruningConfig = PruningConfig()


def parse_chat_request(
    body: Any, served_model: str, sampling_defaults: SamplingOptions, generation_defaults: GenerationConfig
) -> ChatRequest:
    """Validate a chat-completions body; raises InvalidRequest (400) or NotFound (404, model)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model") or served_model
    if model != served_model:
        raise NotFound(f"model '{model}' is not served here; GET /v1/models lists '{served_model}'")
    if body.get("n", 1) != 1:
        raise InvalidRequest("only n=1 is supported")
    question, media_url, modality = _parse_messages(body.get("messages"))
    stream = _typed(body, "stream", bool, False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object")
    return ChatRequest(
        model=model,
        question=question,
        media_url=media_url,
        modality=modality,
        sampling=_sampling(body.get("media"), sampling_defaults),
        generation=_generation(body, generation_defaults),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        pruning=_pruning(body.get("pruning")),
    )


def _pruning(value: Any) -> PruningConfig:
    """{"preset": name, "knobs": {name: value}} -> PruningConfig, parsed as the gRPC path does."""
    if value is None:
        return PruningConfig()
    if not isinstance(value, dict) or set(value) - {"preset", "knobs"}:
        raise InvalidRequest('\'pruning\' must be an object like {"preset": "balanced", "knobs": {...}}')
    knobs = value.get("knobs") or {}
    if not isinstance(knobs, dict):
        raise InvalidRequest("pruning.knobs must be an object of knob names to values")
    options = common_pb2.PruningOptions(
        preset=str(value.get("preset") or "off"),
        knobs={k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in knobs.items()},
    )
    return pruning_from_proto(options)


def _parse_messages(messages: Any) -> tuple[str, str, str]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles != ["user"]:
        raise InvalidRequest(
            f"expected exactly one user message (got roles {roles}); put the question and the "
            "video_url or image_url part in one user message"
        )
    content = messages[0].get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of content parts")
    texts: list[str] = []
    media: list[tuple[str, str]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("video_url", "image_url"):
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f"a {kind} part needs {{'{kind}': {{'url': ...}}}}")
            media.append((url, kind.removesuffix("_url")))
        else:
            raise InvalidRequest(f"unsupported content part {kind!r}; use 'text', 'video_url' or 'image_url'")
    if len(media) != 1:
        raise InvalidRequest(
            f"the message must have exactly one video_url or image_url part, got {len(media)}"
        )
    return "\n".join(texts), media[0][0], media[0][1]


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise InvalidRequest(f"'{name}' must be {_KIND_NAMES[kind]}, got {value!r}")
    return value


def _sampling(media: Any, defaults: SamplingOptions) -> SamplingOptions:
    if media is None:
        return defaults
    if not isinstance(media, dict):
        raise InvalidRequest('\'media\' must be an object such as {"fps": 2, "num_frames": 8}')
    unknown = sorted(set(media) - set(_MEDIA_OPTIONS))
    if unknown:
        raise InvalidRequest(f"unknown media options {unknown}; known: {sorted(_MEDIA_OPTIONS)}")
    v = {name: _typed(media, name, kind, None) for name, kind in _MEDIA_OPTIONS.items()}
    max_frames = v["max_frames"] if v["max_frames"] is not None else defaults.max_frames
    return replace(
        defaults,
        fps=v["fps"] if v["fps"] is not None else defaults.fps,
        max_frames=max_frames,
        min_frames=v["min_frames"] if v["min_frames"] is not None else min(defaults.min_frames, max_frames),
        num_frames=v["num_frames"] if v["num_frames"] is not None else defaults.num_frames,
        max_pixels=v["max_pixels"] if v["max_pixels"] is not None else defaults.max_pixels,
        start_time_s=v["start_time_s"] if v["start_time_s"] is not None else defaults.start_time_s,
        end_time_s=v["end_time_s"] if v["end_time_s"] is not None else defaults.end_time_s,
    )


def _generation(body: dict, defaults: GenerationConfig) -> GenerationConfig:
    max_tokens = _typed(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int, defaults.max_new_tokens)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = defaults.stop
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InvalidRequest("'stop' must be a string or a list of strings")
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        temperature=_typed(body, "temperature", float, defaults.temperature),
        top_p=_typed(body, "top_p", float, defaults.top_p),
        top_k=_typed(body, "top_k", int, defaults.top_k),
        seed=_typed(body, "seed", int, defaults.seed),
        stop=stops,
        ignore_eos=_typed(body, "ignore_eos", bool, defaults.ignore_eos),
    )
    if config.max_new_tokens < 1:
        raise InvalidRequest("max_tokens must be >= 1")
    if config.temperature < 0 or not 0 < config.top_p <= 1 or config.top_k < 0:
        raise InvalidRequest("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
    return config


# -- responses ----------------------------------------------------------------------------------


def usage(summary: AskSummary) -> dict[str, int]:
    completion = len(summary.token_ids)
    return {
        "prompt_tokens": summary.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": summary.num_prompt_tokens + completion,
    }


def epd_details(summary: AskSummary) -> dict[str, Any]:
    """Extra `epd` field: what OpenAI's format has no place for (token ids, frames, timings)."""
    return {
        "request_id": summary.request_id,
        "token_ids": summary.token_ids,
        "num_frames": summary.num_frames,
        "num_visual_tokens": summary.num_visual_tokens,
        "frame_timestamps_s": summary.frame_timestamps_s,
        "timings_ms": summary.timings_ms,
        "kv_num_bytes": summary.kv_num_bytes,
        "encoder_cache_hit": summary.encoder_cache_hit,
        "media_sha256": summary.media_sha256,
        "pruning": summary.pruning.to_dict(),
        "grid_thw": list(summary.grid_thw),
        **({"kept_tokens": kept_token_grid(summary)} if summary.kept_visual_token_index else {}),
    }


def kept_token_grid(summary: AskSummary, merge_size: int = 2) -> list[list[list[int]]]:
    """kept[t][row][col] (0/1) over the merged-token grid of each temporal group: which visual
    tokens reached the KV cache. grid_thw is in patches; a merged token covers merge x merge."""
    t, h, w = summary.grid_thw
    rows, cols = h // merge_size, w // merge_size
    kept = [[[0] * cols for _ in range(rows)] for _ in range(t)]
    for index in summary.kept_visual_token_index:
        group, rest = divmod(index, rows * cols)
        if group < t:
            kept[group][rest // cols][rest % cols] = 1
    return kept


def completion_body(summary: AskSummary, model: str, created: int | None = None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{summary.request_id}",
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": summary.answer},
                "logprobs": None,
                "finish_reason": summary.finish_reason or "stop",
            }
        ],
        "usage": usage(summary),
        "epd": epd_details(summary),
    }


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `token_ids` (extra) are the tokens this chunk's text came from."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
