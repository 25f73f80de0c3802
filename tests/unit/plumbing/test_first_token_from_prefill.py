"""The first token leaves with prefill's answer (the decoder held meanwhile), never twice, and the
stream is the one whose first token comes from the decoder; a decoder whose first step differs,
or that is lost after the first token went out, stops the stream (a second prefill goes on only
from the token sent). The embedded pipeline with the real tiny model.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

import pytest

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, MediaInput, PrefillStage, StageEvent, TokenStep
from epd.stages.errors import KvSourceLost
from epd.stages.messages import question_messages
from tests.unit.plumbing.pipeline_asks import HANG_GUARD_S, _ask


class HeldDecoder(DecodeStage):
    """The embedded decode stage, held until the test opens it: nothing reaches a decoder before."""

    def __init__(self, inner: DecodeStage) -> None:
        self.inner = inner
        self.open = asyncio.Event()

    async def generate(self, handle, generation, request_id, pruning=None):
        await asyncio.wait_for(self.open.wait(), HANG_GUARD_S)
        async with aclosing(self.inner.generate(handle, generation, request_id)) as steps:
            async for step in steps:
                yield step


class FirstTextDropped:
    """The embedded prefill stage, its handles without `first_text`: the first token then comes
    from the decoder, as it did before prefill worked its text out."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def prefill(self, *args, **kwargs):
        return dataclasses.replace(await self.inner.prefill(*args, **kwargs), first_text=None)

    async def release(self, handle, request_id):
        await self.inner.release(handle, request_id)


def _run(pipeline, request, on_token=None) -> list:
    async def scenario():
        items = []
        async for item in pipeline.ask(request):
            items.append(item)
            if isinstance(item, TokenStep) and on_token is not None:
                on_token(item)
        return items

    return asyncio.run(scenario())


def _kv_event_at(items) -> int:
    return next(i for i, x in enumerate(items) if isinstance(x, StageEvent) and x.stage == "kv_transfer")


def test_the_first_token_goes_out_before_a_decoder_has_the_cache(embedded, videos):
    """The first token leaves with prefill's answer (its text worked out by prefill), while the
    decoder is still held; the decoder's own first step (the same token) is not sent twice, and the
    stream equals, token for token and character for character, the one whose first token comes
    from the decoder."""
    from epd.gateway.pipeline import Pipeline

    request = _ask(videos, max_new_tokens=6)
    held = HeldDecoder(embedded.decoder)
    early = _run(Pipeline(embedded.encoder, embedded.prefill, held), request, lambda step: held.open.set())
    late = _run(Pipeline(embedded.encoder, FirstTextDropped(embedded.prefill), embedded.decoder), request)

    steps = [x for x in early if isinstance(x, TokenStep)]
    assert early.index(steps[0]) < _kv_event_at(early), "the first token came before the cache moved"
    assert len(steps[0].token_ids) == 1 and all(s.token_ids or s.text or s.finish_reason for s in steps)
    late_steps = [x for x in late if isinstance(x, TokenStep)]
    assert late.index(late_steps[0]) > _kv_event_at(late)
    assert [t for s in steps for t in s.token_ids] == [t for s in late_steps for t in s.token_ids]
    assert "".join(s.text for s in steps) == "".join(s.text for s in late_steps)
    summary, late_summary = early[-1], late[-1]
    assert isinstance(summary, AskSummary) and isinstance(late_summary, AskSummary)
    assert (summary.token_ids, summary.answer, summary.finish_reason) == (
        late_summary.token_ids,
        late_summary.answer,
        late_summary.finish_reason,
    )
    assert len(summary.token_ids) == 6 and summary.finish_reason == "length"
    assert summary.timings_ms["ttft"] <= summary.timings_ms["total"]


def test_a_first_token_that_ends_the_request_comes_from_the_decoder(embedded, videos):
    """Only the decoder sends a finish: a first token that ends the request (max_new_tokens=1, or
    a stop string in its text) is not sent early; the one step comes after the cache moved."""
    from epd.gateway.pipeline import Pipeline

    pipeline = Pipeline(embedded.encoder, embedded.prefill, embedded.decoder)
    first = _run(pipeline, _ask(videos, max_new_tokens=2))[-1]
    stop = first.answer[:1]
    assert stop, "the first token of this model's answer has text"
    for generation in ({"max_new_tokens": 1}, {"max_new_tokens": 4, "stop": (stop,)}):
        items = _run(pipeline, _ask(videos, **generation))
        steps = [x for x in items if isinstance(x, TokenStep)]
        assert items.index(steps[0]) > _kv_event_at(items), generation
        assert steps[-1].finish_reason == ("length" if "stop" not in generation else "stop")
        assert items[-1].token_ids == first.token_ids[:1]


def test_a_decoder_whose_first_step_differs_from_the_token_sent_stops_the_stream():
    """Prefill and decoder apply the same rules to the same token, so the decoder's first step
    starts with what was sent; if it ever did not, the stream stops rather than show the client two
    versions of its answer."""
    from epd.gateway.choice_progress import after_sent

    sent = TokenStep([7], " the")
    assert after_sent(TokenStep([7], " the"), sent) is None
    assert after_sent(TokenStep([7, 8], " the cat"), sent) == TokenStep([8], " cat")
    assert after_sent(TokenStep([7], " the", "length"), sent) == TokenStep([], "", "length")
    for other in (TokenStep([8], " the"), TokenStep([7], " a")):
        with pytest.raises(RuntimeError, match="does not start with the token sent from prefill"):
            after_sent(other, sent)


def test_no_decoder_after_the_first_token_went_out_passes_the_stages_status_on(embedded, videos):
    """Every decode replica unavailable, the client already holding the first token (sent with
    prefill's answer): the decode stage's UNAVAILABLE passes on as it is (a non-streaming client
    has seen nothing and gets 503; the SDK retries no stream that had tokens), and the cache
    prefill stored is released."""
    import grpc

    from epd.gateway.pipeline import Pipeline
    from epd.transport.errors import UpstreamError

    class Unavailable(DecodeStage):
        async def generate(self, handle, generation, request_id, pruning=None):
            raise UpstreamError(
                grpc.StatusCode.UNAVAILABLE, f"decode stage unavailable (request id {request_id})"
            )
            yield  # an async generator, as the stages are

    store: KvStore = embedded.prefill.kv_store
    released_before = store.num_released
    tokens: list[int] = []
    with pytest.raises(UpstreamError, match="decode stage unavailable") as err:
        _run(
            Pipeline(embedded.encoder, embedded.prefill, Unavailable()),
            _ask(videos, max_new_tokens=4),
            lambda step: tokens.extend(step.token_ids),
        )
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and len(tokens) == 1
    assert (len(store), store.num_bytes, store.num_released) == (0, 0, released_before + 1)


class LosesTheFirstCache(DecodeStage):
    """The embedded decode stage, except that its first request finds its KV source gone (as when
    the prefill replica holding the cache died), as a remote decoder answers then."""

    def __init__(self, inner: DecodeStage) -> None:
        self.inner = inner
        self.calls = 0

    async def generate(self, handle, generation, request_id, pruning=None):
        self.calls += 1
        if self.calls == 1:
            raise KvSourceLost("the prefill replica that held this request's KV cache went away")
        async with aclosing(self.inner.generate(handle, generation, request_id)) as steps:
            async for step in steps:
                yield step


class SecondPrefillSamplesAnother:
    """The embedded prefill stage, whose second answer has another first token (a sampled one)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    async def prefill(self, *args, **kwargs):
        self.calls += 1
        handle = await self.inner.prefill(*args, **kwargs)
        return (
            handle
            if self.calls == 1
            else dataclasses.replace(handle, first_token_id=handle.first_token_id + 1)
        )

    async def release(self, handle, request_id):
        await self.inner.release(handle, request_id)


@pytest.mark.parametrize("same_first_token", [True, False])
def test_a_second_prefill_after_a_lost_cache_goes_on_only_from_the_token_sent(
    embedded, videos, same_first_token
):
    """The client holds the first prefill's token when the cache is lost: the pipeline prefills
    again and goes on only if that gives the same token (greedy: it does; the answer is the one of
    a run without the loss, the token not sent twice); else the request fails with the loss, and
    neither cache is left at prefill."""
    from epd.gateway.pipeline import Pipeline

    store: KvStore = embedded.prefill.kv_store
    prefill = embedded.prefill if same_first_token else SecondPrefillSamplesAnother(embedded.prefill)
    pipeline = Pipeline(embedded.encoder, prefill, LosesTheFirstCache(embedded.decoder))
    request = _ask(videos, max_new_tokens=5)
    if same_first_token:
        items = _run(pipeline, request)
        clean = _run(Pipeline(embedded.encoder, embedded.prefill, embedded.decoder), request)
        assert (items[-1].token_ids, items[-1].answer) == (clean[-1].token_ids, clean[-1].answer)
        assert sum(len(x.token_ids) for x in items if isinstance(x, TokenStep)) == 5
    else:
        tokens: list[int] = []
        with pytest.raises(KvSourceLost, match="went away"):
            _run(pipeline, request, lambda step: tokens.extend(step.token_ids))
        assert len(tokens) == 1
    assert (len(store), store.num_bytes) == (0, 0)


def test_a_stream_stopped_by_the_gateway_ends_the_decoders_run_at_once():
    """When the pipeline stops reading the decoder's steps for an error of its own (a first step
    that differs from the token sent), it ends the decoder's run itself (its batch row and
    reservation freed, in the request's task), not the event loop's finalizer when the generator is
    collected (at once in CPython while nothing else holds it; never while a traceback does)."""
    from epd.gateway.pipeline import Pipeline
    from epd.stages.contracts import PrefillHandle
    from tests.unit.gateway.fake_stages import Encoder

    class SentFirst(PrefillStage):
        async def prefill(
            self,
            messages,
            media,
            generation,
            request_id,
            pruning=None,
            cache_salt="",
            *,
            raw_prompt=None,
            template=None,
        ):
            return PrefillHandle(first_token_id=7, num_prompt_tokens=20, num_cached_tokens=20,
                                 next_position_ids=[20, 4, 4, 4], kv_num_bytes=64, prefill_ms=1.0,
                                 kv_handle="ab" * 16, first_text=" the")  # fmt: skip

        async def release(self, handle, request_id):
            pass

    class Differs(DecodeStage):
        closed_by_its_caller: bool | None = None

        async def generate(self, handle, generation, request_id, pruning=None):
            caller = asyncio.current_task()
            try:
                yield TokenStep([8], " a")  # not the token prefill sent
                yield TokenStep([9], " b")
            finally:
                # The request's own task closes it; the event loop's finalizer (a task of its own,
                # whenever the generator is collected) did before.
                Differs.closed_by_its_caller = asyncio.current_task() is caller

    async def scenario() -> bool:
        request = AskRequest(question_messages("what colour?"), MediaInput(b"\0"))
        try:
            async for _ in Pipeline(Encoder(0), SentFirst(), Differs()).ask(request):
                pass
        except RuntimeError as exc:
            assert "does not start with the token sent from prefill" in str(exc)
            await asyncio.sleep(0.01)  # a finalizer's task would have run by now
            return bool(Differs.closed_by_its_caller)
        raise AssertionError("the stream did not stop")

    assert asyncio.run(scenario())
