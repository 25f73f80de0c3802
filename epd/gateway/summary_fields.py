"""What every answer says of its run beside its text, from the pipeline's `AskSummary` (no HTTP in
here): OpenAI's `usage` and the extra `epd` object (`epd_details`; the kept visual tokens as a
grid for the web demo: `kept_token_grid`). Chat answers and chunks, legacy completions, the
Responses API and the web demo write them alike."""

from __future__ import annotations

from typing import Any

from epd.gateway.ask_types import AskSummary
from epd.stages.names import timings_with_legacy_names


def usage(summary: AskSummary, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` are the prompt tokens whose KV came
    from prefill's prefix cache (as OpenAI and vLLM report prompt caching). The prompt counts once
    and the completion tokens are every choice's (as vLLM's, for n choices). `reasoning_tokens`
    (every choice's, `epd.gateway.reasoning.part_answers`; None without
    `--reasoning-parser`) goes in `completion_tokens_details`, as vLLM's chat reports it only with
    a reasoning parser."""
    completion = sum(len(choice.token_ids) for choice in summary.all_choices())
    body: dict[str, Any] = {
        "prompt_tokens": summary.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": summary.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": summary.num_reused_prompt_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def epd_details(summary: AskSummary) -> dict[str, Any]:
    """Extra `epd` field: the whole summary, under the names the gRPC summary and the SDK's
    `AskResult` use (the answer itself is the message content), and `kept_tokens`, the kept
    visual tokens as a grid for the web demo. `timings_ms` also carries "decode", the old name
    of "video_decode", until 0.3."""
    return {
        "request_id": summary.request_id,
        "token_ids": summary.token_ids,
        "finish_reason": summary.finish_reason or "stop",
        "stop_reason": summary.stop_reason,
        "num_frames": summary.num_frames,
        "num_visual_tokens": summary.num_visual_tokens,
        "num_prompt_tokens": summary.num_prompt_tokens,
        "num_reused_prompt_tokens": summary.num_reused_prompt_tokens,
        "frame_timestamps_s": summary.frame_timestamps_s,
        "timings_ms": timings_with_legacy_names(summary.timings_ms),
        "kv_num_bytes": summary.kv_num_bytes,
        "encoder_cache_hit": summary.encoder_cache_hit,
        "media_sha256": summary.media_sha256,
        "pruning": summary.pruning.to_dict(),
        "grid_thw": list(summary.grid_thw),
        "kept_visual_token_index": summary.kept_visual_token_index,
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
