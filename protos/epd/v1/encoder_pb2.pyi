from epd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeHeader(_message.Message):
    __slots__ = ("request_id", "media_num_bytes", "sampling", "pruning", "media_sha256", "cache_salt", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    MEDIA_SHA256_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    media_num_bytes: int
    sampling: _common_pb2.VideoSampling
    pruning: _common_pb2.PruningOptions
    media_sha256: str
    cache_salt: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., media_num_bytes: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.VideoSampling, _Mapping]] = ..., pruning: _Optional[_Union[_common_pb2.PruningOptions, _Mapping]] = ..., media_sha256: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("header", "media_chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: EncodeHeader
    media_chunk: bytes
    def __init__(self, header: _Optional[_Union[EncodeHeader, _Mapping]] = ..., media_chunk: _Optional[bytes] = ...) -> None: ...

class EncodeResult(_message.Message):
    __slots__ = ("modality", "grid_thw", "num_visual_tokens", "num_frames", "frame_timestamps_s", "second_per_grid_t", "decode_ms", "encode_ms", "cache_hit", "media_sha256", "kept_token_index", "key_token_index", "pruning", "num_deepstack_features", "group_timestamps_s")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_VISUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FRAME_TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_SHA256_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_FEATURES_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    modality: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_visual_tokens: int
    num_frames: int
    frame_timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    second_per_grid_t: float
    decode_ms: float
    encode_ms: float
    cache_hit: bool
    media_sha256: str
    kept_token_index: _containers.RepeatedScalarFieldContainer[int]
    key_token_index: _containers.RepeatedScalarFieldContainer[int]
    pruning: _common_pb2.PruningReport
    num_deepstack_features: int
    group_timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, modality: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_visual_tokens: _Optional[int] = ..., num_frames: _Optional[int] = ..., frame_timestamps_s: _Optional[_Iterable[float]] = ..., second_per_grid_t: _Optional[float] = ..., decode_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., cache_hit: _Optional[bool] = ..., media_sha256: _Optional[str] = ..., kept_token_index: _Optional[_Iterable[int]] = ..., key_token_index: _Optional[_Iterable[int]] = ..., pruning: _Optional[_Union[_common_pb2.PruningReport, _Mapping]] = ..., num_deepstack_features: _Optional[int] = ..., group_timestamps_s: _Optional[_Iterable[float]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("event", "embeddings", "result")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.StageEvent
    embeddings: _common_pb2.TensorChunk
    result: EncodeResult
    def __init__(self, event: _Optional[_Union[_common_pb2.StageEvent, _Mapping]] = ..., embeddings: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., result: _Optional[_Union[EncodeResult, _Mapping]] = ...) -> None: ...
