"""Logprobs (OpenAI's and vLLM's `logprobs` / `top_logprobs`): each generated token's log-probability
and the k most likely tokens', equal within 1e-5 to `torch.log_softmax` of the logits that the
unsplit model's `generate(do_sample=False, output_logits=True, return_dict_in_generate=True)` gives,
(absolute, or relative where larger) with the same top-k ids: in the embedded pipeline, in a decode batch where only some requests ask,
and through the real stack's processes (HTTP chat and completions, plain and streamed, gRPC and the
SDK). They are of the raw distribution (vLLM's default raw_logprobs): sampling settings change the
tokens drawn, not the numbers reported for them."""

from __future__ import annotations

import asyncio
import math

import grpc
import openai
import pytest
import torch

from epd.client import EpdClient, EpdError, TokenDelta
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.logprobs import MAX_LOGPROBS, TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import from_chat_template
from epd.stages.raw_prompt import RawPrompt
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.reference import decode_for_test, logprobs_reference

TOLERANCE = 1e-5
"""Absolute, or relative to the value where that is larger (`close`): float32 log_softmax of logits
that a batched or cached forward rounds differently from generate()'s (a few ulps of a value near
-8 are 1e-5 already)."""


def close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


MAX_TOKENS = 10
NUM_FRAMES = 4
K = 5
PROMPT = "Once upon a time, in a land far away,"
TEXT_CHAT = [
    {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
    {"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]},
]
OTHER_CHAT = [{"role": "user", "content": [{"type": "text", "text": "name a colour"}]}]
VIDEO_CHAT = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]


def assert_equal_reference(
    got: list[tuple[float, list[tuple[int, float]]]], want_ids: list[int], reference: torch.Tensor, k: int
) -> None:
    """got: per token (its logprob, [(top id, top logprob)] in rank order); reference: generate()'s
    log_softmax [tokens, vocab] for the tokens `want_ids`."""
    assert len(got) == len(want_ids)
    for i, (logprob, top) in enumerate(got):
        assert close(logprob, float(reference[i, want_ids[i]])), (i, logprob)
        values, ids = torch.topk(reference[i], k)
        assert [t for t, _ in top] == ids.tolist(), i
        assert all(close(v, w) for (_, v), w in zip(top, values.tolist(), strict=True)), i


def of_tokens(logprobs: list[TokenLogprob] | None) -> list[tuple[float, list[tuple[int, float]]]]:
    assert logprobs is not None
    return [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in logprobs]


def chat_request(messages: list[dict], logprobs: int | None, media: MediaInput | None = None) -> AskRequest:
    generation = GenerationConfig(max_new_tokens=MAX_TOKENS, logprobs=logprobs)
    return AskRequest(from_chat_template(messages), media, SamplingOptions(num_frames=NUM_FRAMES), generation)


# -- the embedded pipeline ------------------------------------------------------------------------


def test_logprobs_equal_generate_in_a_batch_where_only_some_ask(tiny_models, media_files):
    """Four requests at once, so prefill and decode batch them: a video question with k = 5, a
    text-only chat with k = 20 (the most), a raw prompt with k = 0 (the sampled token's alone) and
    a chat that does not ask (no logprobs, its tokens as generate()'s)."""
    path = tiny_models["qwen2_vl"]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:

        async def run() -> list[AskSummary]:
            raw = AskRequest([], raw_prompt=RawPrompt(text=PROMPT),
                             generation=GenerationConfig(max_new_tokens=MAX_TOKENS, logprobs=0))  # fmt: skip
            return await asyncio.gather(
                request_summary(pipeline, chat_request(VIDEO_CHAT, K, MediaInput(media_files["mp4"].read_bytes()))),
                request_summary(pipeline, chat_request(TEXT_CHAT, MAX_LOGPROBS)),
                request_summary(pipeline, raw),
                request_summary(pipeline, chat_request(OTHER_CHAT, None)),
            )  # fmt: skip

        with_video, text, raw, without = asyncio.run(run())
    cases = (
        (with_video, logprobs_reference(path, MAX_TOKENS, VIDEO_CHAT, video), K),
        (text, logprobs_reference(path, MAX_TOKENS, TEXT_CHAT), MAX_LOGPROBS),
        (raw, logprobs_reference(path, MAX_TOKENS, prompt=PROMPT), 0),
    )
    for summary, (want, reference), k in cases:
        assert summary.token_ids == want
        assert len(set(want)) > 2, "the tiny model repeats one token; the comparison would prove little"
        assert [lp.token_id for lp in summary.logprobs or ()] == want
        assert_equal_reference(of_tokens(summary.logprobs), want, reference, k)
    assert without.logprobs is None
    assert without.token_ids == logprobs_reference(path, MAX_TOKENS, OTHER_CHAT)[0]
    _, processor = whole_model(path)
    first = text.logprobs[0] if text.logprobs else None
    assert first is not None and first.token == processor.tokenizer.decode([first.token_id])


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling(tiny_models):
    """Temperature, top-k, a repetition penalty and a logit bias change the tokens drawn, not the
    numbers reported: each is log_softmax of the model's own logits for its position (the unsplit
    model run over the prompt and the drawn tokens), and the drawn token has its own value even
    where it is not among the k most likely."""
    path = tiny_models["qwen2_vl"]
    model, processor = whole_model(path)
    ids = processor.tokenizer(PROMPT).input_ids
    generation = GenerationConfig(
        max_new_tokens=MAX_TOKENS, temperature=1.5, top_k=50, seed=7, repetition_penalty=1.3,
        logit_bias=((ids[-1], 5.0),), logprobs=1,
    )  # fmt: skip
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        request = AskRequest([], raw_prompt=RawPrompt(text=PROMPT), generation=generation)
        summary = asyncio.run(request_summary(pipeline, request))
    drawn = summary.token_ids
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + drawn])).logits[0, len(ids) - 1 : -1]  # [tokens, vocab]
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert_equal_reference(of_tokens(summary.logprobs), drawn, reference, 1)
    outside = [i for i, lp in enumerate(summary.logprobs or ()) if lp.top[0].token_id != lp.token_id]
    assert outside, "every drawn token was the most likely one: the sampling settings proved nothing"


def test_logprobs_are_raw_under_allowed_token_ids_and_bad_words_in_one_batch(tiny_models):
    """vLLM's raw_logprobs come before allowed_token_ids and bad_words too ("raw means the values
    before applying any logit processors, like bad words"): two requests decoding in one batch, one
    allowed only tokens outside the model's favourites, one banned its favourite first token, report
    log_softmax of the model's own logits (a banned or disallowed token keeps its value, not -inf),
    and the tokens they drew obey their masks."""
    path = tiny_models["qwen2_vl"]
    model, processor = whole_model(path)
    tokenizer = processor.tokenizer
    ids = tokenizer(PROMPT).input_ids
    greedy, _ = logprobs_reference(path, MAX_TOKENS, prompt=PROMPT)
    with torch.inference_mode():
        first_logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    favourites = torch.topk(first_logits, 50).indices.tolist()
    allowed = tuple(t for t in range(first_logits.numel()) if t not in favourites)
    # A word of one token that greedy decoding generates: banned, the answer must change.
    word = next(
        w
        for t in greedy
        if (w := tokenizer.decode([t]).strip()).isalpha()
        and [t] in (tokenizer(f, add_special_tokens=False).input_ids for f in (w, " " + w))
    )
    banned = {s[-1] for s in (tokenizer(f, add_special_tokens=False).input_ids for f in (word, " " + word))}

    def raw(generation: GenerationConfig) -> AskRequest:
        return AskRequest([], raw_prompt=RawPrompt(text=PROMPT), generation=generation)

    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:

        async def run() -> list[AskSummary]:
            return await asyncio.gather(
                request_summary(pipeline, raw(GenerationConfig(max_new_tokens=MAX_TOKENS, allowed_token_ids=allowed, logprobs=K))),
                request_summary(pipeline, raw(GenerationConfig(max_new_tokens=MAX_TOKENS, bad_words=(word,), logprobs=K))),
            )  # fmt: skip

        masked, without_word = asyncio.run(run())
    assert set(masked.token_ids) <= set(allowed)
    assert not banned & set(without_word.token_ids)
    for summary in (masked, without_word):
        assert summary.token_ids != greedy, "the mask changed nothing: the test would prove little"
        drawn = summary.token_ids
        with torch.inference_mode():
            # [tokens, vocab]: the logits at each drawn token's position
            logits = model(input_ids=torch.tensor([ids + drawn])).logits[0, len(ids) - 1 : -1]
        assert_equal_reference(of_tokens(summary.logprobs), drawn, torch.log_softmax(logits.float(), -1), K)
    assert masked.logprobs and masked.logprobs[0].top[0].token_id in favourites  # a disallowed token, raw


def test_a_request_decoding_alone_computes_the_same_logprobs(tiny_models):
    """A Generation that decodes alone (its own cache: decode-stage eviction's way) computes its
    logprobs itself, in `accept`, and they equal generate()'s as the batch's do."""
    from epd.decode_svc.engine import DecodeEngine
    from epd.model_runtime.loader import load_adapter
    from epd.model_runtime.logprobs import rows_logprobs, token_logprob
    from epd.stages.messages import to_chat_template

    path = tiny_models["qwen2_vl"]
    want, reference = logprobs_reference(path, MAX_TOKENS, TEXT_CHAT)
    adapter = load_adapter(ModelConfig(model=str(path)), "prefill")
    prompt = adapter.build_prompt(to_chat_template(from_chat_template(TEXT_CHAT), ""), None)
    state = adapter.prefill(prompt, torch.empty(0, adapter.hidden_size))
    first = int(state.last_logits.argmax())
    first_logprob = token_logprob(rows_logprobs(state.last_logits[None], [K])[0], first, adapter.token_text)
    generation = DecodeEngine(adapter).start(
        state.cache, first, [int(x) for x in state.next_position_ids],
        GenerationConfig(max_new_tokens=MAX_TOKENS, logprobs=K), own_cache=True, first_logprob=first_logprob,
    )  # fmt: skip
    steps = [generation.first()] + [generation.step() for _ in range(MAX_TOKENS - 1)]
    logprobs = [lp for step in steps for lp in step.logprobs or ()]
    assert [lp.token_id for lp in logprobs] == want
    assert_equal_reference(of_tokens(logprobs), want, reference, K)


def test_a_logprobs_request_over_the_limit_is_refused_before_the_media(tiny_models, media_files):
    from epd.prefill_svc.config import PrefillConfig

    path = tiny_models["qwen2_vl"]
    prefill = PrefillConfig(model=ModelConfig(model=str(path)), max_logprobs=3)
    with build_embedded_pipeline(ModelConfig(model=str(path)), prefill=prefill) as pipeline:
        media = MediaInput(media_files["mp4"].read_bytes())
        with pytest.raises(InvalidRequest, match=r"must be between 0 and 3 \(--max-logprobs\), got 4"):
            asyncio.run(request_summary(pipeline, chat_request(VIDEO_CHAT, 4, media)))
        # The prefill stage's own check, for a caller other than the gateway's pipeline.
        with pytest.raises(InvalidRequest, match=r"between 0 and 3 \(--max-logprobs\), got 4"):
            pipeline.prefill.engine.validate(
                from_chat_template(TEXT_CHAT), None, GenerationConfig(max_new_tokens=2, logprobs=4)
            )
        assert asyncio.run(request_summary(pipeline, chat_request(TEXT_CHAT, 3))).logprobs is not None


def test_more_logprobs_than_the_vocabulary_are_refused_before_any_token(tiny_models):
    """--max-logprobs may pass the vocabulary (up to 2**20: "every token"); a request asking for more
    top tokens than the vocabulary holds is refused by the front door and prefill alike, before a
    token goes out, not by the decoder after prefill's first token was sent (INVALID_ARGUMENT mid-
    answer); the whole vocabulary is served."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.stages.contracts import TokenStep

    path = tiny_models["qwen2_vl"]
    prefill = PrefillConfig(model=ModelConfig(model=str(path)), max_logprobs=1 << 20)
    with build_embedded_pipeline(ModelConfig(model=str(path)), prefill=prefill) as pipeline:
        vocab_size = pipeline.prefill.engine.adapter.vocab_size
        sent: list[TokenStep] = []

        async def run(k: int) -> None:
            async for item in pipeline.ask(chat_request(TEXT_CHAT, k)):
                if isinstance(item, TokenStep):
                    sent.append(item)

        bound = rf"between 0 and {vocab_size} \(this model's vocabulary size\), got {vocab_size + 1}"
        with pytest.raises(InvalidRequest, match=bound):
            asyncio.run(run(vocab_size + 1))
        assert not sent
        with pytest.raises(InvalidRequest, match=bound):
            pipeline.prefill.engine.validate(
                from_chat_template(TEXT_CHAT),
                None,
                GenerationConfig(max_new_tokens=2, logprobs=vocab_size + 1),
            )
        summary = asyncio.run(request_summary(pipeline, chat_request(TEXT_CHAT, vocab_size)))
        assert summary.logprobs and all(len(lp.top) == vocab_size for lp in summary.logprobs)


# -- the real stack: HTTP (openai client), gRPC and the SDK ---------------------------------------


def test_logprobs_through_the_stack_plain_streamed_and_over_grpc(shared_stack, tiny_models):
    path = tiny_models["qwen2_vl"]
    _, processor = whole_model(path)

    def text(token_id: int) -> str:
        return processor.tokenizer.decode([token_id])

    want, reference = logprobs_reference(path, MAX_TOKENS, TEXT_CHAT)
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    messages = [{"role": m["role"], "content": m["content"][0]["text"]} for m in TEXT_CHAT]
    ids_asked = {"return_token_ids": True}
    reply = http.chat.completions.create(
        model="epd",
        messages=messages,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=K,
        extra_body=ids_asked,
    )
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == want and choice.logprobs and choice.logprobs.content

    def check_content(content: list) -> None:
        assert len(content) == len(want)
        for i, entry in enumerate(content):
            assert entry.token == text(want[i])
            assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
            assert close(entry.logprob, float(reference[i, want[i]]))
            ids = torch.topk(reference[i], K).indices.tolist()
            assert [t.token for t in entry.top_logprobs] == [text(t) for t in ids]
            assert all(
                close(t.logprob, float(reference[i, j])) for t, j in zip(entry.top_logprobs, ids, strict=True)
            )

    check_content(choice.logprobs.content)
    streamed = [
        c
        for c in http.chat.completions.create(
            model="epd",
            messages=messages,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            top_logprobs=K,
            stream=True,
            extra_body=ids_asked,
        )
        if c.choices
    ]
    # Each chunk carries its own tokens' logprobs (this prompt's KV now comes from the prefix
    # cache, so the values may round differently from the plain answer's: both are checked).
    for chunk in streamed:
        tokens = chunk.choices[0].model_extra.get("token_ids") or []
        assert len(chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []) == len(tokens)
    check_content([e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content])
    plain = http.chat.completions.create(
        model="epd", messages=messages, max_tokens=MAX_TOKENS, extra_body=ids_asked
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].model_extra["token_ids"] == want
    just_sampled = http.chat.completions.create(model="epd", messages=messages, max_tokens=2, logprobs=True)
    assert [e.top_logprobs for e in just_sampled.choices[0].logprobs.content] == [[], []]

    raw_want, raw_reference = logprobs_reference(path, MAX_TOKENS, prompt=PROMPT)
    completion = http.completions.create(model="epd", prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens == [text(t) for t in raw_want]
    assert all(
        close(v, float(raw_reference[i, t])) for i, (v, t) in enumerate(zip(lp.token_logprobs, raw_want))
    )
    for i, top in enumerate(lp.top_logprobs or []):
        # The sampled token (greedy: the most likely) and the 2 most likely, keyed by their text as
        # OpenAI's and vLLM's (two ids of the same text, such as two halves of characters, share a key).
        ids = [raw_want[i], *torch.topk(raw_reference[i], 2).indices.tolist()]
        want_top = {text(t): float(raw_reference[i, t]) for t in ids}
        assert list(top) == list(want_top) and all(close(top[t], v) for t, v in want_top.items())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [
        c.choices[0]
        for c in http.completions.create(
            model="epd", prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2, stream=True
        )
        if c.choices and c.choices[0].logprobs
    ]
    streamed_values = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert all(
        close(v, float(raw_reference[i, t]))
        for i, (v, t) in enumerate(zip(streamed_values, raw_want, strict=True))
    )
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens

    for body, match in (
        (
            {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
            r"between 0 and 20 \(--max-logprobs\), got 21",
        ),
        ({"top_logprobs": 2}, '"logprobs": true'),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            http.chat.completions.create(model="epd", messages=messages, max_tokens=2, **body)

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(None, messages=TEXT_CHAT, max_new_tokens=MAX_TOKENS, logprobs=K)
        assert result.token_ids == want and [lp.token_id for lp in result.logprobs or ()] == want
        assert_equal_reference(of_tokens(result.logprobs), want, reference, K)
        assert result.to_dict()["logprobs"][0]["top"][0]["token_id"] == want[0]
        deltas = [e for e in client.stream(None, messages=TEXT_CHAT, max_new_tokens=MAX_TOKENS, logprobs=0)
                  if isinstance(e, TokenDelta)]  # fmt: skip
        streamed_lp = [lp for d in deltas for lp in d.logprobs or ()]
        assert [lp.token_id for lp in streamed_lp] == want and all(lp.top == () for lp in streamed_lp)
        assert all(close(lp.logprob, float(reference[i, want[i]])) for i, lp in enumerate(streamed_lp))
        assert client.ask(None, messages=TEXT_CHAT, max_new_tokens=2).logprobs is None
        with pytest.raises(EpdError, match=r"between 0 and 20 \(--max-logprobs\), got 21") as info:
            client.ask(None, messages=TEXT_CHAT, max_new_tokens=2, logprobs=21)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not math.isnan(reference.sum())
