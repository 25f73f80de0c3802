from epd.v1 import common_pb2 as _common_pb2
from epd.v1 import messages_pb2 as _messages_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GatewayServiceTokenizeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "add_special_tokens", "template", "return_token_strs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.ChatMessage]
    add_special_tokens: bool
    template: _messages_pb2.ChatTemplateOptions
    return_token_strs: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_messages_pb2.ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., template: _Optional[_Union[_messages_pb2.ChatTemplateOptions, _Mapping]] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class GatewayServiceTokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "num_tokens", "max_model_len", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class GatewayServiceDetokenizeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GatewayServiceDetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class AskHeader(_message.Message):
    __slots__ = ("request_id", "question", "media_num_bytes", "media_sha256", "sampling", "generation", "pruning", "messages", "cache_salt", "prompt", "template")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    MEDIA_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_SHA256_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    question: str
    media_num_bytes: int
    media_sha256: str
    sampling: _common_pb2.VideoSampling
    generation: _common_pb2.GenerationParams
    pruning: _common_pb2.PruningOptions
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.ChatMessage]
    cache_salt: str
    prompt: _messages_pb2.RawPrompt
    template: _messages_pb2.ChatTemplateOptions
    def __init__(self, request_id: _Optional[str] = ..., question: _Optional[str] = ..., media_num_bytes: _Optional[int] = ..., media_sha256: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.VideoSampling, _Mapping]] = ..., generation: _Optional[_Union[_common_pb2.GenerationParams, _Mapping]] = ..., pruning: _Optional[_Union[_common_pb2.PruningOptions, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_messages_pb2.ChatMessage, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., prompt: _Optional[_Union[_messages_pb2.RawPrompt, _Mapping]] = ..., template: _Optional[_Union[_messages_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class AskRequest(_message.Message):
    __slots__ = ("header", "media_chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: AskHeader
    media_chunk: bytes
    def __init__(self, header: _Optional[_Union[AskHeader, _Mapping]] = ..., media_chunk: _Optional[bytes] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AskSummary(_message.Message):
    __slots__ = ("request_id", "answer", "token_ids", "finish_reason", "num_frames", "num_visual_tokens", "num_prompt_tokens", "timings_ms", "kv_num_bytes", "encoder_cache_hit", "media_sha256", "frame_timestamps_s", "pruning", "grid_thw", "kept_visual_token_index", "num_reused_prompt_tokens", "stop_string", "stop_token_id", "logprobs", "prompt_token_ids")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_SHA256_FIELD_NUMBER: _ClassVar[int]
    FRAME_TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    KEPT_VISUAL_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    answer: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_frames: int
    num_visual_tokens: int
    num_prompt_tokens: int
    timings_ms: _containers.ScalarMap[str, float]
    kv_num_bytes: int
    encoder_cache_hit: bool
    media_sha256: str
    frame_timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    pruning: _common_pb2.PruningReport
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    kept_visual_token_index: _containers.RepeatedScalarFieldContainer[int]
    num_reused_prompt_tokens: int
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., answer: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_frames: _Optional[int] = ..., num_visual_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., kv_num_bytes: _Optional[int] = ..., encoder_cache_hit: _Optional[bool] = ..., media_sha256: _Optional[str] = ..., frame_timestamps_s: _Optional[_Iterable[float]] = ..., pruning: _Optional[_Union[_common_pb2.PruningReport, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., kept_visual_token_index: _Optional[_Iterable[int]] = ..., num_reused_prompt_tokens: _Optional[int] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AskResponse(_message.Message):
    __slots__ = ("event", "delta", "summary", "prompt_logprobs")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.StageEvent
    delta: TokenDelta
    summary: AskSummary
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, event: _Optional[_Union[_common_pb2.StageEvent, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., summary: _Optional[_Union[AskSummary, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...
