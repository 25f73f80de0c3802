"""Prefill's work before a request's steps: messages + visual embeddings -> a checked, rendered
`PrefillRequest` (`render`), and its prefix-cache hit (`admit`). No gRPC here.

A conversation without a media part comes with no media (None): its prompt is the chat template
of its text alone, with the positions `generate()` gives text (M-RoPE families: every row the
plain position), and it runs, batches and chunks as any prompt, with no visual rows. A raw prompt
(`epd.stages.raw_prompt`, the legacy completions API) runs the same way, its text tokenised as
the tokenizer tokenises text by default, with no chat template. The
media's options mean nothing to it: its pruning is only `kv_dtype`, as vLLM ignores a request's
multimodal processor options when it has no media.

A request's checks that need its prompt or media are `request_checks`', its prefix-cache key
`prefix_key`'s; the first token and the handle after its last step are `first_token`'s, a
request run whole and alone `whole_prefill`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from epd.model_runtime.adapter import (
    RenderOptions,
    VisualMeta,
    VLMAdapter,
)
from epd.model_runtime.chat_template import check_syntax
from epd.model_runtime.generation_defaults import model_defaults
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.loader import ModelLoadError
from epd.model_runtime.reasoning_markers import REASONING_MARKERS
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.prefix_cache import PrefixCache, PrefixView
from epd.prefill_svc.prefix_key import prefix_cache_key
from epd.prefill_svc.request_checks import check_prompt_logprobs, check_visual, within_context
from epd.prefill_svc.scheduler import PrefillRequest
from epd.stages.chat_template import refuse_untrusted
from epd.stages.contracts import (
    EncodedMedia,
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
from epd.stages.model_info import ModelInfo
from epd.stages.raw_prompt import RawPrompt, check_raw_prompt
from epd.stages.tokenize import TokenizeInput, TokenizeOutput, check_token_ids
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)


class PrefillEngine:
    """The prefill stage's per-request work around the model: validation and the prompt before a
    request queues (`render`, then `admit`), and the prefix cache its steps read and fill. The batched
    steps in between are `PrefillRunner`'s; the first token and the handle after the last step are
    `first_token.finish_prefill`'s."""

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
        checkpoint = config.model  # ModelConfig: the path or hub id the operator gave
        self.generation_defaults = model_defaults(checkpoint.model)
        """The model's generation_config.json sampling fields (`ModelInfo.generation_defaults`):
        read here, where the model is, for a front door that holds no model folder."""
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
            generation_defaults=self.generation_defaults,
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
            check_visual(self.adapter, media)
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
        generation = within_context(
            self.context_tokens, prompt.num_tokens, generation, raw=raw_prompt is not None
        )
        exclusive = (
            (media is not None and media.token_index is not None)
            or pruning.prefill_drop
            or pruning.kv_compress
            or pruning.decode_evict
        )
        if generation.prompt_logprobs is not None:
            check_prompt_logprobs(self.adapter, exclusive, prompt.num_tokens, generation.prompt_logprobs)
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
            request.prefix_key = prefix_cache_key(
                self.adapter.fingerprint, media, pruning, cache_salt, raw=raw_prompt is not None
            )
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
                request.prefix_also = PrefixView(
                    prefix_cache_key(self.adapter.fingerprint, None, pruning, cache_salt), int(visual[0])
                )
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
        follow-ups of its conversation; `request.num_stored_tokens` says how many tokens that wrote
        (the Responses API's `cache_write_tokens`)."""
        if request.prefix_key is None or cache.linear_layers or request.prompt is None:
            return
        request.num_stored_tokens = self.prefix_cache.put(
            request.prefix_key, request.prompt.input_ids[0], cache, cache.num_bytes, also=request.prefix_also
        )
