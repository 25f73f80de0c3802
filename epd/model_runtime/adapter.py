"""The contract between the serving stages and a vision-language model family.

A new family (LLaVA-OneVision, SmolVLM2, ...) is one file that implements `VLMAdapter`. The stages
call only these methods:

    encoder:  preprocess(frames, clip_num_frames) -> VisionInputs (a frame group, sized as its clip)
              encode(VisionInputs) -> visual embeds;
              frame_resizer(clip_num_frames) -> what the decoder may apply to each frame of a clip
                  of that many frames (None: keep them as decoded)
              encode_batch([VisionInputs]) -> [visual embeds] (one tower call for many)
              encode_features(VisionInputs) -> VisualFeatures (embeds + DeepStack features, Qwen3-VL)
              encode_features_batch([VisionInputs]) -> [VisualFeatures] (what the encoder core runs)
    prefill:  build_prompt(conversation, VisualMeta) -> Prompt;  prefill(Prompt, embeds) -> PrefillState
              prefill_chunks([PrefillChunk]) -> [ChunkResult] (several prompts / chunks in one step)
              prefill_features(Prompt, VisualFeatures) -> PrefillState (what every family accepts)
    decode:   decode_step(token_id, position_ids, cache) -> logits  (one request)
              decode_batch(token_ids, position_ids, BatchKv) -> logits  (every running request)

The pruning stages (docs/architecture.md, "Model interface") call these, and never a model's
modules (tests/unit/test_model_boundary.py checks it); a family that cannot run one leaves the
default, which raises `UnsupportedByFamily` (a ValueError: the request gets INVALID_ARGUMENT
naming the family and the stage):

    sizes:    text_dims -> TextDims (layers, hidden, heads, KV heads, head_dim);  num_layers
    encoder:  encode_sparse(patches, grid, positions, cu_seqlens) (temporal drop before the tower)
    prefill:  embed(input_ids) -> [1, L, hidden];  logits(final hidden) -> [..., vocab]
              layerwise_prefill(embeds, position_ids) -> LayerwisePass: run_layers(a, b),
                  layer_queries(layer, query_index) -> (q, k), keep(index), finish() -> (hidden, cache)
              capture_queries(layers, query_index) -> with-block yielding CapturedQueries
              chunk_cache_to_kv(cache) -> KvCache (the pass's cache as it crosses to decode)
    decode:   capture_queries (around decode_step);  decode_cache_kv(cache) -> [(keys, values)];
              set_decode_cache_kv(cache, layer, keys, values) (eviction)

Everything crossing a stage boundary is a plain tensor or a small dataclass, so it can be sent
over gRPC as dtype + shape + bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd.video.types import DecodedVideo, FrameResize

if TYPE_CHECKING:  # VisualMeta is read by the gateway, which starts without torch
    import torch

    from epd.model_runtime.batch_kv import BatchKv
    from epd.model_runtime.kv_cache import KvCache
    from epd.model_runtime.logprobs import PromptLogprobRows


@dataclass
class VisionInputs:
    """Preprocessed pixels of one video or image."""

    modality: str  # "video" or "image"
    pixel_values: torch.Tensor  # [num_patches, C * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    second_per_grid_t: float  # seconds of video per temporal patch group (0 for images)
    group_timestamps_s: tuple[float, ...] = ()
    """Time of each temporal patch group as the prompt states it (Qwen3-VL writes `<t seconds>`
    before each group); empty for images and for families that do not write times."""


@dataclass
class VisualFeatures:
    """What the vision tower hands to prefill: the visual token embeddings and, for families with
    DeepStack (Qwen3-VL), the features of several tower layers that the language model adds to its
    first layers' hidden states at the same visual positions (row i of each = token i)."""

    embeds: torch.Tensor  # [num_visual_tokens, hidden_size]
    deepstack: list[torch.Tensor] | None = None  # one [num_visual_tokens, hidden_size] per DeepStack layer


@dataclass(frozen=True)
class VisualMeta:
    """What prefill must know about visual tokens besides their embeddings."""

    modality: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    num_visual_tokens: int
    group_timestamps_s: tuple[float, ...] = ()
    """`VisionInputs.group_timestamps_s` (Qwen3-VL's prompt text); empty: derived from
    `second_per_grid_t` as evenly spaced frames from 0 s."""


@dataclass(frozen=True)
class RenderOptions:
    """How a family renders a conversation with its chat template: transformers'
    `apply_chat_template(conversation, chat_template=..., add_generation_prompt=...,
    continue_final_message=..., **variables)`. The stages build it from a request's
    `ChatTemplateOptions` (`ChatTemplateOptions.render_options`); the defaults are a new assistant
    answer with the model's own template and no extra variables."""

    add_generation_prompt: bool = True
    """End with the template's opening of the assistant's answer."""
    continue_final_message: bool = False
    """Leave the last message open, without the template's end of its turn, for the model to continue."""
    variables: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Extra template variables: a request's `chat_template_kwargs` and its `tools` (as
    `apply_chat_template(..., tools=...)` takes them); those the template does not read are dropped
    where it renders (vLLM's `resolve_chat_template_kwargs`)."""
    chat_template: str | None = None
    """A template to render with instead of the model's own (vLLM's --chat-template or a
    request's, already resolved); None: the processor's own."""
    requests_template: bool = False
    """`chat_template` is the request's own: its failures are the client's (INVALID_ARGUMENT).
    False: the operator's (--chat-template, or the model's own), whose failures are the server's
    (INTERNAL, its details in the log); a template's `raise_exception` refuses the conversation
    whoever wrote it (`HfTextAdapter._render`)."""
    checkpoint: Callable[[], None] | None = field(default=None, compare=False)
    """Called between a prompt's render steps (after the chat template, and after the placeholder
    expansion and tokenisation, before the positions): it raises to stop a render whose request
    was cancelled or ran out of time, the exception leaving `build_prompt` as it is (prefill's
    tokenizer threads, `LocalPrefillStage.prefill`). A step in progress, a chat template's render
    above all, runs to its end: Python cannot stop a thread. None: never stopped."""

    def between_steps(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint()


@dataclass
class Prompt:
    """A tokenised, chat-templated prompt with the visual placeholders expanded."""

    input_ids: torch.Tensor  # [1, L] int64
    position_ids: torch.Tensor  # [4, 1, L] int64: row 0 text positions, rows 1-3 M-RoPE (t, h, w)
    visual_mask: torch.Tensor  # [L] bool, True at visual placeholder positions

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class PrefillState:
    """The output of prefill: the cache, the logits of the last position, the next positions."""

    cache: KvCache
    last_logits: torch.Tensor  # [vocab] float
    next_position_ids: torch.Tensor  # [4] int64: positions of the first generated token
    num_prompt_tokens: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class PrefillChunk:
    """One row of a prefill step: tokens [start, end) of `prompt` (a whole prompt: 0, num_tokens)."""

    prompt: Prompt
    visual_embeds: torch.Tensor  # [num_visual, hidden]: the whole prompt's, in placeholder order
    start: int
    end: int
    cache: Any = None
    """The adapter's cache of tokens [0, start) from the row's earlier chunks; None when start == 0."""
    deepstack: list[torch.Tensor] | None = None
    """DeepStack features (Qwen3-VL), each like `visual_embeds`, row for row; None for families
    without DeepStack. A chunk adds the rows of its own visual positions."""
    prompt_logprobs: int | None = None
    """vLLM's `prompt_logprobs` k: also compute, for each position of the chunk that has a next
    prompt token, that token's log-probability, rank and the k most likely (None: not asked, and
    only the last position's logits are computed). Only where `supports_prompt_logprobs`."""


@dataclass
class ChunkResult:
    cache: Any  # the adapter's cache of tokens [0, end) (the row's `cache`, extended in place)
    last_logits: torch.Tensor  # [vocab] float: logits after token end - 1
    prompt_logprobs: PromptLogprobRows | None = None
    """The chunk's prompt logprobs when its row asked (`PrefillChunk.prompt_logprobs`)."""


# -- pruning interface: types -----------------------------------------------------------------


class UnsupportedByFamily(NotImplementedError, ValueError):
    """A family cannot run an operation (most often a pruning stage). A ValueError too, so the
    stages answer it as a bad request (INVALID_ARGUMENT) whose message names family and stage."""


@dataclass(frozen=True)
class TextDims:
    """The language model's sizes, as the pruning stages need them (budgets, FLOPs, masks)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int


@dataclass
class CapturedQueries:
    """Filled by `VLMAdapter.capture_queries` during the forward passes inside its `with` block:
    per decoder layer, the rotated queries of the chosen tokens and the rotated keys of all
    tokens, exactly as that layer's attention computes them (projection, per-head norm where the
    family has one, RoPE with the call's positions)."""

    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, heads, Q, head_dim]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, kv_heads, n, head_dim]


class LayerwisePass(ABC):
    """One prompt (batch 1) going through the decoder a segment of layers at a time, so that a
    pruning stage can score tokens at a layer's input and drop them before the next layer (the
    prefill drop). Positions are fixed when the pass starts; `keep` gathers them with the
    tokens, so a survivor keeps its original position and nothing is recomputed."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Tokens present now (the prompt's length, less every `keep` so far)."""

    @abstractmethod
    def run_layers(self, start: int, stop: int) -> None:
        """Decoder layers [start, stop) over the present tokens, appending to their cache."""

    @abstractmethod
    def layer_queries(self, layer: int, query_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `layer`'s attention would compute from the present hidden states (that layer not
        run yet): rotated queries [1, heads, Q, D] of tokens `query_index` and rotated keys
        [1, kv_heads, n, D] of all n present tokens."""

    @abstractmethod
    def keep(self, index: torch.Tensor) -> None:
        """Keep only present tokens `index` ([n'] long, increasing): hidden states, positions and
        the cache entries of every layer run so far."""

    @abstractmethod
    def finish(self) -> tuple[torch.Tensor, Any]:
        """After the last layer: the final-normed hidden states [1, n, hidden] (`logits` takes
        them) and the family's cache object of every layer (`chunk_cache_to_kv` turns it into
        the `KvCache` that crosses to decode)."""


class VLMAdapter(ABC):
    """One model family's implementation of the stage operations. Not thread-safe: one model
    call at a time (the services run model calls on a single executor thread)."""

    eos_token_id: int | None = None
    """The tokenizer's end-of-sequence id: an answer it ends has `stop_reason` None (vLLM's)."""
    eos_token_ids: frozenset[int]
    """Every id that ends an answer (`hf_loading.end_of_sequence`): `eos_token_id` and the
    generation config's others, which end it as stop tokens (their id its `stop_reason`)."""
    hidden_size: int
    family: str = ""  # config.json's model_type ("qwen2_vl", "qwen3_vl", ...); part of the token cache key
    fingerprint: str  # identity of the loaded checkpoint, part of the token cache key
    supports_sparse_vision: bool = False  # the tower can run on a subset of patches
    num_deepstack_layers: int = 0  # len(VisualFeatures.deepstack) the language model expects

    @property
    def context_tokens(self) -> int | None:
        """Prompt plus generated tokens at most (the checkpoint's max_position_embeddings, vLLM's
        default max_model_len); None: not known."""
        return None

    @property
    def vocab_size(self) -> int | None:
        """Rows of the lm head's logits [vocab]: the token ids a request may name (logit_bias,
        stop_token_ids); None: not known."""
        return None

    def encode_sparse(
        self,
        pixel_values: torch.Tensor,
        grid_thw: tuple[int, int, int],
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> torch.Tensor:
        """The tower on kept patches only (temporal dropping before the tower)."""
        raise NotImplementedError(f"{type(self).__name__} cannot encode a subset of patches")

    def frame_resizer(self, clip_num_frames: int) -> FrameResize | None:
        """What the video decoder applies to each frame of a clip of `clip_num_frames` frames as it
        decodes it ([H, W, 3] -> [h, w, 3] uint8), so that the encoder holds a request's frames at
        the model's size instead of the source's (a 4K frame is 24 MiB, the tower may see 0.1 MiB
        of it). Only where `preprocess(resized, clip_num_frames)` equals `preprocess(decoded,
        clip_num_frames)` bit for bit (the tokens then stay `generate()`'s on the decoded frames).
        None, the default: frames are kept as decoded."""
        return None

    @abstractmethod
    def preprocess(self, video: DecodedVideo, clip_num_frames: int | None = None) -> VisionInputs:
        """Frames -> normalised patches, exactly as the model's own processor prepares them.
        Touches no weights: the encoder runs it on its request driver threads, several at once
        and beside model calls.

        `video` may be one frame group of a longer clip (the encoder preprocesses groups as they
        decode; every group but the last holds a whole number of temporal patches):
        `clip_num_frames` is then the clip's total frame count, and the group's patches must be
        the rows of the processor's output on the whole clip. A family whose resize depends on
        the frame count (Qwen3-VL bounds t x h x w) sizes every group as the whole clip; a
        family that resizes frame by frame ignores it. None: `video` is the whole clip."""

    @abstractmethod
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        """Patches -> visual token embeddings [num_visual_tokens, hidden_size]."""

    def encode_features(self, inputs: VisionInputs) -> VisualFeatures:
        """Everything the tower hands to prefill. Families without DeepStack: `encode`'s embeddings."""
        return VisualFeatures(self.encode(inputs))

    def encode_features_batch(self, inputs: list[VisionInputs]) -> list[VisualFeatures]:
        """`encode_features` of several images/frame groups (of any requests), each equal to its
        `encode_features` alone up to float rounding: what the encoder core runs per step. The
        default: `encode_batch` for families without DeepStack (one tower call when the family
        batches), else `encode_features` one by one."""
        if not self.num_deepstack_layers:
            return [VisualFeatures(e) for e in self.encode_batch(inputs)]
        return [self.encode_features(i) for i in inputs]

    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """`encode` of several images/frame groups (of any requests) -> each one's embeddings,
        equal to its `encode` alone up to float rounding. A family whose tower takes several
        images in one call overrides this; the default encodes them one by one."""
        return [self.encode(i) for i in inputs]

    @abstractmethod
    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """How many visual tokens (prompt placeholders) a grid yields."""

    @abstractmethod
    def build_prompt(
        self,
        conversation: list[dict[str, Any]],
        visual: VisualMeta | None,
        options: RenderOptions = RenderOptions(),
    ) -> Prompt:
        """Render `conversation` exactly as the family's `processor.apply_chat_template(conversation,
        chat_template=..., add_generation_prompt=..., continue_final_message=..., **variables)`
        renders it with `options` (`RenderOptions`: the defaults a new assistant answer;
        `continue_final_message` the last message left open, for the model to continue;
        `variables` extra template variables, those the template does not read dropped, the
        request's `tools` among them; `chat_template` a template to render with instead of the
        model's own), expand its one media placeholder to the visual tokens, compute the position
        ids `generate()` would use.

        conversation: the processor's chat form, [{"role": "system" | "user" | "assistant" | "tool",
        "content": [{"type": "text", "text": ...} | {"type": visual.modality}, ...], an assistant's
        "tool_calls" and a tool's "tool_call_id" as transformers takes them}], parts in the
        user's order, exactly one media part (`epd.stages.messages.to_chat_template` makes it), or
        none when `visual` is None: the text alone, its visual mask all False, positions those
        generate() gives a prompt without media.
        Raises ValueError when a text part holds the model's own placeholder tokens, when the
        template cannot leave the last message open, or when a given `chat_template` fails to
        render."""

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """A text's token ids, as the model's tokenizer gives them (the HTTP API's /tokenize)."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its tokenizer")

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as this model's token sequences (`tokenize_bad_words`), tokenised
        without special tokens; ValueError naming a word that gives no token."""
        from epd.model_runtime.bad_words import tokenize_bad_words

        return tokenize_bad_words(words, lambda text: self.tokenize(text, False), self.vocab_size)

    def tokenize_conversation(
        self,
        conversation: list[dict[str, Any]],
        add_special_tokens: bool,
        options: RenderOptions = RenderOptions(),
    ) -> list[int]:
        """A conversation without media (`build_prompt`'s form) rendered with the model's chat
        template as `options` say and tokenised; with `options.add_generation_prompt` and without
        special tokens, exactly `build_prompt(conversation, None, options).input_ids`; with
        `options.continue_final_message`, its last message left open (transformers'
        `apply_chat_template` option). ValueError as `build_prompt`'s, or when the template cannot
        leave the last message open."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its chat template")

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token in the vocabulary (the tokenizer's `convert_ids_to_tokens`: "Ġred", not " red")."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its tokenizer")

    def decode_tokens(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept (/detokenize; answers use `detokenize`)."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its tokenizer")

    def single_tokens(self, texts: Sequence[str]) -> dict[str, int]:
        """Those of `texts` that are one token of the vocabulary (added tokens included), in their
        order, with their token ids: as vLLM's reasoning parsers look their markers up. None of
        them for a family that exposes no tokenizer."""
        return {}

    def settle_tokenizer(self) -> None:
        """Leave the tokenizer in the state every call of this adapter asks of it, so that no later
        call changes it: `build_prompt`, `build_raw_prompt`, `tokenize`, `tokenize_conversation`,
        `token_strings` and `decode_tokens` may then run on several threads at once (prefill's
        tokenizer threads, which render prompts and answer /tokenize), with the one tokenizer
        (call before those threads start).
        This family exposes no tokenizer: nothing to settle."""
        return None

    def build_raw_prompt(self, text: str, token_ids: Sequence[int] = ()) -> Prompt:
        """A prompt run as it is, with no chat template (`epd.stages.raw_prompt`): `text` tokenised
        as the family's `tokenizer(text)` tokenises it by default, or `token_ids`; no visual token
        (ValueError for the model's placeholder), the positions generate() gives text."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not run raw prompts; use chat completions")

    @abstractmethod
    def prefill(self, prompt: Prompt, visual_embeds: torch.Tensor) -> PrefillState:
        """Run the language model over the prompt with `visual_embeds` [num_visual, hidden] in the
        placeholders; returns the KV cache and the last position's logits."""

    def prefill_features(self, prompt: Prompt, features: VisualFeatures) -> PrefillState:
        """`prefill` with everything `encode_features` produced. Families without DeepStack refuse
        DeepStack features rather than drop them."""
        if features.deepstack:
            raise ValueError(f"{type(self).__name__} has no DeepStack layers; it takes no DeepStack features")
        return self.prefill(prompt, features.embeds)

    # Batched and chunked prefill (the prefill core, `epd.prefill_svc.runner`): several prompts in
    # one forward, a long one over several steps. A family that cannot leaves these as they are:
    # its prompts then run whole and one at a time through `prefill`.

    supports_chunked_prefill: bool = False  # prefill_chunks takes rows with start > 0 or end < num_tokens
    supports_prompt_logprobs: bool = False  # prefill_chunks computes a row's `prompt_logprobs`

    def prefill_chunks(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Tokens [start, end) of each row's prompt, after the row's `cache` of tokens [0, start);
        returns each row's cache of tokens [0, end) and the logits of token end - 1, equal to
        prefilling the row alone up to float rounding. The default runs whole prompts one by one."""
        out = []
        for row in rows:
            if row.start != 0 or row.end != row.prompt.num_tokens:
                raise NotImplementedError(f"{type(self).__name__} cannot prefill a prompt in chunks")
            state = self.prefill(row.prompt, row.visual_embeds)
            out.append(ChunkResult(state.cache, state.last_logits))
        return out

    def chunk_cache_to_kv(self, cache: Any) -> KvCache:
        """A finished row's `ChunkResult.cache` as the cache that crosses to decode."""
        return cache

    @abstractmethod
    def new_decode_cache(self, cache: KvCache):
        """Turn a transferred cache into the structure `decode_step` extends in place."""

    @abstractmethod
    def decode_step(self, token_id: int, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """One token in ([4] positions), logits [vocab] out; `cache` grows by one position."""

    # Batched decoding (the decode core, `epd.decode_svc.runner`): one forward for every running
    # request. A family that cannot batch leaves `supports_batched_decode` False and these
    # unimplemented: the core then steps each of its requests alone (`decode_step`).
    supports_batched_decode: bool = False

    # Token dropping / KV compression: the stages (`epd.stages.contracts.PRUNING_STAGES` names) this
    # family runs; the others are refused with INVALID_ARGUMENT naming stage and family, before any
    # work (`refuse_unsupported_pruning`). `pruning_refusal_reason` says why, for the message.
    supported_pruning: frozenset[str] = frozenset()
    pruning_refusal_reason: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token adds to the cache, in the model's dtype."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its KV cache")

    @property
    def decode_state_bytes(self) -> int:
        """Bytes of decoding state a request holds whatever its length (a hybrid model's
        linear-attention states); 0 for attention-only families."""
        return 0

    def new_batch_kv(self) -> BatchKv:
        """An empty batch cache (`epd.model_runtime.batch_kv.BatchKv`) shaped for this model."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode requests in a batch")

    def decode_batch(self, token_ids: list[int], position_ids: torch.Tensor, batch: BatchKv) -> torch.Tensor:
        """One token for each of the B rows of `batch` in one forward pass: `token_ids` [B],
        `position_ids` [4, B]; returns logits [B, vocab] and grows every row by one."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode requests in a batch")

    @abstractmethod
    def detokenize(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of generated tokens: `tokenizer.decode(token_ids, skip_special_tokens=...,
        spaces_between_special_tokens=...)` (vLLM's request options; the defaults skip special tokens)."""

    def token_text(self, token_id: int) -> str:
        """One id decoded alone, special tokens kept: a token's text in logprobs, as vLLM shows it
        (`epd.model_runtime.logprobs`). A family without `decode_tokens` gives its answer text."""
        try:
            return self.decode_tokens([token_id])
        except UnsupportedByFamily:
            return self.detokenize([token_id])

    # -- pruning interface ---------------------------------------------------------------------
    # What the pruning stages (`epd.token_pruning`, `epd.prefill_svc.pruned_prefill`,
    # `epd.decode_svc.eviction`) call; they never touch the model's modules themselves. A family
    # that cannot run one leaves it as it is: the stage is refused with `UnsupportedByFamily`.

    @property
    def text_dims(self) -> TextDims:
        """The language model's sizes."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not describe its language model's sizes")

    @property
    def num_layers(self) -> int:
        """Decoder layers of the language model."""
        return self.text_dims.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [1, L, hidden] of input_ids [1, L] (on the model's device)."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its token embeddings")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm head on final-normed hidden states [..., hidden] -> [..., vocab]."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its lm head")

    def layerwise_prefill(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> LayerwisePass:
        """Start a prefill that the caller runs a segment of layers at a time (`LayerwisePass`).
        inputs_embeds [1, L, hidden] with the visual embeddings in place (`embed`);
        position_ids as `Prompt.position_ids` (or gathered from it), on the model's device."""
        raise UnsupportedByFamily(
            f"{type(self).__name__} cannot run its decoder layer by layer: no prefill drop or KV compression"
        )

    def capture_queries(
        self, layers: Iterable[int], query_index: torch.Tensor
    ) -> AbstractContextManager[CapturedQueries]:
        """Context manager: while it is open, every forward pass through decoder layer i in
        `layers` (a `decode_step`, a `LayerwisePass.run_layers`) records that layer's rotated
        queries of tokens `query_index` and keys of all its tokens in the yielded
        `CapturedQueries` (a later pass overwrites). Nothing is L x L."""
        raise UnsupportedByFamily(f"{type(self).__name__} cannot capture its attention queries")

    def decode_cache_kv(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) [1, kv_heads, n, D] per layer of a `new_decode_cache` cache."""
        raise UnsupportedByFamily(f"{type(self).__name__} does not expose its decode cache")

    def set_decode_cache_kv(self, cache: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace one layer's entries of a decode cache (eviction: fewer entries)."""
        raise UnsupportedByFamily(f"{type(self).__name__} cannot evict from its decode cache")

    @property
    def num_parameters(self) -> int:
        """Parameters of the loaded parts (benchmarks print it)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its parameters")
