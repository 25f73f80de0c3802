from epd.v1 import common_pb2 as _common_pb2
from epd.v1 import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prefill", "generation", "pruning")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: _prefill_pb2.PrefillResult
    generation: _common_pb2.GenerationParams
    pruning: _common_pb2.PruningOptions
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[_prefill_pb2.PrefillResult, _Mapping]] = ..., generation: _Optional[_Union[_common_pb2.GenerationParams, _Mapping]] = ..., pruning: _Optional[_Union[_common_pb2.PruningOptions, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "kv_transfer_ms", "kv_num_bytes", "decode_evict", "stop_string", "stop_token_id", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_EVICT_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    kv_transfer_ms: float
    kv_num_bytes: int
    decode_evict: _common_pb2.PruningStageCount
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., kv_transfer_ms: _Optional[float] = ..., kv_num_bytes: _Optional[int] = ..., decode_evict: _Optional[_Union[_common_pb2.PruningStageCount, _Mapping]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
