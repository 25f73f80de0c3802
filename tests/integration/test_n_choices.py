"""OpenAI's and vLLM's `n` (several choices of one request) through the disaggregated stack and the
colocated server: the media is encoded and the prompt prefilled once (the cores' request counters
on /metrics), each choice sampled by its own sampler (seed + i, so choice i is the single request
with that seed, token for token), greedy choices all equal generate(); streamed chunks carry their
choice's index, a choice's finish goes out when it finishes while the others go on, and the usage
sums the choices; a default server takes n up to 16 from one client, a request counting once against
its requests in flight; n past 16 is a 400, and the gRPC Ask, which streams
one answer, refuses n > 1; a client that leaves frees every choice's decoder and the cache."""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from PIL import Image

from epd.client import EpdClient
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import MAX_CHOICES
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, messages_pb2
from tests.integration.engine_metrics import _by_stage, _metrics, _wait_until_nothing_is_held
from tests.integration.gateway_http import post_embedded
from tests.local_http import post_json, sse_chunks
from tests.reference import decode_for_test, reference_tokens

QUESTION = "what colour is the moving square?"
NUM_FRAMES = 4
MAX_NEW_TOKENS = 8
SEED = 20261130


@pytest.fixture(scope="module")
def greedy(tiny_models, media_files):
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    return reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, MAX_NEW_TOKENS)


IDS = {"return_token_ids": True}
"""vLLM's field: the choices list their token ids (whole and streamed), which these tests compare."""


def _video_body(media_files, **fields) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    return {"model": "epd", "max_tokens": MAX_NEW_TOKENS, "media": {"num_frames": NUM_FRAMES}, **IDS, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip


def _unseen_image_body(**fields) -> dict:
    """A chat about an image no other test sends: the encoder's token cache cannot serve it, so
    its one encode shows on the encoder core's request counter."""
    pixels = np.random.default_rng(1130).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return {"model": "epd", "max_tokens": MAX_NEW_TOKENS, **IDS, **fields,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is in it?"}]}]}  # fmt: skip


def _tokens(answer: dict) -> list[list[int]]:
    """Each choice's token ids, by index."""
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["token_ids"] for c in answer["choices"]]


def _engine_requests(port: int) -> dict[str, float]:
    return _by_stage(_metrics(port), "epd_engine_requests_total")


def test_seeded_choices_are_the_single_requests_of_seed_plus_i_from_one_encode_and_one_prefill(shared_stack):
    port = shared_stack.http_port
    before = _engine_requests(port)
    status, answer = post_json(
        port, "/v1/chat/completions", _unseen_image_body(n=3, temperature=1.0, seed=SEED)
    )
    assert status == 200, answer
    after = _engine_requests(port)
    # one encode, one prefill, a decode request per choice
    assert {stage: after[stage] - before[stage] for stage in after} == {
        "encoder": 1,
        "prefill": 1,
        "decode": 3,
    }
    choices = _tokens(answer)
    assert len(set(map(tuple, choices))) > 1, "the choices sampled alike; the comparison would prove little"
    for i, choice in enumerate(answer["choices"]):
        status, alone = post_json(
            port, "/v1/chat/completions", _unseen_image_body(temperature=1.0, seed=SEED + i)
        )
        assert status == 200, alone
        [single] = alone["choices"]
        assert (choice["token_ids"], choice["message"], choice["finish_reason"]) == (
            single["token_ids"],
            single["message"],
            single["finish_reason"],
        )
    usage = answer["usage"]
    assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(map(len, choices))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert answer["epd"]["token_ids"] == choices[0]
    _wait_until_nothing_is_held(port)  # every choice's decoder confirmed: the cache is gone


def test_greedy_choices_are_identical_and_equal_generate(shared_stack, media_files, greedy):
    port = shared_stack.http_port
    status, answer = post_json(port, "/v1/chat/completions", _video_body(media_files, n=2))
    assert status == 200, answer
    assert _tokens(answer) == [greedy, greedy]
    status, completion = post_json(
        port,
        "/v1/completions",
        {"model": "epd", "prompt": "the sky is", "max_tokens": MAX_NEW_TOKENS, "n": 2, **IDS},
    )
    status_one, one = post_json(
        port, "/v1/completions", {"model": "epd", "prompt": "the sky is", "max_tokens": MAX_NEW_TOKENS, **IDS}
    )
    assert (status, status_one) == (200, 200), completion
    assert _tokens(completion) == [one["choices"][0]["token_ids"]] * 2
    assert [c["text"] for c in completion["choices"]] == [one["choices"][0]["text"]] * 2


def test_streamed_choices_carry_their_index_and_the_usage_chunk_sums_them(shared_stack, media_files):
    port = shared_stack.http_port
    fields = {"n": 3, "temperature": 1.0, "seed": SEED}
    status, plain = post_json(port, "/v1/chat/completions", _video_body(media_files, **fields))
    assert status == 200, plain
    events = sse_chunks(
        port,
        "/v1/chat/completions",
        _video_body(media_files, stream_options={"include_usage": True}, **fields),
    )
    assert "error" not in events[-1], events[-1]
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(map(len, _tokens(plain)))
    assert last["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    for choice in plain["choices"]:
        mine = [c for e in chunks for c in e["choices"] if c["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}  # each choice opens with its role
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        assert [t for c in mine for t in c.get("token_ids") or []] == choice["token_ids"]
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
    assert {c["index"] for e in chunks for c in e["choices"]} == {0, 1, 2}
    # legacy completions stream the same way
    events = sse_chunks(
        port, "/v1/completions", {"model": "epd", "prompt": "the sky is", "max_tokens": 4, **fields}
    )
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1, 2]


def test_each_choice_has_its_own_logprobs_those_of_its_single_request(shared_stack):
    # Choice i's tokens are the single request's of seed + i, so its logprobs (raw, one per token,
    # its first token's from prefill's own row) must be that request's too: plain and streamed.
    # Equal within float32 rounding: each is another request, whose prefill may reuse a cached
    # prefix or run in another batch (test_logprobs' tolerance).
    port = shared_stack.http_port
    fields = {"n": 3, "temperature": 1.0, "seed": SEED, "logprobs": True, "top_logprobs": 2}
    status, answer = post_json(port, "/v1/chat/completions", _unseen_image_body(**fields))
    assert status == 200, answer
    assert len(set(map(tuple, _tokens(answer)))) > 1, (
        "the choices sampled alike; the check would prove little"
    )
    events = sse_chunks(port, "/v1/chat/completions", _unseen_image_body(**fields))
    assert "error" not in events[-1], events[-1]
    for i, choice in enumerate(answer["choices"]):
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"])
        single_fields = {k: v for k, v in fields.items() if k != "n"} | {"seed": SEED + i}
        status, alone = post_json(port, "/v1/chat/completions", _unseen_image_body(**single_fields))
        assert status == 200, alone
        assert _same_logprobs(content, alone["choices"][0]["logprobs"]["content"])
        streamed = [
            entry
            for e in events
            for c in e["choices"]
            if c["index"] == i and c.get("logprobs")
            for entry in c["logprobs"]["content"]
        ]
        assert _same_logprobs(streamed, content)
    status, completion = post_json(
        port,
        "/v1/completions",
        {"model": "epd", "prompt": "the sky is", "max_tokens": 4, "n": 2, "logprobs": 1, **IDS},
    )
    assert status == 200, completion
    for choice in completion["choices"]:
        assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])


def test_each_choice_keeps_to_the_constraint_with_its_own_grammar_state(shared_stack):
    # One compiled constraint, a matcher per choice: prefill's first tokens and each decoder's
    # advance their own state, so every choice is a whole answer the constraint allows, and
    # choice i is still the single request of seed + i.
    port = shared_stack.http_port
    colours = ["red", "green", "blue", "a yellow square"]
    fields = {"n": 3, "temperature": 1.0, "seed": SEED, "structured_outputs": {"choice": colours}}
    status, answer = post_json(port, "/v1/chat/completions", _unseen_image_body(**fields))
    assert status == 200, answer
    for i, choice in enumerate(answer["choices"]):
        assert choice["message"]["content"] in colours and choice["finish_reason"] == "stop", choice
        single = {k: v for k, v in fields.items() if k != "n"} | {"seed": SEED + i}
        status, alone = post_json(port, "/v1/chat/completions", _unseen_image_body(**single))
        assert status == 200, alone
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]


def _same_logprobs(got: list[dict], want: list[dict]) -> bool:
    """The same tokens at every position, top tokens in the same order, values within 1e-5."""

    def close(a: dict, b: dict) -> bool:
        return a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"], rel=1e-5, abs=1e-5)

    return len(got) == len(want) and all(
        close(g, w)
        and len(g["top_logprobs"]) == len(w["top_logprobs"])
        and all(map(close, g["top_logprobs"], w["top_logprobs"]))
        for g, w in zip(got, want)
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_past_the_limit_is_a_400_saying_what_to_do(shared_stack, media_files, path):
    body = _video_body(media_files, n=17) if path == "/v1/chat/completions" else {"prompt": "a", "n": 17}
    status, answer = post_json(shared_stack.http_port, path, body)
    assert status == 400, answer
    assert "'n' must be an integer from 1 to 16 (choices per request), got 17" in answer["error"]["message"]


def test_a_default_server_takes_n_up_to_16_from_one_client_at_once(shared_stack, media_files):
    """vLLM takes any n up to its own bound (epd's is 16, `MAX_CHOICES`). A request counts once
    against the client's --max-requests-per-client (8 by default), each of its choices a decode
    request reserving its own KV room: counted as n requests, an n from 9 to 16 was a 400 on a
    default server, and two such requests from one client were more than it let in."""
    port = shared_stack.http_port
    body = _video_body(media_files, n=MAX_CHOICES, max_tokens=2, temperature=1.0, seed=SEED)
    with ThreadPoolExecutor(2) as pool:  # both from this one client (peer IP), in flight together
        answers = list(pool.map(lambda _: post_json(port, "/v1/chat/completions", body), range(2)))
    assert [status for status, _ in answers] == [200, 200], answers
    first, second = (_tokens(answer) for _, answer in answers)
    assert len(first) == MAX_CHOICES and first == second  # each choice seeded SEED + its index
    assert answers[0][1]["usage"]["completion_tokens"] == sum(map(len, first))
    _wait_until_nothing_is_held(port)


def test_grpc_ask_streams_one_answer_and_refuses_n(shared_stack):
    header = gateway_pb2.AskHeader(
        messages=[
            messages_pb2.ChatMessage(role="user", parts=[messages_pb2.ContentPart(type="text", text="hi")])
        ],
        generation=common_pb2.GenerationParams(max_new_tokens=2, n=2),
    )
    with grpc.insecure_channel(shared_stack.gateway) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
            iter([gateway_pb2.AskRequest(header=header)]), timeout=60
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation.n is 2, but Ask streams one answer" in info.value.details()
    with (
        EpdClient(shared_stack.gateway) as client,
        pytest.raises(TypeError, match=r"unknown options: \['n'\]"),
    ):
        client.ask(None, "hi", n=2)  # the SDK has no n


def test_a_client_that_leaves_frees_every_choice(shared_stack, media_files):
    port = shared_stack.http_port
    body = _video_body(
        media_files, n=3, stream=True, max_tokens=400, ignore_eos=True, temperature=1.0, seed=SEED
    )
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        seen: set[int] = set()
        while seen != {0, 1, 2}:  # every choice is generating: then the client goes
            line = reply.readline().decode()
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"] if c.get("token_ids")}
    _wait_until_nothing_is_held(port)


def test_choices_in_the_colocated_server(tiny_models, media_files):
    """`epd serve --colocate`'s path: the HTTP API over the local stages, the KV cache taken
    in-process by each choice (a copy for all but the last)."""
    fields = {"temperature": 1.0, "seed": SEED}
    requests = [("/v1/chat/completions", _video_body(media_files, n=2, **fields))]
    requests += [
        ("/v1/chat/completions", _video_body(media_files, temperature=1.0, seed=SEED + i)) for i in (0, 1)
    ]
    requests.append(
        (
            "/v1/completions",
            {"model": "epd", "prompt": "the sky is", "max_tokens": 4, "n": 2, **IDS, **fields},
        )
    )
    requests.append(
        (
            "/v1/completions",
            {
                "model": "epd",
                "prompt": "the sky is",
                "max_tokens": 4,
                "seed": SEED + 1,
                "temperature": 1.0,
                **IDS,
            },
        )
    )
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        (status, both), (_, first), (_, second), (_, completion), (_, completion_1) = post_embedded(
            pipeline, *requests
        )
        assert len(pipeline.prefill.kv_store) == 0
    assert status == 200, both
    assert _tokens(both) == [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]]
    assert both["usage"]["completion_tokens"] == sum(map(len, _tokens(both)))
    assert _tokens(completion)[1] == completion_1["choices"][0]["token_ids"]


LONG_TOKENS = 64  # choice 1's run, against choice 0's few tokens (`_early_stop`)


def _early_stop(port: int, path: str, body: dict) -> tuple[dict, int, int]:
    """(the seeded fields, a stop token id, its position k): with those fields choice 0 samples the
    token at position k (its first time) and choice 1 never does in LONG_TOKENS tokens, so with
    `stop_token_ids` = [it] choice 0 ends at token k + 1 and choice 1 runs to max_tokens. Searched
    over seeds, not fixed: the tiny model's weights make the tokens."""
    for seed in range(SEED, SEED + 20):
        fields = {"n": 2, "temperature": 1.0, "seed": seed, "max_tokens": LONG_TOKENS, "ignore_eos": True}
        status, answer = post_json(port, path, {**body, **fields})
        assert status == 200, answer
        first, second = _tokens(answer)
        for k in range(1, 6):
            if first[k] not in first[:k] and first[k] not in second:
                return fields, first[k], k
    raise AssertionError("no seed of 20 gave choice 0 a token choice 1 never samples")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_choice_that_ends_early_sends_its_finish_while_the_other_goes_on(shared_stack, media_files, path):
    # vLLM's stream: each choice's finish (finish_reason, stop_reason) on its last token's chunk
    # as it finishes, the other choices' tokens after it, the usage once at the end. Choice 0 stops at a stop token
    # within its first 6 tokens, choice 1 runs 64: both decode in the one decoder's batch, a
    # token each per step, so choice 1 has tokens left to send when choice 0 ends.
    port = shared_stack.http_port
    if path == "/v1/chat/completions":
        body = _video_body(media_files)
    else:
        body = {"model": "epd", "prompt": "the sky is", **IDS}
    fields, stop_id, k = _early_stop(port, path, body)
    fields["stop_token_ids"] = [stop_id]
    status, plain = post_json(port, path, {**body, **fields})
    assert status == 200, plain
    first, second = _tokens(plain)  # by index
    assert len(first) == k + 1 and first[-1] == stop_id and len(second) == LONG_TOKENS
    assert [(c["finish_reason"], c["stop_reason"]) for c in plain["choices"]] == [
        ("stop", stop_id),
        ("length", None),
    ]
    assert plain["usage"]["completion_tokens"] == k + 1 + LONG_TOKENS

    events = sse_chunks(port, path, {**body, **fields, "stream_options": {"include_usage": True}})
    assert "error" not in events[-1], events[-1]
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == plain["usage"]  # the usage once, at the end

    def where(index: int, finished: bool) -> list[int]:
        """Positions of choice `index`'s chunks: its finish's, or those with tokens."""
        return [
            at
            for at, chunk in enumerate(chunks)
            for c in chunk["choices"]
            if c["index"] == index and (bool(c["finish_reason"]) if finished else bool(c.get("token_ids")))
        ]

    [early_end], [late_end] = where(0, finished=True), where(1, finished=True)
    assert max(where(0, finished=False)) == early_end < max(where(1, finished=False)) == late_end
    [early], [late] = chunks[early_end]["choices"], chunks[late_end]["choices"]
    assert (early["finish_reason"], early["stop_reason"]) == ("stop", stop_id)
    assert (late["finish_reason"], late["stop_reason"]) == ("length", None)
    assert "epd" in chunks[late_end] and not any("epd" in chunk for chunk in chunks[:late_end])
    for index, tokens in enumerate((first, second)):
        assert [t for chunk in chunks for c in chunk["choices"] if c["index"] == index
                for t in c.get("token_ids") or []] == tokens  # fmt: skip
