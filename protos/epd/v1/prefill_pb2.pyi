from epd.v1 import common_pb2 as _common_pb2
from epd.v1 import encoder_pb2 as _encoder_pb2
from epd.v1 import messages_pb2 as _messages_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillHeader(_message.Message):
    __slots__ = ("request_id", "visual", "generation", "pruning", "messages", "cache_salt", "kv_handle", "raw_prompt", "template")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VISUAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    visual: _encoder_pb2.EncodeResult
    generation: _common_pb2.GenerationParams
    pruning: _common_pb2.PruningOptions
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.ChatMessage]
    cache_salt: str
    kv_handle: str
    raw_prompt: _messages_pb2.RawPrompt
    template: _messages_pb2.ChatTemplateOptions
    def __init__(self, request_id: _Optional[str] = ..., visual: _Optional[_Union[_encoder_pb2.EncodeResult, _Mapping]] = ..., generation: _Optional[_Union[_common_pb2.GenerationParams, _Mapping]] = ..., pruning: _Optional[_Union[_common_pb2.PruningOptions, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_messages_pb2.ChatMessage, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., kv_handle: _Optional[str] = ..., raw_prompt: _Optional[_Union[_messages_pb2.RawPrompt, _Mapping]] = ..., template: _Optional[_Union[_messages_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("header", "visual_embeds")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VISUAL_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    header: PrefillHeader
    visual_embeds: _common_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[PrefillHeader, _Mapping]] = ..., visual_embeds: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("kv_handle", "kv_address", "first_token_id", "num_prompt_tokens", "num_cached_tokens", "next_position_ids", "kv_num_bytes", "prefill_ms", "num_visual_tokens_in", "num_visual_tokens_out", "kv_num_bytes_uncompressed", "pruning", "visual_entry_mask", "kept_visual_token_index", "num_reused_prompt_tokens", "first_text", "distinct_prompt_token_ids", "max_new_tokens", "first_logprob", "other_choices", "prompt_ends_reasoning", "prompt_token_ids", "num_stored_prompt_tokens")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_IN_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_OUT_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BYTES_UNCOMPRESSED_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    VISUAL_ENTRY_MASK_FIELD_NUMBER: _ClassVar[int]
    KEPT_VISUAL_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    OTHER_CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ENDS_REASONING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    kv_address: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    next_position_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_num_bytes: int
    prefill_ms: float
    num_visual_tokens_in: int
    num_visual_tokens_out: int
    kv_num_bytes_uncompressed: int
    pruning: _common_pb2.PruningReport
    visual_entry_mask: bytes
    kept_visual_token_index: _containers.RepeatedScalarFieldContainer[int]
    num_reused_prompt_tokens: int
    first_text: str
    distinct_prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    first_logprob: _common_pb2.TokenLogprob
    other_choices: _containers.RepeatedCompositeFieldContainer[ChoiceStart]
    prompt_ends_reasoning: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_stored_prompt_tokens: int
    def __init__(self, kv_handle: _Optional[str] = ..., kv_address: _Optional[str] = ..., first_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., next_position_ids: _Optional[_Iterable[int]] = ..., kv_num_bytes: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., num_visual_tokens_in: _Optional[int] = ..., num_visual_tokens_out: _Optional[int] = ..., kv_num_bytes_uncompressed: _Optional[int] = ..., pruning: _Optional[_Union[_common_pb2.PruningReport, _Mapping]] = ..., visual_entry_mask: _Optional[bytes] = ..., kept_visual_token_index: _Optional[_Iterable[int]] = ..., num_reused_prompt_tokens: _Optional[int] = ..., first_text: _Optional[str] = ..., distinct_prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., other_choices: _Optional[_Iterable[_Union[ChoiceStart, _Mapping]]] = ..., prompt_ends_reasoning: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_stored_prompt_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("prompt_logprobs", "result")
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    prompt_logprobs: _common_pb2.PromptLogprobs
    result: PrefillResult
    def __init__(self, prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., result: _Optional[_Union[PrefillResult, _Mapping]] = ...) -> None: ...

class ChoiceStart(_message.Message):
    __slots__ = ("first_token_id", "first_text", "first_logprob")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_text: str
    first_logprob: _common_pb2.TokenLogprob
    def __init__(self, first_token_id: _Optional[int] = ..., first_text: _Optional[str] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("kv_handle", "keep_until_confirmed")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEEP_UNTIL_CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    keep_until_confirmed: bool
    def __init__(self, kv_handle: _Optional[str] = ..., keep_until_confirmed: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _common_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("kv_handle", "request_id", "received")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    request_id: str
    received: bool
    def __init__(self, kv_handle: _Optional[str] = ..., request_id: _Optional[str] = ..., received: _Optional[bool] = ...) -> None: ...

class ReleaseKvResult(_message.Message):
    __slots__ = ("released", "num_kv_caches_held", "kv_bytes_held")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CACHES_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    released: bool
    num_kv_caches_held: int
    kv_bytes_held: int
    def __init__(self, released: _Optional[bool] = ..., num_kv_caches_held: _Optional[int] = ..., kv_bytes_held: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("vocab_size", "context_tokens", "max_prompt_tokens", "max_new_tokens", "model_type", "max_logprobs", "reasoning_markers", "trust_request_chat_template", "scheduling_policy", "reasoning_marker_ids", "generation_defaults")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_MARKERS_FIELD_NUMBER: _ClassVar[int]
    TRUST_REQUEST_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    REASONING_MARKER_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    context_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    model_type: str
    max_logprobs: int
    reasoning_markers: _containers.RepeatedScalarFieldContainer[str]
    trust_request_chat_template: bool
    scheduling_policy: str
    reasoning_marker_ids: _containers.RepeatedScalarFieldContainer[int]
    generation_defaults: GenerationDefaults
    def __init__(self, vocab_size: _Optional[int] = ..., context_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., model_type: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., reasoning_markers: _Optional[_Iterable[str]] = ..., trust_request_chat_template: _Optional[bool] = ..., scheduling_policy: _Optional[str] = ..., reasoning_marker_ids: _Optional[_Iterable[int]] = ..., generation_defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    repetition_penalty: float
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    max_new_tokens: int
    def __init__(self, repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "add_special_tokens", "return_token_strs", "template")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.ChatMessage]
    add_special_tokens: bool
    return_token_strs: bool
    template: _messages_pb2.ChatTemplateOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_messages_pb2.ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ..., template: _Optional[_Union[_messages_pb2.ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class TokenizeResult(_message.Message):
    __slots__ = ("token_ids", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResult(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class CompileStructuredOutputsRequest(_message.Message):
    __slots__ = ("request_id", "structured_outputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    structured_outputs: _common_pb2.StructuredOutputs
    def __init__(self, request_id: _Optional[str] = ..., structured_outputs: _Optional[_Union[_common_pb2.StructuredOutputs, _Mapping]] = ...) -> None: ...

class CompileStructuredOutputsResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
