"""vLLM's sampling options through the disaggregated stack (three service processes and the
gateway): greedy with a repetition penalty or min_tokens gives exactly `generate()`'s tokens on the
unsplit model (min_tokens holds end-of-sequence back under ignore_eos too); presence and
frequency penalties equal a reference computed from the unsplit model's logits; logit_bias and stop_token_ids work through the OpenAI HTTP API; allowed_token_ids
and bad_words give exactly `generate()`'s tokens with transformers' own masks (its
prefix_allowed_tokens_fn and bad_words_ids) through the stack and the embedded pipeline."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from epd.client import EpdClient
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions
from tests.integration.gateway_http import post_embedded
from tests.local_http import post_json
from tests.reference import decode_for_test, reference_tokens
from tests.stack import ROOT, Stack

QUESTION = "what colour is the moving square?"
NUM_FRAMES = 4
MAX_NEW_TOKENS = 16
SHIPPED = ROOT / "models" / "epd-tiny-videoqa"
SAMPLE = ROOT / "samples" / "sample.mp4"


@pytest.fixture(scope="module")
def video(media_files):
    return decode_for_test(media_files["mp4"], NUM_FRAMES)


@pytest.fixture(scope="module")
def greedy(tiny_models, video):
    return reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, MAX_NEW_TOKENS)


def ask(stack, media, question=QUESTION, num_frames=NUM_FRAMES, **options):
    with EpdClient(stack.gateway, timeout_s=120) as client:
        return client.ask(media, question, num_frames=num_frames, **options)


def test_greedy_with_repetition_penalty_equals_generate(
    shared_stack, tiny_models, media_files, video, greedy
):
    want = reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, MAX_NEW_TOKENS, repetition_penalty=1.3)
    assert want != greedy, "the penalty changes nothing here; the comparison would prove little"
    result = ask(shared_stack, media_files["mp4"], max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=1.3)
    assert result.token_ids == want
    # < 1 favours repeats, over the prompt's tokens too
    want = reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, MAX_NEW_TOKENS, repetition_penalty=0.7)
    assert (
        ask(shared_stack, media_files["mp4"], max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=0.7).token_ids
        == want
    )


def test_the_penalised_prompt_ids_are_what_generate_sees(tiny_models, video, media_files):
    """HF's repetition penalty covers the whole input_ids, the media placeholders included: the
    distinct prompt ids prefill hands to decode are exactly those; none are sent when it is off."""
    handles = []
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        prefill = pipeline.prefill.prefill

        async def capture(*args, **kwargs):
            handles.append(await prefill(*args, **kwargs))
            return handles[-1]

        pipeline.prefill.prefill = capture  # type: ignore[method-assign]

        async def run(generation):
            request = AskRequest(
                question_messages(QUESTION),
                MediaInput(media_files["mp4"].read_bytes()),
                SamplingOptions(num_frames=NUM_FRAMES),
                generation,
            )
            return [x async for x in pipeline.ask(request) if isinstance(x, AskSummary)][0]

        asyncio.run(run(GenerationConfig(max_new_tokens=2, repetition_penalty=1.3)))
        asyncio.run(run(GenerationConfig(max_new_tokens=2)))
    model, processor = whole_model(tiny_models["qwen2_vl"])
    input_ids = reference_inputs(processor, video, question_message(video, QUESTION))["input_ids"][0].tolist()
    assert handles[0].distinct_prompt_token_ids == sorted(set(input_ids))
    assert model.config.video_token_id in handles[0].distinct_prompt_token_ids
    assert handles[1].distinct_prompt_token_ids == []


class OpenAIPenalties(LogitsProcessor):
    """The reference: OpenAI's presence and frequency penalties on the unsplit model's logits, over
    the generated tokens only. input_ids [1, prompt + generated], scores [1, vocab]."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.num_prompt_tokens :], minlength=scores.shape[-1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (1.5, 0.0), (-0.5, 0.8)])
def test_presence_and_frequency_penalties_equal_a_reference_on_the_unsplit_model(
    shared_stack, tiny_models, media_files, video, greedy, presence, frequency
):
    _, processor = whole_model(tiny_models["qwen2_vl"])
    num_prompt = reference_inputs(processor, video, question_message(video, QUESTION))["input_ids"].shape[1]
    penalties = LogitsProcessorList([OpenAIPenalties(num_prompt, presence, frequency)])
    want = reference_tokens(
        tiny_models["qwen2_vl"], video, QUESTION, MAX_NEW_TOKENS, logits_processor=penalties
    )
    assert want != greedy, "the penalties change nothing here; the comparison would prove little"
    result = ask(
        shared_stack,
        media_files["mp4"],
        max_new_tokens=MAX_NEW_TOKENS,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    assert result.token_ids == want


@pytest.fixture(scope="module")
def shipped_stack(tmp_path_factory):
    """The trained default model, which ends its answers with end-of-sequence after a word or two
    (the tiny random models never do): what min_tokens holds back."""
    with Stack(SHIPPED, tmp_path_factory.mktemp("logs_shipped")) as s:
        yield s


@pytest.mark.parametrize("min_tokens", [4, 6])
def test_greedy_with_min_tokens_equals_generate_min_new_tokens(shipped_stack, min_tokens):
    question = "how many objects are there in the video?"
    sample = decode_for_test(SAMPLE, 8)
    plain = reference_tokens(SHIPPED, sample, question, 10)
    assert len(plain) < min_tokens, "the model's own answer is long enough; min_tokens would change nothing"
    want = reference_tokens(SHIPPED, sample, question, 10, min_new_tokens=min_tokens)
    result = ask(shipped_stack, SAMPLE, question, num_frames=8, max_new_tokens=10, min_tokens=min_tokens)
    assert result.token_ids == want
    assert len(want) > min_tokens and result.finish_reason == "stop"  # end-of-sequence right after


def test_min_tokens_holds_back_end_of_sequence_under_ignore_eos_too(shipped_stack):
    """vLLM holds every end-of-sequence id back before min_tokens whatever ignore_eos says; after
    it, ignore_eos lets end-of-sequence out without ending the answer."""
    question = "how many objects are there in the video?"
    sample = decode_for_test(SAMPLE, 8)
    want = reference_tokens(SHIPPED, sample, question, 10, min_new_tokens=4)  # ends at end-of-sequence
    result = ask(
        shipped_stack, SAMPLE, question, num_frames=8, max_new_tokens=10, min_tokens=4, ignore_eos=True
    )
    assert len(want) < 10 and result.token_ids[: len(want)] == want
    assert len(result.token_ids) == 10 and result.finish_reason == "length"


def chat_body(media_files, max_tokens: int = 8, **fields) -> dict:
    """A chat request about the mp4 with QUESTION and `fields`."""
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    return {"model": "epd", "max_tokens": max_tokens, "media": {"num_frames": NUM_FRAMES}, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip


def chat(port: int, media_files, max_tokens: int = 8, stream: bool = False, **fields) -> tuple[int, dict]:
    return post_json(port, "/v1/chat/completions", chat_body(media_files, max_tokens, **fields))


def test_a_large_logit_bias_forces_its_token_through_the_http_api(shared_stack, media_files, greedy):
    forced = next(t for t in range(10, 500) if t not in greedy[:4])
    status, body = chat(shared_stack.http_port, media_files, max_tokens=4, logit_bias={str(forced): 100})
    assert status == 200, body
    assert body["epd"]["token_ids"] == [forced] * 4
    status, body = chat(shared_stack.http_port, media_files, max_tokens=4, logit_bias={str(greedy[0]): -100})
    assert status == 200 and body["epd"]["token_ids"][0] != greedy[0]  # the first token too (prefill's)


def test_stop_token_ids_end_the_answer_through_the_http_api(shared_stack, media_files, greedy):
    """The stop token is the last token; its text is in the answer only with include_stop_str_in_output."""
    port = shared_stack.http_port
    i = next(k for k in range(2, 8) if greedy[k] not in greedy[:k])
    status, body = chat(port, media_files, stop_token_ids=[greedy[i]])
    assert status == 200, body
    assert body["epd"]["token_ids"] == greedy[: i + 1]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert (
        body["choices"][0]["message"]["content"]
        == chat(port, media_files, max_tokens=i)[1]["choices"][0]["message"]["content"]
    )
    status, body = chat(port, media_files, stop_token_ids=[greedy[i]], include_stop_str_in_output=True)
    with_stop = chat(port, media_files, max_tokens=i + 1)[1]["choices"][0]["message"]["content"]
    assert body["choices"][0]["message"]["content"] == with_stop
    # prefill's first token is a stop token: the decoder ends the answer at once
    status, body = chat(port, media_files, stop_token_ids=[greedy[0]])
    assert (body["epd"]["token_ids"], body["choices"][0]["message"]["content"]) == ([greedy[0]], "")


def vllm_bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """The reference's token sequences of a bad word, by vLLM's rule: the word with its leading
    spaces stripped, and with one leading space when that gives another first token and as many."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])


def masked_reference(model, video, allowed=None, bad_words_ids=None) -> list[int]:
    """generate()'s greedy tokens with transformers' own masks: only `allowed` (its
    prefix_allowed_tokens_fn), none of `bad_words_ids` (its bad_words_ids)."""
    masks = {} if allowed is None else {"prefix_allowed_tokens_fn": lambda batch, ids: allowed}
    masks |= {} if bad_words_ids is None else {"bad_words_ids": bad_words_ids}
    return reference_tokens(model, video, QUESTION, MAX_NEW_TOKENS, **masks)


def test_allowed_token_ids_greedy_equals_generate_with_the_same_mask(
    shared_stack, tiny_models, media_files, video, greedy
):
    """Every token, prefill's first included, is the argmax over the allowed ones (transformers'
    prefix_allowed_tokens_fn masks the same logits of the unsplit model), on gRPC and over HTTP."""
    allowed = sorted(set(range(100, 160)) - set(greedy))
    want = masked_reference(tiny_models["qwen2_vl"], video, allowed)
    assert set(want) <= set(allowed) and len(set(want)) > 1, want
    result = ask(shared_stack, media_files["mp4"], max_new_tokens=MAX_NEW_TOKENS, allowed_token_ids=allowed)
    assert result.token_ids == want
    status, body = chat(
        shared_stack.http_port, media_files, max_tokens=MAX_NEW_TOKENS, allowed_token_ids=allowed
    )
    assert status == 200 and body["epd"]["token_ids"] == want, body


def _two_token_bad_word(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(k, a word whose token sequences hold tokens[k:k + 2]) for the first k >= 1 there is one:
    a word of two tokens both in the answer, whose ban changes the answer from its token k + 1."""
    for k in range(1, len(tokens) - 1):
        word = tokenizer.decode(tokens[k : k + 2])
        if tokens[k : k + 2] in vllm_bad_word_ids(tokenizer, word) and tokens[k + 1] not in tokens[:k]:
            return k, word
    raise AssertionError(f"no two tokens of {tokens} make a word; the test needs another question")


def test_bad_words_greedy_equals_generate_with_bad_words_ids(
    shared_stack, tiny_models, media_files, video, greedy, tokenizer
):
    """A word of one token is banned from the first token on (prefill's); a word of two tokens has
    its second banned only right after its first. transformers' bad_words_ids of the same token
    sequences on the unsplit model is the reference."""
    model = tiny_models["qwen2_vl"]
    first_word = tokenizer.decode(greedy[:1])
    sequences = vllm_bad_word_ids(tokenizer, first_word)
    assert [greedy[0]] in sequences, (first_word, sequences)
    want = masked_reference(model, video, bad_words_ids=sequences)
    assert want[0] != greedy[0] and greedy[0] not in want
    result = ask(shared_stack, media_files["mp4"], max_new_tokens=MAX_NEW_TOKENS, bad_words=[first_word])
    assert result.token_ids == want

    k, word = _two_token_bad_word(tokenizer, greedy)
    want = masked_reference(model, video, bad_words_ids=vllm_bad_word_ids(tokenizer, word))
    assert want[: k + 1] == greedy[: k + 1] and want[k + 1] != greedy[k + 1], (want, greedy, k)
    status, body = chat(shared_stack.http_port, media_files, max_tokens=MAX_NEW_TOKENS, bad_words=[word])
    assert status == 200 and body["epd"]["token_ids"] == want, body


def test_allowed_token_ids_and_bad_words_in_the_embedded_pipeline_over_http(
    tiny_models, media_files, video, greedy, tokenizer
):
    """The colocated server's path (`epd serve --colocate`: the HTTP API over the local stages in
    one process): both masks at once equal generate() with both of transformers' masks."""
    allowed = sorted(set(range(100, 200)) - set(greedy))
    only_allowed = masked_reference(tiny_models["qwen2_vl"], video, allowed)
    # a word of one token the answer holds after its first token: banned from then on
    word = next(
        tokenizer.decode([t])
        for t in only_allowed[1:]
        if [t] in vllm_bad_word_ids(tokenizer, tokenizer.decode([t]))
    )
    want = masked_reference(tiny_models["qwen2_vl"], video, allowed, vllm_bad_word_ids(tokenizer, word))
    assert want != only_allowed and set(want) <= set(allowed)
    body = chat_body(media_files, MAX_NEW_TOKENS, allowed_token_ids=allowed, bad_words=[word])
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        [(status, answer)] = post_embedded(pipeline, ("/v1/chat/completions", body))
    assert status == 200 and answer["epd"]["token_ids"] == want, answer


def test_masks_that_leave_no_token_are_a_400_saying_so(shared_stack, media_files, tokenizer):
    """Every logit at -inf: the argmax said token 0, which the request never allowed."""
    [red] = tokenizer.encode("red", add_special_tokens=False)
    status, body = chat(shared_stack.http_port, media_files, allowed_token_ids=[red], bad_words=["red"])
    assert status == 400, body
    assert (
        "allowed_token_ids, bad_words leave no token this request may generate next"
        in body["error"]["message"]
    )
    _, alone = chat(shared_stack.http_port, media_files, max_tokens=2, allowed_token_ids=[red])
    assert alone["epd"]["token_ids"] == [red, red]  # one allowed token: it, at every step


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be between 0 and max_new_tokens \(4: the OpenAI API's max_tokens"),
    ({"logit_bias": {"512": 1}}, r"logit_bias: token id 512 is outside 0 to 511 \(this model's vocabulary\)"),
    ({"stop_token_ids": [100000]}, r"stop_token_ids: token id 100000 is outside 0 to 511"),
    ({"allowed_token_ids": [5, 512]}, r"allowed_token_ids: token id 512 is outside 0 to 511 \(this model's vocabulary\)"),
    ({"allowed_token_ids": []}, r"'allowed_token_ids' is empty, which allows no token"),
    ({"bad_words": ["  "]}, r"bad_words cannot contain an empty string or one of spaces alone"),
    ({"repetition_penalty": -1}, r"'repetition_penalty' must be a finite number > 0"),
])  # fmt: skip
def test_bad_sampling_options_are_400s_naming_the_field(shared_stack, media_files, fields, message):
    import re

    status, body = chat(shared_stack.http_port, media_files, **fields)
    assert status == 400 and re.search(message, body["error"]["message"]), body


def _stream_events(port: int, media_files, **fields) -> list[dict]:
    """The JSON events of a streamed chat answer (the HTTP status is 200 once it has started)."""
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    body = {"model": "epd", "media": {"num_frames": NUM_FRAMES}, "stream": True, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        lines = reply.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


NOT_FINITE = "scores for this request's next token are not finite numbers"


def test_scores_a_request_sends_past_the_float_range_fail_it_alone_with_what_to_change(
    shared_stack, media_files
):
    """A repetition_penalty far below 1 divides positive scores past the largest float: the sampler
    cannot draw from them. That is the request's failure, not its replica's: prefill's first token
    said "prefill stage failed" (HTTP 500), and a later token in decode "the decode replica failed
    after N tokens" (502), as if the replica had died. Now a 400 that names the setting, and the
    stack serves the next request."""
    port = shared_stack.http_port
    status, body = chat(port, media_files, temperature=1.0, seed=0, repetition_penalty=1e-40)
    assert status == 400, body
    message = body["error"]["message"]
    assert NOT_FINITE in message and "repetition_penalty 1e-40" in message and "nearer 1" in message, body
    # A penalty that leaves prefill's scores finite and sends a later token's past the range (the
    # seen tokens' scores grow with the answer): one whose failure comes mid-answer, in decode.
    mid_answer = None
    for penalty in (2e-38, 1.5e-38, 2.5e-38, 1.8e-38, 1.2e-38):
        events = _stream_events(
            port, media_files, max_tokens=16, temperature=1.0, seed=0, repetition_penalty=penalty
        )
        content = [
            e for e in events if "choices" in e and any(c["delta"].get("content") for c in e["choices"])
        ]
        errors = [e["error"] for e in events if "error" in e]
        if content and errors:
            mid_answer = errors
            break
    assert mid_answer is not None, "no penalty failed mid-answer; the decode path went untested"
    (error,) = mid_answer
    assert error["code"] == 400 and NOT_FINITE in error["message"], error
    assert "replica failed" not in error["message"]
    status, body = chat(port, media_files)
    assert status == 200, body


BEYOND_LOGITS = "epdbeyondlogits"
"""A word the tokenizer below has as one added token, whose id is past the model's logits."""


@pytest.fixture(scope="module")
def wide_tokenizer_stack(tmp_path_factory):
    """A stack whose tokenizer holds one token more than the model has logits (BEYOND_LOGITS): a
    bad word with that token is one this model cannot ban."""
    from transformers import AutoProcessor

    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    model = build_checkpoint(tmp_path_factory.mktemp("wide_tokenizer"), TinyVLMSpec(family="qwen2_vl"))
    processor = AutoProcessor.from_pretrained(str(model))
    processor.tokenizer.add_tokens([BEYOND_LOGITS])
    processor.save_pretrained(model)
    extra = {}
    with Stack(model, tmp_path_factory.mktemp("logs_wide_tokenizer"), extra=extra, http=True) as s:
        yield s


def _prefill_requests_and_steps(http_port: int) -> tuple[float, float]:
    """Prefill's epd_engine_requests_total and epd_engine_steps_total, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values = {"epd_engine_requests_total": 0.0, "epd_engine_steps_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values and sample.labels["stage"] == "prefill":
                values[sample.name] += sample.value
    return values["epd_engine_requests_total"], values["epd_engine_steps_total"]


def test_a_bad_word_the_model_cannot_ban_is_a_400_before_the_prompt_runs(wide_tokenizer_stack):
    """The bad word is tokenised when prefill admits the request, not at its first token: the
    prefill core never takes it (no request admitted, no step run), and the 400 says what to change."""
    port = wide_tokenizer_stack.http_port

    def chat_text(**fields) -> tuple[int, dict]:
        body = {"model": "epd", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], **fields}
        return post_json(port, "/v1/chat/completions", body)

    before = _prefill_requests_and_steps(port)
    status, body = chat_text(bad_words=["red", BEYOND_LOGITS])
    assert status == 400, body
    assert "outside its logits (0 to 511); leave out the words that contain them" in body["error"]["message"]
    assert _prefill_requests_and_steps(port) == before
    status, body = chat_text(bad_words=["red"])  # the counters do move for a request that runs
    assert status == 200, body
    requests, steps = _prefill_requests_and_steps(port)
    assert requests == before[0] + 1 and steps > before[1]
