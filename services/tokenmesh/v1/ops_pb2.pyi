from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CircuitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CIRCUIT_STATE_UNSPECIFIED: _ClassVar[CircuitState]
    CIRCUIT_STATE_CLOSED: _ClassVar[CircuitState]
    CIRCUIT_STATE_HALF_OPEN: _ClassVar[CircuitState]
    CIRCUIT_STATE_OPEN: _ClassVar[CircuitState]
CIRCUIT_STATE_UNSPECIFIED: CircuitState
CIRCUIT_STATE_CLOSED: CircuitState
CIRCUIT_STATE_HALF_OPEN: CircuitState
CIRCUIT_STATE_OPEN: CircuitState

class DashboardRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WorkerSnapshot(_message.Message):
    __slots__ = ("address", "serving", "running_requests", "waiting_requests", "kv_cache_usage")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    address: str
    serving: bool
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    def __init__(self, address: _Optional[str] = ..., serving: _Optional[bool] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ...) -> None: ...

class DashboardSnapshot(_message.Message):
    __slots__ = ("taken_unix_millis", "workers", "reranker_circuit", "requests_per_second", "tokens_per_second", "ttft_p50_seconds", "ttft_p99_seconds", "degraded_responses_total")
    TAKEN_UNIX_MILLIS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RERANKER_CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_RESPONSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    taken_unix_millis: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSnapshot]
    reranker_circuit: CircuitState
    requests_per_second: float
    tokens_per_second: float
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    degraded_responses_total: int
    def __init__(self, taken_unix_millis: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerSnapshot, _Mapping]]] = ..., reranker_circuit: _Optional[_Union[CircuitState, str]] = ..., requests_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ..., degraded_responses_total: _Optional[int] = ...) -> None: ...
