"""What a pipeline run takes and yields: the request (`AskRequest`), the events it streams
(`PipelineEvent`: stage events, the prompt's logprobs, token steps) and its summary (`AskSummary`,
one `ChoiceSummary` per choice). `epd.gateway.pipeline` runs them; the front doors (the gRPC
servicer, the HTTP API) and `epd ask` build the requests and read what comes back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput, StageEvent, TokenStep
from epd.stages.messages import ChatTemplateOptions, Message
from epd.stages.raw_prompt import RawPrompt
from epd.token_pruning import PruningConfig, PruningStats
from epd.video.types import SamplingOptions


@dataclass
class AskRequest:
    messages: list[Message]
    """The conversation (`epd.stages.messages`), parts in the user's order, at most one media
    part; `question_messages(q)` is 0.1's single question, [media, q]."""
    media: MediaInput | None = None
    """The media of the messages' media part; None (or nothing in it) when they have none."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    request_id: str = ""
    pruning: PruningConfig = field(default_factory=PruningConfig)
    """Token dropping and KV compression; all off by default (exact tokens)."""
    cache_salt: str = ""
    """The tenant (`epd.transport.auth.tenant_cache_salt`): part of the encoder's token-cache key
    and prefill's prefix-cache key; "" = the shared tenant."""
    raw_prompt: RawPrompt | None = None
    """Instead of `messages` (then []): a prompt run as it is, without the chat template
    (`epd.stages.raw_prompt`; the HTTP API's /v1/completions). It takes no media."""
    template: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)
    """How the chat template ends the prompt of `messages`: a new answer (the default), or the
    assistant's last message left open for the model to continue (vLLM's continue_final_message)."""


@dataclass
class AskSummary:
    request_id: str
    answer: str
    token_ids: list[int]
    finish_reason: str
    num_frames: int
    num_visual_tokens: int
    num_prompt_tokens: int
    timings_ms: dict[str, float]
    """Milliseconds by `epd.stages.names.TIMING_NAMES` (video_decode, encode, ..., ttft, total):
    every name in every answer, 0 for a stage the request did not run (a text-only request's
    video_decode and encode), so that a client reading one answer's keys can read them all."""
    kv_num_bytes: int
    encoder_cache_hit: bool
    media_sha256: str
    frame_timestamps_s: list[float]
    pruning: PruningStats = field(default_factory=PruningStats)
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    kept_visual_token_index: list[int] = field(default_factory=list)
    num_reused_prompt_tokens: int = 0
    """Prompt tokens whose KV prefill took from its prefix cache (earlier turns about the same media)."""
    num_stored_prompt_tokens: int = 0
    """Prompt tokens this request wrote into prefill's prefix cache (`PrefillHandle`'s): the
    Responses API's `cache_write_tokens`."""
    stop_reason: StopReason = None
    """vLLM's: the stop string or stop token id that ended the answer; None when the
    end-of-sequence token or the length limit did (`OutputText.stop_reason`)."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked (`GenerationConfig.logprobs`), else None;
    choice 0's, as `answer` above."""
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    """vLLM's `prompt_logprobs`, when the request asked (`GenerationConfig.prompt_logprobs`): the
    prompt's tokens, each after the first with its log-probability given the tokens before it,
    its rank and the top k there (the first's logprob is NaN: nothing comes before it); else None."""
    prompt_token_ids: list[int] | None = None
    """vLLM's `prompt_token_ids`, when the request asked (`GenerationConfig.return_prompt_token_ids`):
    the prompt's token ids as prefill ran it (`num_prompt_tokens` of them); else None."""
    choices: list[ChoiceSummary] = field(default_factory=list)
    """Every choice of the request (OpenAI's `n`), by index; `answer`, `token_ids`,
    `finish_reason`, `stop_reason` and `logprobs` above are choice 0's. Empty from a summary made
    elsewhere (the SDK's, a test's): `all_choices` gives choice 0 then."""

    def all_choices(self) -> list[ChoiceSummary]:
        return self.choices or [
            ChoiceSummary(0, self.answer, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)
        ]


@dataclass
class ChoiceSummary:
    """One choice's answer (a request asks for n of them, all from one prefill)."""

    index: int
    answer: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: StopReason = None
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked, else None."""


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's logprobs (`AskSummary.prompt_logprobs`, the same list), sent once prefill has
    them, before the answer's first token, for a request that asked (`GenerationConfig.prompt_logprobs`):
    what a streamed legacy completion with `echo` and `logprobs` begins with, as vLLM streams it,
    and what the gRPC Ask stream sends, in pieces (`AskResponse.prompt_logprobs`). Other consumers
    may skip it (the summary has the list too)."""

    prompt_logprobs: Sequence[TokenLogprob]


@dataclass(frozen=True)
class PromptTokenIds:
    """The prompt's token ids (`AskSummary.prompt_token_ids`, the same list), sent once prefill has
    them, before the answer's first token, for a request that asked
    (`GenerationConfig.return_prompt_token_ids`): what a stream's first chunks carry, as vLLM's.
    Other consumers may skip it (the summary has the list too)."""

    prompt_token_ids: list[int]


PipelineEvent = StageEvent | PromptLogprobs | PromptTokenIds | TokenStep | AskSummary
Emit = Callable[[StageEvent | PromptLogprobs | PromptTokenIds | TokenStep], None]
