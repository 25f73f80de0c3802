"""The language-model side every family runs on transformers' text models: decode (one request or
a batch), the decode cache and KV sizes, chunked prefill's row handling, and the small accessors
the engines and pruning code use. A family subclasses `HfTextAdapter` and overrides the hooks
where its model differs (`_text_positions` for 1-D rotary positions, `one_dim_text.OneDimTextAdapter`
the whole of it; `_kv_shape` for hybrid layers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.exceptions import SecurityError

from epd.model_runtime.adapter import (
    ChunkResult,
    PrefillChunk,
    PrefillState,
    Prompt,
    RenderOptions,
    VLMAdapter,
)
from epd.model_runtime.batch_kv import BatchKv
from epd.model_runtime.chat_template import error_text, template_variables
from epd.model_runtime.hf_loading import load_full_model
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.logprobs import PromptLogprobRows, prompt_logprob_rows
from epd.model_runtime.prompt_positions import text_prompt
from epd.model_runtime.template_errors import (
    raise_render_failure,
    raise_servers_failure,
    refuse_templates_placeholder,
    whose_template,
)
from epd.model_runtime.visual_placeholders import check_visual_count


class HfTextAdapter(VLMAdapter):
    """`self.model` is transformers' whole model or `LanguageOnly` (`.model.language_model`,
    `.lm_head`), None on a stage without the language part."""

    device: torch.device
    dtype: torch.dtype
    parts: frozenset[str]
    hf_config: Any
    tokenizer: Any
    processor: Any  # the family's transformers processor (its chat template and placeholders)
    model: Any
    visual: Any

    supports_batched_decode = True

    @property
    def context_tokens(self) -> int | None:
        return getattr(self.hf_config.get_text_config(), "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.hf_config.get_text_config(), "vocab_size", None)

    def _load_parts(self, path: str, load_vision: Callable, load_language: Callable) -> None:
        """The parts this stage needs: both -> transformers' whole model (its tower at
        `model.visual`); one -> `load_vision` / `load_language`(path, hf_config, dtype), which read
        only that part's tensors; none -> prompts only (build_prompt), no weights."""
        self.visual = None
        self.model = None
        if self.parts >= {"vision", "language"}:
            self.model = load_full_model(path, self.dtype, self.device)
            self.visual = self.model.model.visual
        elif "vision" in self.parts:
            self.visual = load_vision(path, self.hf_config, self.dtype).to(self.device)
        elif "language" in self.parts:
            self.model = load_language(path, self.hf_config, self.dtype).to(self.device).eval()

    # -- the language model ------------------------------------------------------------------

    def _language_model(self):
        if self.model is None:
            raise RuntimeError("this adapter was loaded without the language model")
        return self.model.model.language_model

    @property
    def language_model(self):
        """transformers' text model (embed_tokens, layers, rotary_emb, norm)."""
        return self._language_model()

    @property
    def lm_head(self):
        if self.model is None:
            raise RuntimeError("this adapter was loaded without the language model")
        return self.model.lm_head

    @property
    def text_config(self):
        return self.hf_config.text_config

    def _model_dtype(self) -> torch.dtype:
        return self._language_model().embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._language_model().embed_tokens(input_ids.to(self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def detokenize(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    # -- prefill -----------------------------------------------------------------------------

    def _text_only_prompt(self, conversation: list[dict[str, Any]], options: RenderOptions) -> Prompt:
        """`build_prompt` of a conversation without a media part: the processor's own template of
        its text, tokenised as the processor's __call__ tokenises it, and the positions generate()
        gives a prompt without grids (`_prepare_position_ids_for_generation` then skips
        get_rope_index: every M-RoPE row is the text position; a 1-D family's rows are too)."""
        text = self._render_text_only(conversation, options)
        input_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # [1, L]
        return text_prompt(input_ids)

    def build_raw_prompt(self, text: str, token_ids: Sequence[int] = ()) -> Prompt:
        """`text` tokenised as `tokenizer(text)` tokenises it (the tokenizer's special tokens added,
        transformers' default), or `token_ids` as they are, with the positions of any text prompt
        (`_text_only_prompt`): generate(input_ids)'s, as no grid is given."""
        ids = list(token_ids) if not text else self.tokenizer(text)["input_ids"]
        placeholders = {
            self.tokenizer.convert_tokens_to_ids(t)
            for t in (self.processor.video_token, self.processor.image_token)
        }
        if placeholders.intersection(ids):
            raise ValueError(
                "the prompt holds the model's visual placeholder token, which only the chat "
                "completions API's media parts place; remove it"
            )
        return text_prompt(torch.tensor([ids], dtype=torch.long))

    def _render_text_only(self, conversation: list[dict[str, Any]], options: RenderOptions) -> str:
        """The chat template of a conversation without media; ValueError as `_render`'s, or, when
        the template writes a visual placeholder of its own, `refuse_templates_placeholder`'s."""
        text = self._render(conversation, options)
        if any(token in text for token in (self.processor.video_token, self.processor.image_token)):
            refuse_templates_placeholder(options, "for a conversation without media")
        return text

    def _render(self, conversation: list[dict[str, Any]], options: RenderOptions) -> str:
        """The chat template of `conversation`, as a string (every family's prompt starts here):
        `options.chat_template` (the server's --chat-template or the request's, as vLLM passes it
        to `apply_chat_template`), None: the processor's own; with those of `options.variables`
        the template reads (vLLM's filter: a name it does not read would reach the processor's own
        options instead; the request's `tools` come among them and reach apply_chat_template as
        its `tools=`).
        ValueError when a text part, a tool call's arguments, a tool message's call id or a
        variable's text holds the model's visual placeholder (only a media part places it: in
        text it would take the media's embeddings, or miscount them), when the template cannot leave the last message
        open, when a template refuses the conversation itself (its `raise_exception`), or when a
        request's `chat_template` fails to render (its error's message, one short line: the
        template is the caller's). The operator's template failing otherwise is the server's
        error: the model's own raises as it fails, the server's (--chat-template) a
        RuntimeError that names --chat-template."""
        placeholders = (self.processor.video_token, self.processor.image_token)
        # A message's text parts joined, as the templates join them (nothing between): "<|vid" and
        # "eo_pad|>" in two parts make a placeholder the template would seem to write itself.
        if any(
            token in "".join(part.get("text", "") for part in m["content"])
            for m in conversation
            for token in placeholders
        ):
            raise ValueError(
                "a text part contains the model's visual placeholder token (or a message's text parts "
                "make one together); remove it"
            )
        if any(
            token in text
            for m in conversation
            for text in _strings_in(m.get("tool_calls", ()))
            for token in placeholders
        ):
            raise ValueError(
                "a tool call's arguments contain the model's visual placeholder token; remove it"
            )
        if any(token in m.get("tool_call_id", "") for m in conversation for token in placeholders):
            raise ValueError(
                "a tool message's tool_call_id contains the model's visual placeholder token; remove it"
            )
        chat_template = options.chat_template
        variables = self._template_variables(options.variables, chat_template)
        if any(token in text for text in _strings_in(variables) for token in placeholders):
            raise ValueError(
                "a chat_template_kwargs value or a tool contains the model's visual placeholder token; remove it"
            )
        try:
            text = self.processor.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                **variables,
            )
        except TemplateSyntaxError:
            if options.requests_template:  # checked where it was given (`chat_template.check_syntax`)
                raise ValueError("the chat template does not parse; send one that does") from None
            raise  # the checkpoint's (or --chat-template's) template is broken: the server's error
        except SecurityError as exc:  # a TemplateError: a template reached past the sandbox
            if not options.requests_template:  # the operator's template: the server's error
                raise_servers_failure(options, exc)
            raise ValueError(
                f"{whose_template(options)} was stopped by the sandbox it renders in: {error_text(exc)}; a "
                "template reads the messages and its variables, not Python's internals"
            ) from None
        except TemplateError as exc:
            # A subclass is jinja's own failure (UndefinedError: `{{ x.y }}` of an undefined x).
            if type(exc) is not TemplateError:
                raise_render_failure(options, exc, bool(variables))
            # The template's own `raise_exception` (transformers raises a plain TemplateError;
            # Qwen3.5's "No user query found in messages." for a conversation without a user
            # message, which an assistant's message last allows): a shape of conversation the
            # model does not take, as vLLM's 400 says, whoever wrote the template.
            raise ValueError(
                f"{whose_template(options)} cannot render this conversation: {error_text(exc)}; send "
                "its messages in a shape the model takes (for example with a user message before "
                "the assistant's)"
            ) from None
        except ValueError as exc:
            # transformers' message goes on to quote the last message and the whole rendered
            # conversation (a 400 of up to the text limit): its explanation is enough.
            raise ValueError(str(exc).split("Final message to continue:")[0].splitlines()[0][:400]) from None
        except Exception as exc:
            raise_render_failure(options, exc, bool(variables))
        options.between_steps()  # the template rendered: the request may have gone meanwhile
        return text

    def _template_variables(
        self, variables: Mapping[str, Any], chat_template: str | None = None
    ) -> dict[str, Any]:
        """The request's variables that the chat template reads (the others dropped), as vLLM's
        `resolve_chat_template_kwargs` finds them: with the parser transformers renders with
        (`epd.model_runtime.chat_template`). When the template's variables are not known (a
        template that parser refuses, which then cannot render either), every one of them is
        passed: never silently none. The server's own names (`template_kwargs.RESERVED`, vLLM's
        `chat_template` and `tokenize` among them) were refused at every door already."""
        if not variables:
            return {}
        template = chat_template if chat_template is not None else self.processor.chat_template
        if isinstance(template, dict):  # a processor with named templates renders with "default"
            template = template.get("default")
        read = template_variables(template) if isinstance(template, str) else None
        if read is None:
            return dict(variables)
        return {name: value for name, value in variables.items() if name in read}

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def tokenize_conversation(
        self,
        conversation: list[dict[str, Any]],
        add_special_tokens: bool,
        options: RenderOptions = RenderOptions(),
    ) -> list[int]:
        text = self._render_text_only(conversation, options)
        return self.tokenize(text, add_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(token_ids))

    def decode_tokens(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def single_tokens(self, texts: Sequence[str]) -> dict[str, int]:
        vocab = self.tokenizer.get_vocab()  # {token: id}, added tokens too (vLLM's `vocab.get`)
        return {text: vocab[text] for text in texts if text in vocab}

    def settle_tokenizer(self) -> None:
        # A fast tokenizer's Rust backend holds truncation, padding and special-token splitting
        # settings, which transformers changes only when a call asks for others than it holds
        # (`TokenizersBackend.set_truncation_and_padding`, `encode_special_tokens`): every call of
        # ours asks for transformers' defaults (none, none, the tokenizer's own), so after one such
        # call nothing ever changes it, and calls from several threads only read it (concurrent reads
        # are safe; a change while another thread encodes would alter that call's ids or, before
        # tokenizers 0.23.1, fail itself: "Already borrowed"). A tokenizer.json that sets truncation or
        # padding would make the first call change them: it happens here, before a second thread.
        self.tokenizer("", add_special_tokens=False)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, visual_embeds: torch.Tensor) -> PrefillState:
        """`_prefill_whole`: a family whose text model takes the embeddings and positions alone
        (Qwen2-VL, GLM-4.1V, the 1-D families); the others override it."""
        return self._prefill_whole(prompt, visual_embeds)

    def _prefill_whole(self, prompt: Prompt, visual_embeds: torch.Tensor, **extra: Any) -> PrefillState:
        """One prompt in one forward (call under inference_mode): token embeddings with the visual
        positions filled in order (`_prompt_embeds`), the prompt's [4, 1, L] positions (as the text
        model takes them: `_text_positions`), `extra` passed to the text model (DeepStack's); the
        cache transformers' `DynamicCache(config)` builds (a hybrid model's linear layers:
        `LinearAttentionLayer`). ValueError unless there is one embedding per
        visual position (`masked_scatter` would take the first of too many)."""
        from transformers import DynamicCache

        check_visual_count(prompt, visual_embeds)
        cache = DynamicCache(config=self.hf_config.text_config)
        length = prompt.num_tokens
        out = self._language_model()(
            inputs_embeds=self._prompt_embeds(prompt, visual_embeds),
            position_ids=self._text_positions(prompt.position_ids).to(self.device),
            attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        logits = self.lm_head(out.last_hidden_state[:, -1:])  # [1, 1, vocab]
        return PrefillState(
            cache=KvCache.from_dynamic(cache),
            last_logits=logits[0, -1],
            next_position_ids=prompt.position_ids[:, 0, -1] + 1,
            num_prompt_tokens=length,
        )

    def _prompt_embeds(self, prompt: Prompt, visual_embeds: torch.Tensor) -> torch.Tensor:
        """[1, L, hidden]: the prompt's token embeddings, its visual positions filled with
        `visual_embeds` in order (LLaVA-OneVision's also write a video's closing newline)."""
        embeds = self._language_model().embed_tokens(prompt.input_ids.to(self.device))  # [1, L, hidden]
        mask = prompt.visual_mask.to(self.device)[None, :, None].expand_as(embeds)
        return embeds.masked_scatter(mask, visual_embeds.to(self.device, embeds.dtype))

    # -- chunked prefill ---------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_chunks(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Rows without a cache (whole prompts, first chunks) share one right-padded forward
        (`_prefill_padded`); a row that continues its cache runs alone over its chunk
        (`_prefill_continue`: caches of different lengths would need padding inside the cache)."""
        results: list[ChunkResult | None] = [None] * len(rows)
        fresh = [i for i, row in enumerate(rows) if row.cache is None]
        if fresh:
            for i, result in zip(fresh, self._prefill_padded([rows[i] for i in fresh]), strict=True):
                results[i] = result
        for i, row in enumerate(rows):
            if row.cache is not None:
                results[i] = self._prefill_continue(row)
        return [r for r in results if r is not None]

    def _chunk_embeds(self, row: PrefillChunk) -> torch.Tensor:
        """[1, end - start, hidden]: token embeddings of the chunk, its visual placeholders filled
        with the visual embeddings of its own positions (in placeholder order)."""
        lm = self._language_model()
        embeds = lm.embed_tokens(row.prompt.input_ids[:, row.start : row.end].to(self.device))
        visual = row.prompt.visual_mask[row.start : row.end]  # [n] bool
        first = int(row.prompt.visual_mask[: row.start].sum())  # visual tokens in earlier chunks
        if num := int(visual.sum()):
            chunk_visual = row.visual_embeds[first : first + num]  # [num, hidden]
            embeds[0, visual.to(self.device)] = chunk_visual.to(self.device, embeds.dtype)
        return embeds

    def _prefill_padded(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Rows from token 0 in one right-padded forward (`_padded_embeds`) with their positions
        (`_padded_mrope_positions`, as the text model takes them: `_text_positions`): a family
        whose text model takes nothing else (Qwen2-VL, GLM-4.1V, the 1-D families); the others
        override it."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf_config.text_config)
        out = self._language_model()(
            inputs_embeds=self._padded_embeds([self._chunk_embeds(row)[0] for row in rows]),  # [B, L, H]
            position_ids=self._text_positions(self._padded_mrope_positions(rows)).to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return self._padded_results(cache, out.last_hidden_state, rows)

    # What every family's `_prefill_padded` shares. Rows start at token 0 and are right-padded to
    # the longest, [B, L]. No padding mask is needed: attention is causal and the padding comes
    # after every valid token of its row, so no valid token sees it (a valid row computes what it
    # computes alone, up to rounding; the padded positions continue the row's own, and their
    # outputs are cut off).

    def _padded_embeds(self, row_embeds: list[torch.Tensor]) -> torch.Tensor:
        """Each row's embeddings [n_i, hidden], zero-padded after its tokens: [B, L, hidden]."""
        longest = max(int(e.shape[0]) for e in row_embeds)
        dtype = self._language_model().embed_tokens.weight.dtype
        embeds = torch.zeros(len(row_embeds), longest, self.hidden_size, dtype=dtype, device=self.device)
        for i, e in enumerate(row_embeds):
            embeds[i, : e.shape[0]] = e
        return embeds

    @staticmethod
    def _padded_mrope_positions(rows: list[PrefillChunk]) -> torch.Tensor:
        """M-RoPE positions [4, B, L] of rows from token 0 to `end`; a row's padding continues its
        last position one by one."""
        lengths = [row.end for row in rows]
        longest = max(lengths)
        positions = torch.zeros(4, len(rows), longest, dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            positions[:, i, :n] = row.prompt.position_ids[:, 0, :n]
            positions[:, i, n:] = positions[:, i, n - 1 : n] + torch.arange(1, longest - n + 1)
        return positions

    def _last_logits(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The logits [B, vocab] of each row's last valid token (hidden: [B, L, hidden])."""
        last = hidden[torch.arange(len(lengths)), torch.tensor(lengths) - 1]  # [B, hidden]
        return self.lm_head(last[:, None])[:, 0]

    def _prefill_continue(self, row: PrefillChunk) -> ChunkResult:
        """Tokens [start, end) after the row's cache of [0, start), which grows in place (M-RoPE
        positions [4, 1, n]; a hybrid model's linear layers continue from their states)."""
        self._check_continues(row)
        out = self._language_model()(
            inputs_embeds=self._chunk_embeds(row),
            position_ids=self._text_positions(row.prompt.position_ids[:, :, row.start : row.end]).to(
                self.device
            ),
            attention_mask=torch.ones(1, row.end, dtype=torch.long, device=self.device),
            past_key_values=row.cache,
            use_cache=True,
        )
        return self._continued_result(row, out.last_hidden_state)

    def _continued_result(self, row: PrefillChunk, hidden: torch.Tensor) -> ChunkResult:
        """A continuing chunk's result from its last hidden states [1, end - start, hidden]: the
        last position's logits, and the chunk's prompt logprobs when its row asked."""
        result = ChunkResult(row.cache, self.lm_head(hidden[:, -1:])[0, -1])
        result.prompt_logprobs = self._prompt_logprobs(row, hidden[0])
        return result

    def _padded_results(self, cache, hidden: torch.Tensor, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """A right-padded forward's rows (hidden [B, L, hidden], every row from token 0): each its
        cache and last logits (`_split_padded`), and its prompt logprobs when it asked."""
        lengths = [row.end for row in rows]
        results = self._split_padded(cache, self._last_logits(hidden, lengths), lengths)
        for i, (row, result) in enumerate(zip(rows, results, strict=True)):
            result.prompt_logprobs = self._prompt_logprobs(row, hidden[i, : row.end])
        return results

    supports_prompt_logprobs = True

    def _prompt_logprobs(self, row: PrefillChunk, hidden: torch.Tensor) -> PromptLogprobRows | None:
        """hidden [end - start, hidden]: the chunk's positions. Position p predicts prompt token
        p + 1; the prompt's last position predicts the first generated token, not a prompt token,
        so it has none. Computed only for a row that asked, chunk by chunk (`prompt_logprob_rows`)."""
        if row.prompt_logprobs is None:
            return None
        count = min(row.end, row.prompt.num_tokens - 1) - row.start  # positions with a next prompt token
        next_ids = row.prompt.input_ids[0, row.start + 1 : row.start + 1 + count]  # [count]
        head = self.lm_head
        return prompt_logprob_rows(head, hidden[:count], next_ids, row.prompt_logprobs, head.out_features)

    @staticmethod
    def _check_continues(row: PrefillChunk) -> None:
        """A continuing chunk [start, end) must follow its cache of exactly [0, start)."""
        past = row.cache.get_seq_length()
        if past != row.start:
            raise ValueError(f"the chunk starts at token {row.start} but its cache holds {past}")

    def _split_padded(self, cache, logits: torch.Tensor, lengths: list[int]) -> list[ChunkResult]:
        """A right-padded forward's results per row: logits [B, vocab]; each row its own cache,
        padding cut off (to_dynamic copies). One unpadded row keeps the forward's cache."""
        if len(lengths) == 1:
            return [ChunkResult(cache, logits[0])]
        kv = KvCache.from_dynamic(cache)  # [B, kv_heads, L, head_dim] per layer
        results = []
        for i, n in enumerate(lengths):
            row_kv = KvCache([k[i : i + 1, :, :n] for k in kv.keys], [v[i : i + 1, :, :n] for v in kv.values])
            results.append(ChunkResult(row_kv.to_dynamic(self.hf_config.text_config), logits[i]))
        return results

    def chunk_cache_to_kv(self, cache) -> KvCache:
        return KvCache.from_dynamic(cache)

    # -- decode ------------------------------------------------------------------------------

    def new_decode_cache(self, cache: KvCache):
        # The cache may arrive narrower than the model (PruningConfig.kv_dtype); compute in the model's.
        dtype = self._model_dtype()
        kv = KvCache(
            [k.to(self.device, dtype) for k in cache.keys], [v.to(self.device, dtype) for v in cache.values]
        )
        return kv.to_dynamic(self.hf_config.text_config)

    def _text_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The interface's positions [4, B, n] -> what the text model takes: all four rows (M-RoPE's
        text, t, h, w); a family with 1-D rotary positions takes row 0 (`OneDimTextAdapter`)."""
        return position_ids

    def _step_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The interface's [4] positions of one step -> the text model's (M-RoPE: [4, 1, 1])."""
        return self._text_positions(position_ids.view(4, 1, 1))

    def _batch_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The interface's [4, B] positions of a batch step -> the text model's (M-RoPE: [4, B, 1])."""
        return self._text_positions(position_ids[:, :, None])

    @torch.inference_mode()
    def decode_step(self, token_id: int, position_ids: torch.Tensor, cache) -> torch.Tensor:
        # Generated tokens are text: no visual input (nor DeepStack) touches a decode step.
        lm = self._language_model()
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        past = cache.get_seq_length()  # a hybrid model's: the attention layers' length
        out = lm(
            inputs_embeds=lm.embed_tokens(ids),
            position_ids=self._step_positions(position_ids).to(self.device),
            attention_mask=torch.ones(1, past + 1, dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return self.lm_head(out.last_hidden_state[:, -1:])[0, -1]

    def _kv_shape(self) -> tuple[int, int, int, torch.dtype]:
        """(layers with KV, kv heads, head dim, dtype) of the decode cache."""
        c = self.hf_config.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_hidden_layers, c.num_key_value_heads, head_dim, self._model_dtype()

    @property
    def kv_bytes_per_token(self) -> int:
        layers, heads, head_dim, dtype = self._kv_shape()
        return 2 * layers * heads * head_dim * dtype.itemsize

    def new_batch_kv(self) -> BatchKv:
        layers, heads, head_dim, dtype = self._kv_shape()
        return BatchKv(layers, heads, head_dim, dtype, self.device)

    @torch.inference_mode()
    def decode_batch(self, token_ids: list[int], position_ids: torch.Tensor, batch: BatchKv) -> torch.Tensor:
        lm = self._language_model()
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        out = lm(
            inputs_embeds=lm.embed_tokens(ids),
            position_ids=self._batch_positions(position_ids).to(self.device),
            attention_mask=batch.attention_mask(),  # [B, max + 1]: each row's own columns
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.advance()
        return self.lm_head(out.last_hidden_state[:, -1])  # [B, vocab]


def _strings_in(value: Any) -> Iterator[str]:
    """Every string of a JSON value (keys too), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _strings_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings_in(item)
