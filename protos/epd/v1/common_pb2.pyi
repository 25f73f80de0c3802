from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "total_bytes", "offset_bytes", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset_bytes: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class VideoSampling(_message.Message):
    __slots__ = ("fps", "max_frames", "min_frames", "num_frames", "start_time_s", "end_time_s", "max_pixels")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    START_TIME_S_FIELD_NUMBER: _ClassVar[int]
    END_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    min_frames: int
    num_frames: int
    start_time_s: float
    end_time_s: float
    max_pixels: int
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., num_frames: _Optional[int] = ..., start_time_s: _Optional[float] = ..., end_time_s: _Optional[float] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "logit_bias", "stop_token_ids", "include_stop_str_in_output", "fit_max_new_tokens", "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens", "logprobs", "structured_outputs", "n", "prompt_logprobs", "priority", "return_prompt_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FIT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    fit_max_new_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logprobs: int
    structured_outputs: StructuredOutputs
    n: int
    prompt_logprobs: int
    priority: int
    return_prompt_token_ids: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., fit_max_new_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "disable_any_whitespace", "after_reasoning")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_REASONING_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    disable_any_whitespace: bool
    after_reasoning: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., after_reasoning: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PruningOptions(_message.Message):
    __slots__ = ("preset", "knobs")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PRESET_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    preset: str
    knobs: _containers.ScalarMap[str, str]
    def __init__(self, preset: _Optional[str] = ..., knobs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("stage", "state", "at_ms", "duration_ms", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    state: str
    at_ms: float
    duration_ms: float
    details: _containers.ScalarMap[str, str]
    def __init__(self, stage: _Optional[str] = ..., state: _Optional[str] = ..., at_ms: _Optional[float] = ..., duration_ms: _Optional[float] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PruningStageCount(_message.Message):
    __slots__ = ("stage", "num_visual_tokens_in", "num_visual_tokens_out")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_IN_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_OUT_FIELD_NUMBER: _ClassVar[int]
    stage: str
    num_visual_tokens_in: int
    num_visual_tokens_out: int
    def __init__(self, stage: _Optional[str] = ..., num_visual_tokens_in: _Optional[int] = ..., num_visual_tokens_out: _Optional[int] = ...) -> None: ...

class PruningReport(_message.Message):
    __slots__ = ("stages", "num_key_tokens", "prefill_flops_full", "prefill_flops_pruned", "kv_bytes_before", "kv_bytes_after", "transfer_bytes")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FLOPS_FULL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FLOPS_PRUNED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[PruningStageCount]
    num_key_tokens: int
    prefill_flops_full: int
    prefill_flops_pruned: int
    kv_bytes_before: int
    kv_bytes_after: int
    transfer_bytes: int
    def __init__(self, stages: _Optional[_Iterable[_Union[PruningStageCount, _Mapping]]] = ..., num_key_tokens: _Optional[int] = ..., prefill_flops_full: _Optional[int] = ..., prefill_flops_pruned: _Optional[int] = ..., kv_bytes_before: _Optional[int] = ..., kv_bytes_after: _Optional[int] = ..., transfer_bytes: _Optional[int] = ...) -> None: ...
