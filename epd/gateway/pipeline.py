"""One conversation about one video or image (or about text alone) through Encode -> Prefill ->
Decode, as a stream of events. A conversation without a media part never calls the encoder:
prefill renders its text alone and decode goes on as for any other request.

Written against the stage contracts only: the same code runs the embedded mode (local stages)
and the gateway of the disaggregated stack (remote stages).

The stages run in one task of their own (`epd.stages.events.with_events`) and `ask` streams what
that task reports. When the consumer goes (the front door's handler is cancelled because its
client disconnected, or it closes the stream), the task is cancelled wherever it is: the stage
call in flight is cancelled with it (encoder: demux and decoding stop within 50 ms; prefill:
keeps no cache; decode: stops and frees the cache). A KV cache that prefill stored is released
on every way out but a decode run to its end (cancel, error, a decoder that could not pull it, a
decoder lost after the first token but before it confirmed receipt), so each request holds at
most one cache and only while it is in flight.

The first token goes to the consumer as soon as prefill answers (`PrefillHandle.first_text`: the
token and the text the decoder's first step will carry), not once a decoder has pulled the cache
and admitted the request; the decoder's stream then goes on from the second token. So a request
that prefill answered is not failed when every decoder is full: it waits for room
(`epd.gateway.decode_room`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from epd.gateway.ask_types import AskRequest, AskSummary, Emit, PipelineEvent, PromptLogprobs, PromptTokenIds
from epd.gateway.choice_progress import ChoiceProgress, after_sent, first_logprob
from epd.gateway.decode_room import DECODE_ROOM_WAIT_S, decode_when_room
from epd.gateway.kv_release import RELEASES_WAIT_S, release_kv, release_outcome, wait_for_releases
from epd.gateway.request_defaults import RequestDefaults
from epd.model_runtime.generation_defaults import GenerationDefaults
from epd.model_runtime.sampling import MAX_NEW_TOKENS, GenerationConfig
from epd.stages.chat_template import refuse_untrusted
from epd.stages.contracts import (
    DecodeStage,
    EncodedMedia,
    EncodeStage,
    MediaInput,
    PrefillHandle,
    PrefillStage,
    StageEvent,
    TokenStep,
    check_request_priority,
    pruning_stages_used,
)
from epd.stages.errors import InvalidRequest, KvSourceLost
from epd.stages.events import Finished, with_events
from epd.stages.messages import ChatTemplateOptions, check_messages, media_type
from epd.stages.model_info import ModelInfo
from epd.stages.names import TIMING_NAMES, TOTAL, TTFT, Stage
from epd.stages.raw_prompt import check_raw_prompt
from epd.stages.tokenize import MAX_DETOKENIZE_TOKENS, TokenizeAnswer, TokenizeInput, check_token_ids
from epd.token_pruning import PruningStats
from epd.transport import tracing

log = logging.getLogger(__name__)


async def _all_of(runs: list[Coroutine[Any, Any, None]]) -> None:
    """Run `runs` at once (one alone in this task); the first error ends them all and is raised,
    once every other has stopped (so none still holds a decoder when the caller releases the
    cache). Cancelling the caller cancels them all."""
    if len(runs) == 1:
        await runs[0]
        return
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for task in tasks:  # a second error is not logged as never retrieved; the first is raised
            if not task.cancelled():
                task.exception()


@dataclass
class _Run:
    """What every choice of one request shares (`Pipeline._run`)."""

    req: AskRequest
    request_id: str
    emit: Emit
    timings: dict[str, float]
    elapsed_ms: Callable[[], float]


class Pipeline:
    def __init__(
        self,
        encoder: EncodeStage,
        prefill: PrefillStage,
        decoder: DecodeStage,
        decode_room_wait_s: float = DECODE_ROOM_WAIT_S,
    ) -> None:
        self.encoder = encoder
        self.prefill = prefill
        self.decoder = decoder
        self.decode_room_wait_s = decode_room_wait_s
        self._defaults = RequestDefaults()

    async def aclose(self) -> None:
        """Release what the pipeline holds, once no request is in flight (the gateway calls it
        after its drain): the KV releases still running get up to `RELEASES_WAIT_S`, then the
        stages' own things go (`RemotePipeline`: channels; `EmbeddedPipeline`: threads).
        Idempotent; the pipeline takes no request after it. Async (`aclose`, as contextlib's
        `aclosing` calls it): a remote stage's channels close on the event loop."""
        await wait_for_releases(RELEASES_WAIT_S)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def model_info(self) -> ModelInfo | None:
        """What the served model takes, as the prefill stage knows it (the embedded pipeline: its
        own model's; the gateway: what prefill's replicas answered, `epd.gateway.model_info`);
        None while not known."""
        model_info = getattr(self.prefill, "model_info", None)  # a test's stand-in may have none
        return model_info() if callable(model_info) else None

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary when known: token ids outside it are refused before the media
        costs an encode. None (not known yet): prefill refuses them, after the encode."""
        info = self.model_info()
        return None if info is None else info.vocab_size

    @property
    def max_new_tokens_limit(self) -> int:
        """The most tokens a request may ask for: prefill's configured limit when known (a request
        over it is refused before its media costs an encode, with the message prefill gives), else
        the stages' default (`MAX_NEW_TOKENS`; prefill's own check refuses more, after the encode)."""
        info = self.model_info()
        return MAX_NEW_TOKENS if info is None else info.max_new_tokens

    @property
    def max_logprobs(self) -> int | None:
        """The most top logprobs a request may ask for: prefill's --max-logprobs when known (more
        is refused before the media costs an encode); None while not known (prefill refuses more)."""
        info = self.model_info()
        return None if info is None else info.max_logprobs

    async def request_defaults(
        self, configured: GenerationDefaults, check: Callable[[GenerationConfig], object] | None = None
    ) -> GenerationConfig:
        """The options a request leaves unset take (every door's), by --generation-config
        `configured` and what prefill takes (`epd.gateway.request_defaults`); `check`, the door's
        parse of its request, refuses a malformed one before any wait for prefill's model info."""
        return await self._defaults.resolve(configured, self.model_info(), self.prefill, check)

    def _check_room_for_a_prompt(self, generation: GenerationConfig) -> None:
        """InvalidRequest when the max_tokens a client set fills the whole served context
        (`max_model_len`, when known), before the media costs an encode: no prompt, of at least one
        token, fits beside it, so prefill would refuse it after the encode. A max_tokens left unset
        is fitted to the prompt by prefill instead (`fit_max_new_tokens`)."""
        info = self.model_info()
        if info is None or generation.fit_max_new_tokens or generation.max_new_tokens < info.max_model_len:
            return
        raise InvalidRequest(
            f"max_tokens is {generation.max_new_tokens}, but this model's context is {info.max_model_len} tokens "
            "(max_model_len) and must hold the prompt too: ask for fewer tokens (the context less the prompt's), "
            "or leave max_tokens unset to get what the prompt leaves"
        )

    def _check_priority(self, generation: GenerationConfig) -> None:
        """InvalidRequest for a priority prefill's `--scheduling-policy` refuses (not 0 under
        fcfs), before the media costs an encode; while the policy is not known, its range alone
        (each stage checks its own policy)."""
        info = self.model_info()
        check_request_priority(generation.priority, "priority" if info is None else info.scheduling_policy)

    async def tokenize(self, request: TokenizeInput, request_id: str) -> TokenizeAnswer:
        """`request`'s token ids from prefill's tokenizer and chat template, with the served
        `max_model_len`: what both front doors answer (the HTTP API's /tokenize, gRPC's Tokenize)."""
        out = await self.prefill.tokenize(request, request_id)
        info = self.model_info()
        return TokenizeAnswer(out.token_ids, out.token_strs, None if info is None else info.max_model_len)

    async def detokenize(self, token_ids: Sequence[int], request_id: str) -> str:
        """The text of `token_ids`, special tokens kept (both front doors' detokenize). Ids past
        `MAX_DETOKENIZE_TOKENS`, or outside the vocabulary once known, are refused here, before
        the call: prefill's own check, with its message, runs where the vocabulary is not known."""
        check_token_ids(token_ids, self.vocab_size, MAX_DETOKENIZE_TOKENS)
        return await self.prefill.detokenize(token_ids, request_id)

    async def ask(self, req: AskRequest) -> AsyncIterator[PipelineEvent]:
        """Yields StageEvents and TokenSteps as they happen, then one AskSummary."""
        if req.raw_prompt is not None:
            check_raw_prompt(req.raw_prompt, req.messages, vocab_size=self.vocab_size)
            if req.template != ChatTemplateOptions():
                raise InvalidRequest(
                    "add_generation_prompt, continue_final_message, chat_template_kwargs, chat_template and tools shape a chat "
                    "template's prompt; a raw prompt has no template: leave them unset"
                )
        else:
            # Before the media costs an encode; prefill checks its limits.
            check_messages(req.messages, template=req.template)
            if (info := self.model_info()) is not None:
                refuse_untrusted(req.template.chat_template, info.trust_request_chat_template)
        check_media_sent(req)
        try:  # before the request is sent on (a stop list of megabytes would be too large for one
            # message) and before the media costs an encode: prefill's bounds as far as known (each
            # stage checks its own too)
            req.generation.validate(self.max_new_tokens_limit, self.vocab_size, self.max_logprobs)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self._check_priority(req.generation)
        if req.generation.prompt_logprobs is not None and (stages := pruning_stages_used(req.pruning)):
            # The dropped or merged tokens would have no logprobs, and the kept ones would be of a
            # prompt the model never sees whole: refused before an encode (prefill refuses too).
            raise InvalidRequest(
                f"prompt_logprobs cannot be computed with token pruning ({', '.join(stages)}); turn "
                "pruning off or leave prompt_logprobs unset"
            )
        self._check_room_for_a_prompt(req.generation)
        req = replace(req, generation=req.generation.with_drawn_seed())  # a sampled request without a seed

        async def run(emit: Emit) -> AskSummary:
            # The request's id in its own task's context, as a front door sets it (the gateway's
            # servicer, the HTTP API; there it is already so): the embedded pipeline's requests
            # (`epd ask`) come through none, and their stages' log lines carried no request_id=.
            # Set here, not in the caller's context: its next request gets an id of its own.
            return await self._run(req, tracing.adopt_request_id(req.request_id), emit)

        async for item in with_events(run):
            yield item.value if isinstance(item, Finished) else item

    async def _run(self, req: AskRequest, request_id: str, emit: Emit) -> AskSummary:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}

        def elapsed_ms() -> float:
            return (time.perf_counter() - t0) * 1e3

        media: EncodedMedia | None = None
        transfer_bytes = 0
        if media_type(req.messages):  # text alone: no encoder call at all
            media = await self._encode(req, request_id, emit)
            timings[Stage.VIDEO_DECODE.value] = media.decode_ms
            timings[Stage.ENCODE.value] = media.encode_ms
            # The request's transfer_bytes, hop by hop as the remote stages count them (0 in one
            # process): encoder -> gateway here, each prefill call's, then the decoder's KV pull.
            transfer_bytes = media.pruning.transfer_bytes

        # Prefill once, then a decode request per choice (OpenAI's n), all running at once from the
        # same cache (`PrefillHandle.for_choice`). A choice whose decoder could not pull it
        # (KvSourceLost: the prefill replica that holds it is gone, or it expired) is prefilled
        # again, once per request, on another replica when that one is gone (prefill is
        # idempotent); the choices whose decoders have it go on (`_run_choice`).
        asked_logprobs = req.generation.logprobs is not None
        choices = [
            ChoiceProgress(index, logprobs=[] if asked_logprobs else None)
            for index in range(req.generation.n)
        ]
        handles: list[PrefillHandle] = []  # the first prefill's, and at most one more
        prefilling_again = asyncio.Lock()
        failed_again: list[Exception] = []  # the second prefill's error: it is not tried a third time

        async def prefill() -> PrefillHandle:
            nonlocal transfer_bytes
            emit(StageEvent(Stage.PREFILL, "started"))
            t_prefill = time.perf_counter()
            handle = await self._prefill(req, media, request_id, again=bool(handles))
            handles.append(handle)
            transfer_bytes += handle.pruning.transfer_bytes  # a prefill again sends the media again
            if handle.num_choices != len(choices):
                raise RuntimeError(
                    f"prefill answered {handle.num_choices} first tokens for a request of n={len(choices)} "
                    "choices: a prefill replica older than this gateway (it ignores n)"
                )
            if (
                req.generation.return_prompt_token_ids
                and handle.prompt_token_ids is None
                and not handles[:-1]
            ):
                raise RuntimeError(
                    "the request asked for the prompt's token ids and prefill sent none: a prefill replica "
                    "older than this gateway (it ignores return_prompt_token_ids)"
                )
            timings[Stage.PREFILL.value] = handle.prefill_ms
            emit(
                StageEvent(
                    Stage.PREFILL,
                    "finished",
                    (time.perf_counter() - t_prefill) * 1e3,
                    {
                        "num_prompt_tokens": str(handle.num_prompt_tokens),
                        "kv_num_bytes": str(handle.kv_num_bytes),
                        "prefix_cache": "hit" if handle.num_reused_prompt_tokens else "miss",
                        "num_reused_prompt_tokens": str(handle.num_reused_prompt_tokens),
                    },
                )
            )
            return handle

        async def prefill_again(choice: ChoiceProgress, lost: KvSourceLost) -> PrefillHandle:
            """The second prefill's handle, made by the first choice that lost the first one's
            cache; a choice that loses it later takes the same one (the request is prefilled
            again once). `lost` is raised when it samples another first token for `choice` than
            the one the client has; the second prefill's error, when it failed, for every choice
            (a choice that waited for it gets that error, not a third prefill)."""
            async with prefilling_again:
                if failed_again:
                    raise failed_again[0]
                if len(handles) == 1:
                    taken = [c.index for c in choices if c.taken]
                    log.warning(
                        "request %s: %s; prefilling it again%s",
                        request_id,
                        lost,
                        f" (choices {taken} have it already and go on)" if taken else "",
                    )
                    try:
                        await prefill()
                    except Exception as exc:  # not a cancel: that ends the request, not the prefill
                        failed_again.append(exc)
                        raise
            again = handles[-1]
            first = again.for_choice(choice.index)
            if choice.sent is not None and first.first_token_id != choice.sent.token_ids[0]:
                raise lost  # the client has the first prefill's token, and this one differs (sampled)
            return again

        try:
            first_handle = await prefill()
            if first_handle.prompt_logprobs is not None:
                # Once, before the first token: a prefill again (a lost cache) scores the same prompt
                # the same way.
                emit(PromptLogprobs(first_handle.prompt_logprobs))
            if first_handle.prompt_token_ids is not None:
                emit(PromptTokenIds(first_handle.prompt_token_ids))
            t_gen = time.perf_counter()
            emit(StageEvent(Stage.GENERATE, "started"))
            run = _Run(req, request_id, emit, timings, elapsed_ms)
            for choice in choices:
                self._send_first(run, first_handle, choice)
            await _all_of([self._run_choice(run, first_handle, c, prefill_again) for c in choices])
        finally:
            # A cache is released unless all n choices pulled it and ran to their end. Not taken: no
            # decoder has it. Taken but cut short (a decoder lost, or the client gone): the decoder
            # confirms receipt just after the first token, so one that died right then leaves
            # prefill's copy behind; nothing retries after a first token, so the copy is released
            # here (a no-op when it was confirmed). Once every choice's decoder is done: a release
            # drops it for all. A second prefill's cache that only some choices needed (the others
            # had the first) is kept for n pulls and pulled by fewer: released here too.
            for handle in handles:
                if not all(c.source is handle and c.ended for c in choices):
                    await release_kv(self.prefill, handle, request_id)
        num_tokens = sum(len(c.token_ids) for c in choices)
        transfer_bytes += sum(c.kv_num_bytes_pulled for c in choices)
        timings[Stage.GENERATE.value] = (time.perf_counter() - t_gen) * 1e3
        emit(
            StageEvent(
                Stage.GENERATE,
                "finished",
                timings[Stage.GENERATE.value],
                {"num_tokens": str(num_tokens), "finish_reason": choices[0].finish_reason},
            )
        )
        timings[TOTAL] = elapsed_ms()
        handle = handles[0]  # the request's prompt, as its first prefill ran it (a second runs the same)
        pruning = handle.pruning
        pruning.transfer_bytes = transfer_bytes
        first_choice = choices[0].summary()
        return AskSummary(
            request_id=request_id,
            answer=first_choice.answer,
            token_ids=first_choice.token_ids,
            finish_reason=first_choice.finish_reason,
            num_frames=media.num_frames if media else 0,
            num_visual_tokens=media.meta.num_visual_tokens if media else 0,
            num_prompt_tokens=handle.num_prompt_tokens,
            timings_ms={**dict.fromkeys(TIMING_NAMES, 0.0), **timings},  # a stage not run took 0 ms
            kv_num_bytes=handle.kv_num_bytes,
            encoder_cache_hit=media.cache_hit if media else False,
            media_sha256=media.sha256 if media else "",
            frame_timestamps_s=media.frame_timestamps_s if media else [],
            pruning=pruning,
            grid_thw=media.meta.grid_thw if media else (0, 0, 0),
            kept_visual_token_index=handle.kept_visual_token_index
            or ([] if media is None or media.token_index is None else media.token_index.tolist()),
            num_reused_prompt_tokens=handle.num_reused_prompt_tokens,
            num_stored_prompt_tokens=handle.num_stored_prompt_tokens,
            stop_reason=first_choice.stop_reason,
            logprobs=first_choice.logprobs,
            choices=[c.summary() for c in choices],
            prompt_logprobs=handle.prompt_logprobs,
            prompt_token_ids=handle.prompt_token_ids,
        )

    def _send_first(self, run: _Run, handle: PrefillHandle, choice: ChoiceProgress) -> None:
        """Send choice `choice`'s first token from prefill's `handle` now, not once a decoder has
        pulled the cache and admitted the request (the KV transfer, and the admission's wait for
        the model thread); the decoder's first step, the same token, is not sent again. Nothing
        when it went already, or when the handle has no text for it (that token ends the choice:
        its decoder's step carries the finish reason)."""
        first = handle.for_choice(choice.index)
        if choice.sent is not None or first.first_text is None:
            return
        choice.sent = TokenStep(
            [first.first_token_id],
            first.first_text,
            logprobs=None if run.req.generation.logprobs is None else [first_logprob(first)],
            index=choice.index,
        )
        run.timings.setdefault(TTFT, run.elapsed_ms())
        choice.add(choice.sent)
        run.emit(choice.sent)

    async def _run_choice(
        self,
        run: _Run,
        handle: PrefillHandle,
        choice: ChoiceProgress,
        prefill_again: Callable[[ChoiceProgress, KvSourceLost], Coroutine[Any, Any, PrefillHandle]],
    ) -> None:
        """Choice `choice` from `handle`'s cache; when its decoder cannot pull it (KvSourceLost,
        which a decoder raises only before its first step), from the cache of `prefill_again`,
        which samples this choice's first token again by its own seed (`GenerationConfig.for_choice`):
        the same token, or the request fails (one already sent cannot be taken back). The other
        choices go on meanwhile: those whose decoders pulled the first cache have it."""
        try:
            await self._generate(run, handle, choice, handle.pruning)
            return
        except KvSourceLost as exc:
            again = await prefill_again(choice, exc)
        self._send_first(run, again, choice)
        await self._generate(run, again, choice, handle.pruning)

    async def _generate(
        self, run: _Run, handle: PrefillHandle, choice: ChoiceProgress, pruning: PruningStats
    ) -> None:
        """Choice `choice`'s decode request, from `handle`'s cache and the choice's first token,
        its steps emitted (tagged with its index) as they come; its decoder's eviction counted in
        `pruning` (the request's, whichever prefill the cache came from)."""
        req, timings = run.req, run.timings
        first = handle.for_choice(choice.index)
        generation = first.decode_generation(req.generation.for_choice(choice.index))
        # aclosing: an error in this loop's body (`after_sent`) must end the decoder's run now,
        # freeing its batch row and KV reservation, not when the GC finds it.
        async with aclosing(
            decode_when_room(
                self.decoder, first, generation, run.request_id, req.pruning, self.decode_room_wait_s
            )
        ) as steps:
            async for step in steps:
                if not choice.taken:
                    choice.source = handle
                    timings.setdefault(TTFT, run.elapsed_ms())
                    timings[Stage.KV_TRANSFER.value] = step.kv_transfer_ms
                    run.emit(
                        StageEvent(
                            Stage.KV_TRANSFER,
                            "finished",
                            step.kv_transfer_ms,
                            {"kv_num_bytes": str(step.kv_num_bytes)},
                        )
                    )
                    if handle.kv_address:  # pulled from a prefill server; not an in-process store's
                        choice.kv_num_bytes_pulled = step.kv_num_bytes
                    if choice.sent is not None:
                        rest = after_sent(step, choice.sent)
                        if rest is None:
                            continue  # it was only the token already sent
                        step = rest
                step = replace(step, index=choice.index)
                choice.add(step)
                if step.decode_evict is not None:
                    pruning.record("decode_evict", *step.decode_evict)
                run.emit(step)
        choice.ended = True

    async def _encode(self, req: AskRequest, request_id: str, emit: Emit) -> EncodedMedia:
        """The request's media, encoded. A structured output is compiled meanwhile, by the prefill
        replica the request's prefill goes to (`PrefillStage.compile_structured_outputs`), so that
        its compile no longer adds to the time to the first token after the encode (prefill finds
        it compiled), and a spec that does not compile is refused without waiting for the encode,
        which is cancelled (a request sharing this media's encode is not failed by it: the
        encoder's single flight hands the work to it). Prefill is called once both have ended,
        the spec in its compiler's cache then: one sent sooner would wait behind the compile there
        anyway, and behind one that ran past its deadline would start it again."""
        media_input = req.media or MediaInput(b"")
        encoded: list[EncodedMedia] = []

        async def encode() -> None:
            encoded.append(
                await self.encoder.encode(
                    media_input,
                    req.sampling,
                    emit,
                    request_id,
                    req.pruning,
                    req.cache_salt,
                    priority=req.generation.priority,
                )
            )

        runs = [encode()]
        if (spec := req.generation.structured_outputs) is not None:
            runs.append(
                self.prefill.compile_structured_outputs(
                    spec, req.messages, media_input, request_id, req.cache_salt
                )
            )
        await _all_of(runs)  # the first error (a refused spec, a failed encode) cancels the other
        return encoded[0]

    async def _prefill(
        self, req: AskRequest, media: EncodedMedia | None, request_id: str, again: bool = False
    ) -> PrefillHandle:
        """Prefill's handle. `again`: a prefill again after a lost cache, which does not ask for the
        prompt's logprobs the first one answered: they would be the same, and asking makes prefill
        compute every position's logits without its prefix cache and send up to half a million
        entries that the gateway would join only to drop (nor its token ids: the same too). The call runs in a task of its own: a cancel that lands as it completes
        (the answer is in, this task not yet resumed) would lose the handle with this task, and
        its cache would stay stored until --kv-ttl; so the call's outcome is released instead.
        A call still running is cancelled (prefill then stores nothing, or releases what the RPC's
        cancel left stored, and the remote stage releases the handle it chose, in case the answer
        was already on its way)."""
        generation = (
            replace(req.generation, prompt_logprobs=None, return_prompt_token_ids=False)
            if again
            else req.generation
        )
        call = asyncio.ensure_future(
            self.prefill.prefill(
                req.messages,
                media,
                generation,
                request_id,
                req.pruning,
                req.cache_salt,
                raw_prompt=req.raw_prompt,
                template=req.template,
            )
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.cancel()
            call.add_done_callback(release_outcome(self.prefill, request_id))
            raise


def check_media_sent(req: AskRequest) -> None:
    """Media sent without a media part to place it (gRPC bytes or a sha256 beside text-only
    messages) is refused, not silently dropped: the client meant the model to see it. A media
    part with nothing sent goes to the encoder, which refuses the empty upload."""
    sent = req.media is not None and bool(req.media.data or req.media.sha256)
    if sent and req.raw_prompt is not None:
        raise InvalidRequest(
            "a raw prompt (completions) takes no media; send the media with messages "
            "(chat completions), or send no media"
        )
    if sent and not media_type(req.messages):
        raise InvalidRequest(
            "the request sends media but no message has a video or image part to place it; add one "
            '(a {"type": "video"} part in a user message, or use the question form), or send no media'
        )
