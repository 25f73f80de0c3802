"""vLLM's `prompt_logprobs`: each prompt token's log-probability given the tokens before it, its
rank and the k most likely tokens there, equal within 1e-5 to `torch.log_softmax` of the unsplit
model's full forward logits (`model(**inputs).logits`) at each position, with the same top-k ids:
in the embedded pipeline (batched with requests that do not ask, a video prompt's placeholder
positions included, a prompt prefilled in chunks), for a prompt whose prefix the prefix cache holds
(computed whole all the same), and through the real stack's processes (HTTP chat and completions,
completions' echo with logprobs, gRPC via the SDK; a prompt of over 15,000 tokens, whose logprobs pass the 4
MiB of one gRPC message). A request that does not ask computes no position's logits but its last."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
import torch

from epd.client import EpdClient
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.adapter import PrefillChunk
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import from_chat_template
from epd.stages.raw_prompt import RawPrompt
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.reference import decode_for_test, prompt_inputs

TOLERANCE = 1e-5
K = 5
NUM_FRAMES = 4
PROMPT = "Once upon a time, in a land far away, there lived a"
TEXT_CHAT = [
    {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
    {"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]},
]
VIDEO_CHAT = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]


def close(got: float, want: float, tolerance: float = TOLERANCE) -> bool:
    return math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance)


def reference(path, messages=None, video=None, prompt=None) -> tuple[list[int], torch.Tensor]:
    """(the prompt's ids [L], log_softmax of the unsplit model's full forward logits [L, vocab])."""
    model, processor = whole_model(path)
    inputs = prompt_inputs(processor, messages, video, prompt)
    with torch.inference_mode():
        logits = model(**inputs).logits[0]  # [L, vocab]
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs(
    got: list[TokenLogprob] | None,
    ids: list[int],
    logprobs: torch.Tensor,
    k: int,
    tolerance: float = TOLERANCE,
):
    """got: one per prompt token (the first's NaN); logprobs [L, vocab]: position p predicts token p + 1."""
    assert got is not None and [lp.token_id for lp in got] == ids
    assert math.isnan(got[0].logprob) and not got[0].top
    for p, lp in enumerate(got[1:]):
        row = logprobs[p]  # the distribution after tokens [0, p]
        assert close(lp.logprob, float(row[ids[p + 1]]), tolerance), (p, lp.logprob, float(row[ids[p + 1]]))
        assert lp.rank == int((row > row[ids[p + 1]]).sum()) + 1, p
        values, top = torch.topk(row, k)
        assert [t.token_id for t in lp.top] == top.tolist(), p
        assert all(close(t.logprob, v, tolerance) for t, v in zip(lp.top, values.tolist(), strict=True)), p


def chat(messages, prompt_logprobs, media=None, logprobs=None) -> AskRequest:
    generation = GenerationConfig(max_new_tokens=4, prompt_logprobs=prompt_logprobs, logprobs=logprobs)
    return AskRequest(from_chat_template(messages), media, SamplingOptions(num_frames=NUM_FRAMES), generation)


# -- the embedded pipeline ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [None, 7], ids=["whole", "in_chunks_of_7"])
def test_prompt_logprobs_equal_the_full_forward_in_a_batch(tiny_models, media_files, chunk_tokens):
    """A video chat (its placeholder positions too: vLLM returns theirs) with k = 5, a text chat
    with k = 0 (each token's own alone) and a raw prompt with k = 20, batched with a request that
    does not ask; whole, and prefilled in chunks of 7 tokens (each chunk's positions computed in
    its own step)."""
    path = tiny_models["qwen2_vl"]
    scheduler = PrefillSchedulerConfig(max_prefill_tokens_per_step=4096, prefill_chunk_tokens=chunk_tokens)
    model = ModelConfig(model=str(path))
    with build_embedded_pipeline(model, prefill=PrefillConfig(model=model, scheduler=scheduler)) as pipeline:

        async def run() -> list[AskSummary]:
            raw = AskRequest([], raw_prompt=RawPrompt(text=PROMPT),
                             generation=GenerationConfig(max_new_tokens=4, prompt_logprobs=20))  # fmt: skip
            video = MediaInput(media_files["mp4"].read_bytes())
            return await asyncio.gather(
                request_summary(pipeline, chat(VIDEO_CHAT, K, video)),
                request_summary(pipeline, chat(TEXT_CHAT, 0)),
                request_summary(pipeline, raw),
                request_summary(pipeline, chat(TEXT_CHAT, None, logprobs=2)),
            )

        with_video, text, raw, without = asyncio.run(run())
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    assert with_video.num_visual_tokens > 0
    assert_prompt_logprobs(with_video.prompt_logprobs, *reference(path, VIDEO_CHAT, video), K)
    assert_prompt_logprobs(text.prompt_logprobs, *reference(path, TEXT_CHAT), 0)
    assert_prompt_logprobs(raw.prompt_logprobs, *reference(path, prompt=PROMPT), 20)
    assert without.prompt_logprobs is None and without.logprobs is not None
    assert text.token_ids == without.token_ids  # asking changes nothing generated


def test_a_prefix_cache_hit_still_gets_every_prompt_tokens_logprobs(tiny_models):
    """A follow-up whose earlier turns the prefix cache holds: without prompt_logprobs it reuses
    them (the control), with them it computes the whole prompt, and every token's value is the
    full forward's."""
    path = tiny_models["qwen2_vl"]
    first = chat(TEXT_CHAT, None)
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        answer = asyncio.run(request_summary(pipeline, first)).answer
        follow_up = [
            *TEXT_CHAT,
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": "and then?"}]},
        ]
        control = asyncio.run(request_summary(pipeline, chat(follow_up, None)))
        asked = asyncio.run(request_summary(pipeline, chat(follow_up, K)))
    assert control.num_reused_prompt_tokens > 0, "no prefix-cache hit: the test proves nothing"
    assert asked.num_reused_prompt_tokens == 0
    assert_prompt_logprobs(asked.prompt_logprobs, *reference(path, follow_up), K)
    assert asked.token_ids == control.token_ids


def test_only_a_row_that_asks_computes_its_positions_logits_chunk_by_chunk(tiny_models, monkeypatch):
    """One padded forward of two prompts, one asking: the model's head runs over the asking row's
    positions (in chunks of at most the byte bound, here 3 positions' logits) and, for the other
    row, only over its last position; a forward where no row asks runs the head once, [B, 1]."""
    import epd.model_runtime.logprobs as logprobs_module

    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "all")
    vocab = adapter.lm_head.out_features
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROBS_CHUNK_BYTES", 3 * 4 * vocab)
    rows_seen: list[int] = []  # positions per head call
    hook = adapter.lm_head.register_forward_hook(
        lambda _m, args, _o: rows_seen.append(args[0].shape[:-1].numel())
    )
    try:
        asking = adapter.build_raw_prompt(PROMPT)
        other = adapter.build_raw_prompt("a shorter prompt")
        empty = torch.empty(0, adapter.hidden_size)

        def rows(k: int | None) -> list[PrefillChunk]:
            return [
                PrefillChunk(asking, empty, 0, asking.num_tokens, prompt_logprobs=k),
                PrefillChunk(other, empty, 0, other.num_tokens),
            ]

        results = adapter.prefill_chunks(rows(K))
        asked_calls = list(rows_seen)
        rows_seen.clear()
        plain = adapter.prefill_chunks(rows(None))
    finally:
        hook.remove()
    assert results[1].prompt_logprobs is None and plain[0].prompt_logprobs is None
    assert results[0].prompt_logprobs is not None
    assert len(results[0].prompt_logprobs.logprobs) == asking.num_tokens - 1
    assert rows_seen == [2]  # the last position of each of the two rows, once
    # The last logits of both rows, then the asking row's L - 1 positions 3 at a time.
    assert asked_calls[0] == 2
    assert max(asked_calls[1:]) <= 3 and sum(asked_calls[1:]) == asking.num_tokens - 1
    assert torch.equal(results[0].last_logits, plain[0].last_logits)


def test_prompt_logprobs_over_the_limit_or_with_pruning_are_refused(tiny_models, media_files):
    path = tiny_models["qwen2_vl"]
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        with pytest.raises(
            InvalidRequest, match=r"prompt_logprobs must be between 0 and 20 \(--max-logprobs\)"
        ):
            asyncio.run(request_summary(pipeline, chat(TEXT_CHAT, 21)))
        pruned = chat(VIDEO_CHAT, 1, MediaInput(media_files["mp4"].read_bytes()))
        pruned.pruning = PruningConfig(prefill_drop=True, prefill_keep_ratio=0.5)
        with pytest.raises(InvalidRequest, match="prompt_logprobs cannot be computed with token pruning"):
            asyncio.run(request_summary(pipeline, pruned))


# -- the real stack: HTTP (openai client) and gRPC (the SDK) --------------------------------------


def test_prompt_logprobs_through_the_stack(shared_stack, tiny_models):
    """vLLM's shapes: chat's top-level `prompt_logprobs`, completions' per choice, each a list of
    None then {token_id: {logprob, rank, decoded_token}}; completions' echo with logprobs lists the
    prompt's tokens first; the SDK's AskResult.prompt_logprobs; refusals with a 400."""
    path = tiny_models["qwen2_vl"]
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    ids, logprobs = reference(path, TEXT_CHAT)
    body = http.chat.completions.create(
        model="epd", messages=TEXT_CHAT, max_tokens=2, extra_body={"prompt_logprobs": K}
    ).model_dump()
    assert_json_prompt_logprobs(body["prompt_logprobs"], ids, logprobs, K)
    plain = http.chat.completions.create(model="epd", messages=TEXT_CHAT, max_tokens=2).model_dump()
    assert plain.get("prompt_logprobs") is None

    raw_ids, raw_logprobs = reference(path, prompt=PROMPT)
    completion = http.completions.create(
        model="epd", prompt=PROMPT, max_tokens=3, extra_body={"prompt_logprobs": 2}
    ).model_dump()
    assert_json_prompt_logprobs(completion["choices"][0]["prompt_logprobs"], raw_ids, raw_logprobs, 2)

    echoed = http.completions.create(
        model="epd", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2
    ).model_dump()
    choice = echoed["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    num_prompt = len(raw_ids)
    assert len(lp["tokens"]) == num_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, num_prompt):
        assert close(lp["token_logprobs"][p], float(raw_logprobs[p - 1, raw_ids[p]])), p
        assert len(lp["top_logprobs"][p]) in (2, 3)
    assert lp["text_offset"][0] == 0

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(None, messages=TEXT_CHAT, max_new_tokens=2, prompt_logprobs=K)
    assert_prompt_logprobs(result.prompt_logprobs, ids, logprobs, K)

    for extra, match in (
        ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            http.chat.completions.create(model="epd", messages=TEXT_CHAT, max_tokens=2, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="not available with"):
        http.chat.completions.create(
            model="epd", messages=TEXT_CHAT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_a_streamed_echo_with_logprobs_joins_to_the_whole_answer(shared_stack, tiny_models):
    """A legacy completion's `echo` with `logprobs`, streamed (it was a 400), as vLLM streams it:
    the first chunk is the prompt's text and its first step's, with the prompt's tokens' logprobs
    (the first null) then that step's, and that step's token ids; then the answer's tokens stream
    with theirs. Joined, the chunks are the whole answer's text and its `logprobs` lists (tokens,
    offsets, values, top alternatives)."""
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    raw_ids, raw_logprobs = reference(tiny_models["qwen2_vl"], prompt=PROMPT)
    body: dict = dict(
        model="epd", prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, extra_body={"return_token_ids": True}
    )
    whole = http.completions.create(**body).model_dump()["choices"][0]
    chunks = [c.model_dump()["choices"][0] for c in http.completions.create(**body, stream=True) if c.choices]

    echo = chunks[0]
    first_ids = echo["token_ids"]
    assert first_ids and first_ids == whole["token_ids"][: len(first_ids)]
    assert echo["text"].startswith(PROMPT) and len(echo["text"]) > len(PROMPT)  # the first step's text too
    assert len(echo["logprobs"]["tokens"]) == len(raw_ids) + len(first_ids)
    # the prompt's ids come on the choice's first chunk, the echo's (vLLM's); later chunks' null
    assert echo["prompt_token_ids"] == raw_ids and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert echo["logprobs"]["token_logprobs"][0] is None and echo["logprobs"]["top_logprobs"][0] is None
    for p in range(1, len(raw_ids)):
        assert close(echo["logprobs"]["token_logprobs"][p], float(raw_logprobs[p - 1, raw_ids[p]])), p
    assert [t for c in chunks for t in c.get("token_ids") or []] == whole["token_ids"]

    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {
        key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    want = whole["logprobs"]
    assert (joined["tokens"], joined["text_offset"]) == (want["tokens"], want["text_offset"])
    assert len(joined["tokens"]) == len(raw_ids) + 4
    for got, expected in zip(joined["token_logprobs"], want["token_logprobs"], strict=True):
        assert (got is None and expected is None) or close(got, expected)
    for got, expected in zip(joined["top_logprobs"], want["top_logprobs"], strict=True):
        assert (got is None and expected is None) or (
            list(got) == list(expected) and all(close(got[t], expected[t]) for t in got)
        )


def test_echo_with_max_tokens_0_scores_the_prompt_alone(shared_stack, tiny_models):
    """vLLM's echo without generation, how lm-evaluation-harness scores a text's loglikelihood
    (`echo`, `logprobs`, `max_tokens` 0): it was a 400 ("'max_tokens' must be an integer from 1").
    The answer is the prompt's text and its tokens' logprobs, the model's, plain and streamed."""
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    raw_ids, raw_logprobs = reference(tiny_models["qwen2_vl"], prompt=PROMPT)
    body: dict = dict(model="epd", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = http.completions.create(**body).model_dump()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] in ("length", "stop")
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(raw_ids) and lp["token_logprobs"][0] is None
    for p in range(1, len(raw_ids)):
        assert close(lp["token_logprobs"][p], float(raw_logprobs[p - 1, raw_ids[p]])), p
    # Streamed, vLLM's one chunk: the prompt alone, its logprobs and the finish reason.
    (streamed,) = [
        c.model_dump()["choices"][0] for c in http.completions.create(**body, stream=True) if c.choices
    ]
    assert (streamed["text"], streamed["finish_reason"]) == (PROMPT, choice["finish_reason"])
    assert streamed["logprobs"]["tokens"] == lp["tokens"]


def test_a_token_id_prompt_is_echoed_as_its_text(shared_stack, tiny_models):
    """`echo` with the prompt given as token ids (lm-evaluation-harness's tokenized requests; it
    was a 400): the gateway has no tokenizer, so prefill's Detokenize gives the ids' text, as
    vLLM's renderer decodes them. The answer, whole and streamed, with and without generation,
    is the text prompt's: the same text, logprobs and text offsets."""
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    raw_ids, _ = reference(tiny_models["qwen2_vl"], prompt=PROMPT)
    for max_tokens in (3, 0):
        body: dict = dict(model="epd", max_tokens=max_tokens, echo=True, logprobs=2)
        by_text = http.completions.create(**body, prompt=PROMPT).model_dump()["choices"][0]
        by_ids = http.completions.create(**body, prompt=raw_ids).model_dump()["choices"][0]
        assert by_ids["text"] == by_text["text"] and by_ids["text"].startswith(PROMPT), max_tokens
        assert by_ids["logprobs"]["tokens"] == by_text["logprobs"]["tokens"]
        assert by_ids["logprobs"]["text_offset"] == by_text["logprobs"]["text_offset"]
        for got, want in zip(
            by_ids["logprobs"]["token_logprobs"], by_text["logprobs"]["token_logprobs"], strict=True
        ):
            assert (got is None and want is None) or close(got, want)
        chunks = [
            c.model_dump()["choices"][0]
            for c in http.completions.create(
                **body, prompt=raw_ids, stream=True, extra_body={"return_token_ids": True}
            )
            if c.choices
        ]
        # the prompt's text in front of the first step's (vLLM's), its tokens' logprobs first
        first_step = len(chunks[0].get("token_ids") or []) if max_tokens else 0
        assert chunks[0]["text"].startswith(PROMPT) and (len(chunks[0]["text"]) > len(PROMPT)) == bool(
            max_tokens
        )
        assert len(chunks[0]["logprobs"]["tokens"]) == len(raw_ids) + first_step
        assert "".join(c["text"] for c in chunks) == by_ids["text"]
        assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == (
            by_ids["logprobs"]["text_offset"]
        )


def assert_json_prompt_logprobs(got: list, ids: list[int], logprobs: torch.Tensor, k: int) -> None:
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        row = logprobs[p]
        token = ids[p + 1]
        values, top = torch.topk(row, k)
        want = [token, *(t for t in top.tolist() if t != token)]
        assert [int(t) for t in entry] == want, p  # the prompt token first, then the top k
        assert close(entry[str(token)]["logprob"], float(row[token])), p
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1, p
        for rank, (t, v) in enumerate(zip(top.tolist(), values.tolist(), strict=True), start=1):
            assert close(entry[str(t)]["logprob"], v) and entry[str(t)]["rank"] == rank, (p, t)
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


@pytest.mark.parametrize("family", ["qwen3_vl", "llava_onevision", "qwen3_5", "glm4v", "internvl"])
def test_every_familys_chunked_prefill_computes_them(family, tmp_path):
    """Each family's own padded forward and continued chunk: a raw prompt's first 7 tokens in a
    padded forward beside a shorter prompt that does not ask, then the rest after its cache; the
    chunks' rows together equal the unsplit model's full forward (a hybrid Qwen3.5's linear layers
    carried across the chunk boundary)."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    path = build_checkpoint(tmp_path / family, TinyVLMSpec(family=family, num_hidden_layers=4))
    adapter = load_adapter(ModelConfig(model=str(path)), "all")
    asking, other = adapter.build_raw_prompt(PROMPT), adapter.build_raw_prompt("short")
    empty = torch.empty(0, adapter.hidden_size)
    deepstack = [empty] * adapter.num_deepstack_layers or None
    first, _ = adapter.prefill_chunks(
        [
            PrefillChunk(asking, empty, 0, 7, deepstack=deepstack, prompt_logprobs=K),
            PrefillChunk(other, empty, 0, other.num_tokens, deepstack=deepstack),
        ]
    )
    (rest,) = adapter.prefill_chunks(
        [
            PrefillChunk(
                asking, empty, 7, asking.num_tokens, first.cache, deepstack=deepstack, prompt_logprobs=K
            )
        ]
    )
    assert first.prompt_logprobs is not None and rest.prompt_logprobs is not None
    rows = first.prompt_logprobs
    rows.extend(rest.prompt_logprobs)
    from epd.model_runtime.logprobs import prompt_token_logprobs

    got = prompt_token_logprobs(rows, asking.input_ids[0].tolist(), adapter.token_text)
    # Qwen3.5's linear layers continued across a chunk boundary round differently from one whole
    # pass (its adapter tests hold chunked logits to 1e-4 too; whole, they are exact).
    assert_prompt_logprobs(
        got, *reference(path, prompt=PROMPT), K, 1e-4 if family == "qwen3_5" else TOLERANCE
    )


def test_a_long_prompts_logprobs_come_whole_through_the_stack(shared_stack, tiny_models):
    """A raw prompt of over 15,000 tokens with prompt_logprobs=20: its 320,000+ entries pass the 4
    MiB one gRPC message carries, and prefill refused it (413). They travel in pieces now (prefill
    -> gateway, gateway -> SDK): the HTTP answer and the SDK's AskResult have all of them, each
    equal to the unsplit model's full forward."""
    from epd.stages.server_config import MAX_MESSAGE_BYTES
    from epd.transport import convert

    long_prompt = " ".join([PROMPT] * 500)
    ids, logprobs = reference(tiny_models["qwen2_vl"], prompt=long_prompt)
    assert len(ids) > 15_000
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0, timeout=300
    )
    completion = http.completions.create(
        model="epd", prompt=long_prompt, max_tokens=1, extra_body={"prompt_logprobs": 20}
    ).model_dump()
    assert_json_prompt_logprobs(completion["choices"][0]["prompt_logprobs"], ids, logprobs, 20)
    with EpdClient(shared_stack.gateway, timeout_s=300) as client:
        result = client.ask(None, prompt=long_prompt, max_new_tokens=1, prompt_logprobs=20)
    assert result.num_prompt_tokens == len(ids)
    assert_prompt_logprobs(result.prompt_logprobs, ids, logprobs, 20)
    assert result.prompt_logprobs is not None  # what one message could not carry:
    assert sum(convert.logprob_to_proto(lp).ByteSize() for lp in result.prompt_logprobs) > MAX_MESSAGE_BYTES


def test_prompt_logprobs_past_the_gateways_memory_bound_are_refused_before_the_prompt_runs(
    tiny_models, monkeypatch
):
    """prompt tokens x (k + 1) entries past MAX_PROMPT_LOGPROB_ENTRIES (what the gateway holds for
    one answer) are refused (413) before any forward, saying the most prompt tokens at that k."""
    import epd.prefill_svc.request_checks as request_checks
    from epd.prefill_svc.engine import PrefillEngine
    from epd.prefill_svc.whole_prefill import prefill_alone
    from epd.stages.errors import ResourceExhausted
    from epd.stages.messages import Message

    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    engine = PrefillEngine(PrefillConfig(model=model), load_adapter(model, "prefill"))
    messages = [Message.user(PROMPT + " " + TEXT_CHAT[1]["content"][0]["text"])]
    out = prefill_alone(engine, messages, None, GenerationConfig(max_new_tokens=1, prompt_logprobs=20))
    assert out.handle.prompt_logprobs is not None
    num_entries = len(out.handle.prompt_logprobs) * 21
    monkeypatch.setattr(request_checks, "MAX_PROMPT_LOGPROB_ENTRIES", num_entries)
    # at the bound
    prefill_alone(engine, messages, None, GenerationConfig(max_new_tokens=1, prompt_logprobs=20))
    monkeypatch.setattr(request_checks, "MAX_PROMPT_LOGPROB_ENTRIES", 21 * 10)
    with pytest.raises(
        ResourceExhausted, match=r"at most 10 prompt tokens at this k\); ask for fewer top tokens"
    ):
        prefill_alone(engine, messages, None, GenerationConfig(max_new_tokens=1, prompt_logprobs=20))
