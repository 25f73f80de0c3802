"""Prefill: messages + visual embeddings -> KV cache + first token. No gRPC here.

A conversation without a media part comes with no media (None): its prompt is the chat template
of its text alone, with the positions `generate()` gives text (M-RoPE families: every row the
plain position), and it runs, batches and chunks as any prompt, with no visual rows. A raw prompt
(`epd.stages.raw_prompt`, the legacy completions API) runs the same way, its text tokenised as
the tokenizer tokenises text by default, with no chat template. The
media's options mean nothing to it: its pruning is only `kv_dtype`, as vLLM ignores a request's
multimodal processor options when it has no media.

The engine's result is the boundary's own type, `PrefillHandle` (without the cache's location,
which the stage that stores the cache fills in), next to the cache itself."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from epd.model_runtime.adapter import (
    PrefillChunk,
    Prompt,
    RenderOptions,
    UnsupportedByFamily,
    VisualFeatures,
    VisualMeta,
    VLMAdapter,
)
from epd.model_runtime.chat_template import check_syntax
from epd.model_runtime.detokenizer import OutputText
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.loader import ModelLoadError
from epd.model_runtime.logprobs import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    TokenLogprob,
    prompt_token_logprobs,
    rows_logprobs,
    token_logprob,
)
from epd.model_runtime.sampling import GenerationConfig, Sampler
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.prefix_cache import PrefixCache, PrefixView
from epd.prefill_svc.pruned_prefill import PrunedPrefill, pruned_prefill
from epd.prefill_svc.scheduler import PrefillRequest
from epd.stages.chat_template import refuse_untrusted
from epd.stages.contracts import (
    ChoiceStart,
    EncodedMedia,
    PrefillHandle,
    bad_words_token_ids,
    check_generation_limits,
    refuse_unsupported_pruning,
)
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.messages import (
    ChatTemplateOptions,
    Message,
    check_messages,
    media_in_opening,
    media_type,
    to_chat_template,
)
from epd.stages.model_info import REASONING_MARKERS, ModelInfo
from epd.stages.raw_prompt import RawPrompt, check_raw_prompt
from epd.stages.tokenize import TokenizeInput, TokenizeOutput, check_token_ids
from epd.token_pruning import (
    ModelSizes,
    PruningConfig,
    PruningStats,
    gather_prompt,
    prefill_flops,
    prompt_keep_indices,
)

log = logging.getLogger(__name__)


@dataclass
class PrefillOutput:
    """The handle decoding starts from (`kv_handle` and `kv_address` still empty) and the cache
    it describes, which the stage stores under a new `kv_handle`."""

    handle: PrefillHandle
    cache: KvCache


class PrefillEngine:
    """The prefill stage's per-request work around the model: validation and the prompt before a
    request queues (`render`, then `admit`), the first token and the handle after its last step (`finish`).
    The batched steps in between are `PrefillRunner`'s."""

    def __init__(self, config: PrefillConfig, adapter: VLMAdapter) -> None:
        """ModelLoadError: `config.max_model_len` above the model's context (`served_context`)."""
        self.config = config
        self.adapter = adapter
        try:
            context = config.served_context(adapter.context_tokens)
        except ValueError as exc:
            checkpoint = config.model  # ModelConfig: the path or hub id the operator gave
            raise ModelLoadError(checkpoint.model, str(exc)) from None
        self.context_tokens = context
        """Prompt plus generated tokens at most: the model's, or --max-model-len (None: not known)."""
        self.max_prompt_tokens = config.served_prompt_tokens(self.context_tokens)
        """The longest prompt served: --max-model-len's context lowers the prompt limit too."""
        self.reasoning_markers = adapter.single_tokens(REASONING_MARKERS)
        """Which think markers the tokenizer has, with their token ids (`ModelInfo.reasoning_markers`
        and `reasoning_marker_ids`): looked up once, the vocabulary does not change and
        get_vocab() builds a dict of it."""
        if (
            config.max_model_len is not None
            and (served := self.model_info().max_model_len) < config.max_model_len
        ):
            log.warning(
                "--max-model-len %d: prompts are bounded by %d tokens (--max-prompt-tokens) and answers by "
                "%d (--max-new-tokens-limit), so a request has %d at most (/v1/models' max_model_len); "
                "raise --max-prompt-tokens to reach %d",
                config.max_model_len,
                self.max_prompt_tokens,
                config.max_new_tokens_limit,
                served,
                config.max_model_len,
            )
        # Prompts, /tokenize and /detokenize run on the stage's tokenizer threads
        # (`LocalPrefillStage`) with the one tokenizer, which no call changes once settled: no
        # second copy in memory.
        adapter.settle_tokenizer()
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes, config.prefix_cache_ttl_s)
        # Families whose cache is attention-only and that continue a cache in chunks. A hybrid
        # model's linear states (Qwen3.5) hold the whole prompt in a fixed-size state that cannot
        # be cut back to a shorter prefix; they would be reusable only when a follow-up extends
        # the stored prompt exactly, which is left for later.
        self.prefix_caching = adapter.supports_chunked_prefill and not getattr(adapter, "linear_layers", None)

    def model_info(self) -> ModelInfo:
        """What this stage's model and limits take: what `validate` and `render` check a request against."""
        return ModelInfo(
            vocab_size=self.adapter.vocab_size,
            context_tokens=self.context_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.config.max_new_tokens_limit,
            model_type=self.adapter.family,
            max_logprobs=self.config.max_logprobs,
            reasoning_markers=tuple(self.reasoning_markers),
            reasoning_marker_ids=tuple(self.reasoning_markers.values()),
            trust_request_chat_template=self.config.trust_request_chat_template,
            scheduling_policy=self.config.scheduler.scheduling_policy,
        )

    def tokenize(
        self, request: TokenizeInput, checkpoint: Callable[[], None] | None = None
    ) -> TokenizeOutput:
        """/tokenize: a text's ids, or a text-only conversation's as `render` renders its prompt.
        Any thread may call it, also while another thread tokenises a prompt with the same
        tokenizer: no call changes the tokenizer (`VLMAdapter.settle_tokenizer`). `checkpoint`:
        as `render`'s, called before the text is tokenised (and its chat template rendered) and
        between those steps."""
        request.check(self.config.max_text_chars)
        if checkpoint is not None:
            checkpoint()
        try:
            if request.prompt is not None:
                token_ids = self.adapter.tokenize(request.prompt, request.add_special_tokens)
            else:
                token_ids = self.adapter.tokenize_conversation(
                    to_chat_template(request.messages, ""),
                    request.add_special_tokens,
                    replace(self._render_options(request.template), checkpoint=checkpoint),
                )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return TokenizeOutput(
            token_ids, self.adapter.token_strings(token_ids) if request.return_token_strs else None
        )

    def _render_options(self, template: ChatTemplateOptions) -> RenderOptions:
        """What a request's prompt renders with; its template the request's own (on a server that
        trusts them, parsed here: InvalidRequest with jinja's message otherwise), else
        --chat-template, else None (the model's own)."""
        refuse_untrusted(template.chat_template, self.config.trust_request_chat_template)
        if template.chat_template is None:
            return template.render_options(self.config.chat_template)
        try:
            check_syntax(template.chat_template)
        except ValueError as exc:
            raise InvalidRequest(f"'chat_template': {exc}; send a template that parses") from None
        return template.render_options(template.chat_template, requests_template=True)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """/detokenize: at most `max_text_chars` ids of the vocabulary (what a longest /tokenize
        text could give), special tokens kept. As `tokenize`: any thread."""
        check_token_ids(token_ids, self.adapter.vocab_size, self.config.max_text_chars)
        return self.adapter.decode_tokens(list(token_ids))

    def _check_generation(self, generation: GenerationConfig) -> None:
        check_generation_limits(
            generation,
            self.config.max_new_tokens_limit,
            self.adapter.vocab_size,
            self.config.max_logprobs,
            self.config.scheduler.scheduling_policy,
        )

    def validate(
        self,
        messages: Sequence[Message],
        meta: VisualMeta | None,
        generation: GenerationConfig,
        template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> None:
        check_messages(messages, self.config.max_text_chars, template=template)
        refuse_untrusted(template.chat_template, self.config.trust_request_chat_template)
        self._check_generation(generation)
        if bool(media_type(messages)) != (meta is not None):  # a caller other than our gateway
            raise InvalidRequest(
                "the messages have a video or image part but no visual tokens were sent (set visual)"
                if meta is None else
                "visual tokens were sent but the messages have no video or image part to place them; add one"
            )  # fmt: skip
        if meta is not None and meta.num_visual_tokens > self.max_prompt_tokens:
            raise ResourceExhausted(
                f"{meta.num_visual_tokens} visual tokens exceed the prompt limit of "
                f"{self.max_prompt_tokens}; lower max_frames, fps or max_pixels"
            )

    def _check_visual(self, media: EncodedMedia) -> None:
        """The number of embeddings must match the grid (or the encoder's kept-token list):
        a mismatch means encoder and prefill serve different models, and fails this request."""
        meta, embeds = media.meta, media.embeds
        full = self.adapter.num_visual_tokens(meta.grid_thw)
        expected = full if media.token_index is None else int(media.token_index.numel())
        if (
            embeds.ndim != 2
            or embeds.shape[0] != expected
            or embeds.shape[1] != self.adapter.hidden_size
            or meta.num_visual_tokens != expected
        ):
            raise InvalidRequest(
                f"visual embeddings have shape {tuple(embeds.shape)}, expected "
                f"[{expected}, {self.adapter.hidden_size}]: encoder and prefill serve different models"
            )
        if (
            media.token_index is not None
            and media.token_index.numel()
            and (int(media.token_index.max()) >= full or bool((media.token_index.diff() <= 0).any()))
        ):
            raise InvalidRequest("kept_token_index must be increasing and within the grid's tokens")
        family = self.adapter.family or type(self.adapter).__name__
        if len(media.deepstack) != self.adapter.num_deepstack_layers:
            raise InvalidRequest(
                f"the media carries {len(media.deepstack)} DeepStack features but this {family} model "
                f"adds {self.adapter.num_deepstack_layers}: encoder and prefill serve different models"
            )
        if any(tuple(d.shape) != tuple(embeds.shape) for d in media.deepstack):
            raise InvalidRequest("each DeepStack feature must have the visual embeddings' shape, row for row")

    def render(
        self,
        messages: Sequence[Message],
        media: EncodedMedia | None,
        generation: GenerationConfig,
        pruning: PruningConfig = PruningConfig(),
        request_id: str = "",
        use_prefix_cache: bool = True,
        cache_salt: str = "",
        raw_prompt: RawPrompt | None = None,
        template: ChatTemplateOptions = ChatTemplateOptions(),
        checkpoint: Callable[[], None] | None = None,
    ) -> PrefillRequest:
        """Validate the request and build its prompt: everything that can refuse it, before it
        queues (a bad request never takes a queue place). Any thread may run it: it reads the
        adapter's tokenizer (settled, `VLMAdapter.settle_tokenizer`), processor and config (the
        chat template, the visual placeholders' expansion, the positions, which need no weights),
        and touches neither the model nor the prefix cache, so prefill runs it on its tokenizer
        threads and a slow chat template holds no prefill step (`LocalPrefillStage.prefill`).
        `cache_salt` (the tenant) is part of the prefix-cache key: KV is reused only within one
        salt (the cache is looked up by `admit`). `raw_prompt`: instead of `messages` (empty then,
        and no media), a prompt run as it is (`epd.stages.raw_prompt`). `template`: how the chat
        template renders the prompt (a new answer, or the last message left open to continue; its
        variables; its own template). The prefix cache needs no part of it in its key: a continued
        message's, another variable's or another template's prompt is other token ids, and the
        cache reuses only an entry's common token prefix. `checkpoint`: called between the
        render's steps (`RenderOptions.checkpoint`), it raises to stop a render nobody waits for."""
        if raw_prompt is not None:
            check_raw_prompt(raw_prompt, messages, self.config.max_text_chars, self.adapter.vocab_size)
            if media is not None:
                raise InvalidRequest("a raw prompt takes no visual tokens; send the media with messages")
            self._check_generation(generation)
        else:
            self.validate(messages, None if media is None else media.meta, generation, template)
        # Tokenised now, not at the first token: a word this tokenizer cannot give is a 400
        # before the prompt's forward pass, not after it.
        bad_words = bad_words_token_ids(generation, self.adapter)
        if media is None:  # nothing for token dropping or KV compression to act on (module docstring)
            pruning = PruningConfig(kv_dtype=pruning.kv_dtype)
        refuse_unsupported_pruning(
            self.adapter.family, self.adapter.supported_pruning, self.adapter.pruning_refusal_reason, pruning
        )
        if media is not None:
            self._check_visual(media)
        meta = None if media is None else media.meta
        if checkpoint is not None:  # checked: the prompt next (the template, the tokens, the positions)
            checkpoint()
        try:
            # Rendered by the model's own chat template, parts in the user's order; the media
            # part's placeholder takes the kind the encoder found in the bytes.
            if raw_prompt is not None:
                prompt = self.adapter.build_raw_prompt(raw_prompt.text, raw_prompt.token_ids)
            else:
                prompt = self.adapter.build_prompt(
                    to_chat_template(messages, meta.modality if meta else ""),
                    meta,
                    replace(self._render_options(template), checkpoint=checkpoint),
                )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        num_visual = meta.num_visual_tokens if meta else 0
        if prompt.num_tokens > self.max_prompt_tokens:
            # Advice for what made it long: the media's tokens, or the conversation's text.
            mostly_media = 2 * num_visual >= prompt.num_tokens
            raise ResourceExhausted(
                f"the prompt has {prompt.num_tokens} tokens ({num_visual} of them the "
                f"media's), over the limit of {self.max_prompt_tokens}; "
                + (
                    "lower max_frames, fps or max_pixels"
                    if mostly_media
                    else "send a shorter prompt"
                    if raw_prompt is not None
                    else "send a shorter conversation"
                )
            )
        generation = self._within_context(prompt.num_tokens, generation, raw=raw_prompt is not None)
        exclusive = (
            (media is not None and media.token_index is not None)
            or pruning.prefill_drop
            or pruning.kv_compress
            or pruning.decode_evict
        )
        if generation.prompt_logprobs is not None:
            self._check_prompt_logprobs(exclusive, prompt.num_tokens, generation.prompt_logprobs)
        request = PrefillRequest(
            request_id,
            priority=generation.priority,
            num_prompt_tokens=prompt.num_tokens,
            exclusive=exclusive,
            prompt=prompt,
            media=media,
            generation=generation,
            pruning=pruning,
            bad_words_token_ids=bad_words,
        )
        # Pruned requests neither store nor reuse: their cache depends on the question (prefill
        # drop, KV compression, decode eviction's mask) or is built on a gathered prompt.
        if use_prefix_cache and not exclusive and self.prefix_caching and self.prefix_cache.enabled:
            request.prefix_key = self._prefix_key(media, pruning, cache_salt, raw=raw_prompt is not None)
            visual = prompt.visual_mask.nonzero()
            # The media comes after text-only turns ("hello", an answer, then the video): their
            # entry (the text-only key) holds this prompt's KV up to its first visual token, the
            # same token ids at the same positions (every M-RoPE row is the text position there
            # in both prompts), so it may serve those. Not for a conversation that opens with its
            # media: it had no text-only turns, only other conversations' template preambles.
            # Its own entry is kept under the text-only key too, for that text: a text-only
            # conversation with the same opening finds it, and the text turns' entry, which it
            # supersedes, leaves (`PrefixCache.put`).
            if media is not None and visual.numel() and not media_in_opening(messages):
                request.prefix_also = PrefixView(self._prefix_key(None, pruning, cache_salt), int(visual[0]))
        return request

    def admit(self, request: PrefillRequest) -> PrefillRequest:
        """A rendered request (`render`) with its prefix-cache hit, if any: on the model thread,
        which alone touches the prefix cache (its steps store into it)."""
        # A request asking for prompt_logprobs needs every prompt position's logits, which a
        # reused prefix never computes: it runs the whole prompt (as vLLM skips the prefix
        # cache for it), and its KV is still stored for later turns.
        if request.prefix_key is None or request.generation is None or request.prompt is None:
            return request
        if request.generation.prompt_logprobs is not None:
            return request
        visual = request.prompt.visual_mask.nonzero()
        visual_end = int(visual[-1]) + 1 if visual.numel() else 0  # the reuse must cover them all
        hit = self.prefix_cache.lookup(
            request.prefix_key, request.prompt.input_ids[0], visual_end, request.prefix_also
        )
        if hit is not None:
            request.prefix = hit
            request.num_reused_tokens = request.num_computed_tokens = hit.num_reused_tokens
        return request

    def _check_prompt_logprobs(self, exclusive: bool, num_prompt_tokens: int, k: int) -> None:
        """InvalidRequest when `prompt_logprobs` cannot be computed for this request: a family whose
        prefill has no per-position logits, or token dropping / KV compression, whose prompt runs
        gathered or layer by layer (the dropped positions would have no logits, and what is kept is
        not the prompt the model would see). ResourceExhausted past `MAX_PROMPT_LOGPROB_ENTRIES`, the
        memory one answer may take, before the prompt runs."""
        if not self.adapter.supports_prompt_logprobs:
            family = self.adapter.family or type(self.adapter).__name__
            raise InvalidRequest(f"this {family} model does not compute prompt_logprobs; leave it unset")
        if (num_entries := num_prompt_tokens * (k + 1)) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ResourceExhausted(
                f"prompt_logprobs={k} for a {num_prompt_tokens}-token prompt would be {num_entries} entries "
                f"(prompt tokens x (k + 1)), over the {MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold (the "
                f"gateway's memory for it; at most {MAX_PROMPT_LOGPROB_ENTRIES // (k + 1)} prompt tokens at "
                "this k); ask for fewer top tokens, or send a shorter prompt"
            )
        if exclusive:
            raise InvalidRequest(
                "prompt_logprobs cannot be computed with token dropping or KV compression (the "
                "pruned prompt is not the one the model would see); turn pruning off or leave "
                "prompt_logprobs unset"
            )

    def _within_context(
        self, num_prompt_tokens: int, generation: GenerationConfig, raw: bool
    ) -> GenerationConfig:
        """`generation` as it fits the served context after a prompt of `num_prompt_tokens`: as
        asked, or, for a max_tokens left unset (`fit_max_new_tokens`), lowered to what the context
        leaves (vLLM's default max_tokens); InvalidRequest (vLLM's 400) saying what to change when
        it cannot fit. `raw`: a raw prompt's (the advice names a prompt, not a conversation)."""
        context = self.context_tokens
        if context is None or num_prompt_tokens + generation.max_new_tokens <= context:
            return generation
        shorter = "send a shorter prompt" if raw else "send a shorter conversation or fewer frames"
        if not generation.fit_max_new_tokens:
            raise InvalidRequest(
                f"this model's context is {context} tokens, but the request needs "
                f"{num_prompt_tokens + generation.max_new_tokens}: {num_prompt_tokens} in the prompt and up to "
                f"{generation.max_new_tokens} to generate (max_tokens); {shorter}, or ask for fewer tokens"
            )
        room = context - num_prompt_tokens  # tokens the answer may have
        if room >= max(1, generation.min_tokens):
            return replace(generation, max_new_tokens=room)
        # The client set no max_tokens: advice to ask for fewer would not help.
        said = f"this model's context is {context} tokens and the prompt has {num_prompt_tokens}"
        if room < 1:
            raise InvalidRequest(f"{said}, which leaves none for the answer: {shorter}")
        raise InvalidRequest(
            f"{said}, which leaves {room} for the answer, fewer than min_tokens "
            f"({generation.min_tokens}): lower min_tokens, or {shorter}"
        )

    def _prefix_key(
        self, media: EncodedMedia | None, pruning: PruningConfig, cache_salt: str = "", raw: bool = False
    ) -> tuple:
        """What makes two prompts with the same token ids have different KV: the model, the media
        as encoded (hash, grid, frames sampled, encoder pruning, and a digest of the embeddings
        themselves, so that different encodes never match) and how the cache is kept (kv_dtype);
        and whose it is (`cache_salt`, the tenant: the same video's embeddings are equal for
        every tenant, so without it one tenant's follow-up would reuse another's KV). A text-only
        conversation's key names no media, so it never matches a media request's (whose token
        ids differ anyway: the placeholders), and its follow-ups find it as a video's do. A raw
        prompt's (`raw`) names neither: a raw prompt continues only raw prompts that begin alike,
        never a chat prompt whose rendered text it happens to spell."""
        if raw:
            return (self.adapter.fingerprint, "raw prompt", pruning.kv_dtype, cache_salt)
        if media is None:
            return (self.adapter.fingerprint, "text only", pruning.kv_dtype, cache_salt)
        digest = hashlib.sha256()
        for tensor in (media.embeds, *media.deepstack):  # ~5 ms per 7 MB
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        meta = media.meta
        return (
            self.adapter.fingerprint,
            media.sha256,
            meta.modality,
            tuple(meta.grid_thw),
            meta.second_per_grid_t,
            tuple(meta.group_timestamps_s),
            meta.num_visual_tokens,
            tuple(media.frame_timestamps_s),
            None if media.token_index is None else tuple(media.token_index.tolist()),
            tuple((s.stage, s.num_visual_tokens_in, s.num_visual_tokens_out) for s in media.pruning.stages),
            pruning.kv_dtype,
            digest.hexdigest(),
            cache_salt,
        )

    def prefix_start_cache(self, request: PrefillRequest):
        """The adapter's cache of tokens [0, num_reused_tokens) for a prefix-cache hit's first
        chunk: a copy of the stored entry's KV [:, :, :reused] (the entry is never written)."""
        hit = request.prefix
        assert hit is not None
        n = hit.num_reused_tokens
        kv: KvCache = hit.entry.cache
        # [1, kv_heads, n, head_dim] views; new_decode_cache builds a DynamicCache, whose update
        # concatenates them into new tensors, so later chunks grow the copy, not the entry.
        return self.adapter.new_decode_cache(
            KvCache([k[:, :, :n] for k in kv.keys], [v[:, :, :n] for v in kv.values])
        )

    def remember(self, request: PrefillRequest, cache: KvCache) -> None:
        """Keep a finished prompt's KV (in the model's dtype, before any kv_dtype cast) for the
        follow-ups of its conversation."""
        if request.prefix_key is None or cache.linear_layers or request.prompt is None:
            return
        self.prefix_cache.put(
            request.prefix_key, request.prompt.input_ids[0], cache, cache.num_bytes, also=request.prefix_also
        )

    def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia | None,
        generation: GenerationConfig,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillOutput:
        """One request, whole and alone (benchmarks and tools; the service runs `PrefillRunner`).
        The prefix cache is left alone: a benchmark repeating a prompt times the whole prefill."""
        request = self.render(messages, media, generation, pruning, use_prefix_cache=False)
        t0 = time.perf_counter()
        if request.exclusive:
            return self.prefill_pruned(request)
        prompt = _parts(request)[0]
        if generation.prompt_logprobs is not None:  # every position's logits: the chunked path's
            features = self.features(request)
            row = PrefillChunk(
                prompt,
                features.embeds,
                0,
                prompt.num_tokens,
                None,
                features.deepstack,
                generation.prompt_logprobs,
            )
            result = self.adapter.prefill_chunks([row])[0]
            request.prompt_logprob_rows = result.prompt_logprobs
            cache = self.adapter.chunk_cache_to_kv(result.cache)
            return self.finish(request, cache, result.last_logits, (time.perf_counter() - t0) * 1e3)
        state = self.adapter.prefill_features(prompt, self.features(request))
        return self.finish(request, state.cache, state.last_logits, (time.perf_counter() - t0) * 1e3)

    def prefill_pruned(self, request: PrefillRequest) -> PrefillOutput:
        """A request with token dropping or KV compression: whole and alone, as `pruned_prefill` does it."""
        prompt, media, pruning = _parts(request)
        assert media is not None  # a text-only request is never exclusive (`render`)
        if media.deepstack:
            return self._prefill_kept_tokens(request)
        t0 = time.perf_counter()
        stats = PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
        try:
            out = pruned_prefill(
                self.adapter, prompt, media.embeds, media.token_index, media.key_mask, pruning, stats
            )
        except ValueError as exc:  # budgets that cannot be met (e.g. key tokens over budget)
            raise InvalidRequest(str(exc)) from None
        return self.finish(
            request,
            out.state.cache,
            out.state.last_logits,
            (time.perf_counter() - t0) * 1e3,
            stats=stats,
            pruned=out,
        )

    def _prefill_kept_tokens(self, request: PrefillRequest) -> PrefillOutput:
        """A DeepStack family's request whose encoder dropped tokens (the only pruning it has
        before decode, `refuse_unsupported_pruning`): the prompt without the dropped placeholders,
        every kept token at its full-prompt position, and the DeepStack features' rows of the kept
        tokens (the encoder kept the same rows), run whole through `prefill_features`."""
        prompt, media, _ = _parts(request)
        assert media is not None and media.token_index is not None
        t0 = time.perf_counter()
        full_visual = prompt.visual_mask.nonzero().flatten()  # [V] prompt index of each placeholder
        keep = prompt_keep_indices(prompt.num_tokens, full_visual, media.token_index)  # [L'] increasing
        kept = gather_prompt(prompt.input_ids, prompt.position_ids, keep)
        kept_prompt = Prompt(kept.input_ids, kept.position_ids, prompt.visual_mask[keep])
        try:
            state = self.adapter.prefill_features(kept_prompt, self.features(request))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        stats = PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
        with contextlib.suppress(UnsupportedByFamily):  # a family without text_dims: no estimate
            sizes = ModelSizes.from_dims(self.adapter.text_dims)
            stats.prefill_flops_full = prefill_flops(sizes, prompt.num_tokens)
            stats.prefill_flops_pruned = prefill_flops(sizes, kept_prompt.num_tokens)
        cache = state.cache
        stats.kv_bytes_before = stats.kv_bytes_after = cache.num_bytes
        # [layers, kv_heads, cached] bool: the visual entries (decode eviction is refused for
        # DeepStack families, so nobody reads it; kept for PrunedPrefill's shape)
        visual_entries = kept_prompt.visual_mask.expand(len(cache.keys), cache.keys[0].shape[1], -1).clone()
        pruned = PrunedPrefill(state, visual_entries, media.token_index.tolist(), cache.num_bytes)
        ms = (time.perf_counter() - t0) * 1e3
        return self.finish(request, cache, state.last_logits, ms, stats=stats, pruned=pruned)

    def finish(
        self,
        request: PrefillRequest,
        cache: KvCache,
        last_logits: torch.Tensor,
        prefill_ms: float,
        stats: PruningStats | None = None,
        pruned: PrunedPrefill | None = None,
    ) -> PrefillOutput:
        """The prompt's cache and last logits -> the first token and the handle decoding starts from."""
        prompt, media, pruning = _parts(request)
        if stats is None:
            stats = (
                PruningStats()
                if media is None
                else PruningStats(
                    stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens
                )
            )
        num_in = 0 if media is None else media.meta.num_visual_tokens
        if pruned is not None:
            mask, kept, kv_before, num_out = (
                pruned.visual_entry_mask,
                pruned.kept_visual_token_index,
                pruned.kv_bytes_before,
                len(pruned.kept_visual_token_index),
            )
        else:
            mask, kept, kv_before, num_out = None, [], cache.num_bytes, num_in
        if pruning.kv_dtype != "auto":
            cache = cache.cast(getattr(torch, pruning.kv_dtype))
            stats.kv_bytes_before = kv_before
            stats.kv_bytes_after = cache.num_bytes
        assert request.generation is not None
        # The whole prompt as generate() sees it (media placeholders included, whatever pruning
        # dropped), for repetition_penalty only: the decoder gets these ids too, it has no prompt.
        distinct_prompt_ids = (
            torch.unique(prompt.input_ids).tolist() if request.generation.repetition_penalty != 1.0 else []
        )
        bad_words = request.bad_words_token_ids
        # A constraint that waits for the reasoning's end holds at once when the prompt closed the
        # thinking block (vLLM reads its prompt so); the decoder, which has no prompt, is told.
        ends_reasoning = request.grammar is not None and request.grammar.prompt_ends_reasoning(
            prompt.input_ids[0].tolist()
        )
        # One first token per choice (vLLM's n), each by the choice's own sampler (seed + i, and its
        # own matcher of a structured-output constraint) from the same logits [vocab]; a sampler may
        # change the logits it gets, so each gets a copy.
        starts = []
        row = None
        for index in range(request.generation.n):
            generation = request.generation.for_choice(index)
            sampler = Sampler(
                generation,
                0,
                distinct_prompt_ids,
                self.adapter.eos_token_ids,
                bad_words,
                request.grammar,
                ends_reasoning,
            )
            if index == 0 and (k := request.generation.logprobs) is not None:
                # The raw distribution (last_logits [vocab]), taken before the sampler's processors
                # run (after a structured-output constraint's mask, as vLLM's: `Sampler.allowed`);
                # one row for every choice (their tokens differ, the distribution does not).
                row = rows_logprobs(sampler.allowed(last_logits).unsqueeze(0), [k])[0]
            token = sampler(last_logits if request.generation.n == 1 else last_logits.clone())
            # The decoder's first step, worked out here so the first token can go out before the
            # cache reaches a decoder; a token that ends the request is left to the decoder.
            output = OutputText(
                self.adapter.detokenize,
                self.adapter.eos_token_ids,
                generation,
                eos_token_id=self.adapter.eos_token_id,
            )
            text, finish = output.add(token)
            logprob = None if row is None else token_logprob(row, token, self.adapter.token_text)
            starts.append(ChoiceStart(token, None if finish else text, logprob))
        first, first_text = starts[0].first_token_id, starts[0].first_text
        handle = PrefillHandle(
            first_token_id=first,
            num_prompt_tokens=prompt.num_tokens,
            num_cached_tokens=cache.num_cached_tokens,
            next_position_ids=[int(x) for x in prompt.position_ids[:, 0, -1] + 1],
            kv_num_bytes=cache.num_bytes,
            prefill_ms=prefill_ms,
            num_visual_tokens_in=num_in,
            num_visual_tokens_out=num_out,
            kv_num_bytes_uncompressed=kv_before,
            pruning=stats,
            # [layers, kv_heads, cached] bool; sent only when decode-stage eviction will use it.
            visual_entry_mask=mask if pruning.decode_evict else None,
            kept_visual_token_index=kept,
            num_reused_prompt_tokens=request.num_reused_tokens,
            first_text=first_text,
            distinct_prompt_token_ids=distinct_prompt_ids,
            prompt_ends_reasoning=ends_reasoning,
            max_new_tokens=request.generation.max_new_tokens,
            first_logprob=starts[0].first_logprob,
            other_choices=starts[1:],
            prompt_logprobs=self._prompt_logprobs(request),
        )
        return PrefillOutput(handle, cache)

    def _prompt_logprobs(self, request: PrefillRequest) -> list[TokenLogprob] | None:
        """The prompt logprobs its chunks computed (`PrefillRequest.prompt_logprob_rows`), with texts."""
        rows = request.prompt_logprob_rows
        if request.generation is None or request.generation.prompt_logprobs is None or rows is None:
            return None
        prompt, _, _ = _parts(request)
        return prompt_token_logprobs(rows, prompt.input_ids[0].tolist(), self.adapter.token_text)

    def features(self, request: PrefillRequest) -> VisualFeatures:
        """The request's embeddings [V, hidden] and DeepStack features (None for families without
        them); a text-only request's are empty ([0, hidden] each), so it runs and batches as any
        prompt, its visual mask all False."""
        media = request.media
        if media is not None:
            return VisualFeatures(media.embeds, list(media.deepstack) or None)
        empty = torch.empty(0, self.adapter.hidden_size)
        return VisualFeatures(empty, [empty] * self.adapter.num_deepstack_layers or None)


def _parts(request: PrefillRequest) -> tuple[Prompt, EncodedMedia | None, PruningConfig]:
    assert request.prompt is not None and request.pruning is not None
    return request.prompt, request.media, request.pruning
