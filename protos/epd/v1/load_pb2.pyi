from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("stage", "num_running", "num_waiting", "last_batch_size", "num_steps", "queue_wait_s_total", "num_preemptions", "memory_used_bytes", "memory_total_bytes", "prefix_cache_hits", "prefix_cache_misses", "prefix_cache_evictions", "prefix_cache_entries", "prefix_cache_bytes", "kv_store_caches", "kv_store_used_bytes", "kv_store_total_bytes", "kv_store_expired", "kv_store_released", "kv_store_refused", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "num_requests", "decord_fallbacks")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CACHES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECORD_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    num_running: int
    num_waiting: int
    last_batch_size: int
    num_steps: int
    queue_wait_s_total: float
    num_preemptions: int
    memory_used_bytes: int
    memory_total_bytes: int
    prefix_cache_hits: int
    prefix_cache_misses: int
    prefix_cache_evictions: int
    prefix_cache_entries: int
    prefix_cache_bytes: int
    kv_store_caches: int
    kv_store_used_bytes: int
    kv_store_total_bytes: int
    kv_store_expired: int
    kv_store_released: int
    kv_store_refused: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_requests: int
    decord_fallbacks: int
    def __init__(self, stage: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., last_batch_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., queue_wait_s_total: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_misses: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., kv_store_caches: _Optional[int] = ..., kv_store_used_bytes: _Optional[int] = ..., kv_store_total_bytes: _Optional[int] = ..., kv_store_expired: _Optional[int] = ..., kv_store_released: _Optional[int] = ..., kv_store_refused: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_requests: _Optional[int] = ..., decord_fallbacks: _Optional[int] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("cores",)
    CORES_FIELD_NUMBER: _ClassVar[int]
    cores: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    def __init__(self, cores: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ...) -> None: ...
