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
    __slots__ = ("address", "serving", "running_requests", "waiting_requests", "kv_cache_usage", "tokens_per_second", "error", "prefix_cache_hit_ratio", "prefix_cache_queries", "prefix_cache_hits", "pool", "model", "held_adapters")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HELD_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    serving: bool
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    tokens_per_second: float
    error: str
    prefix_cache_hit_ratio: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    pool: str
    model: str
    held_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., serving: _Optional[bool] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., error: _Optional[str] = ..., prefix_cache_hit_ratio: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., pool: _Optional[str] = ..., model: _Optional[str] = ..., held_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class GatewayCircuit(_message.Message):
    __slots__ = ("gateway", "state")
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    gateway: str
    state: CircuitState
    def __init__(self, gateway: _Optional[str] = ..., state: _Optional[_Union[CircuitState, str]] = ...) -> None: ...

class ErrorCount(_message.Message):
    __slots__ = ("service", "method", "code", "count")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    service: str
    method: str
    code: str
    count: int
    def __init__(self, service: _Optional[str] = ..., method: _Optional[str] = ..., code: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class DashboardSnapshot(_message.Message):
    __slots__ = ("taken_unix_millis", "workers", "reranker_circuit", "requests_per_second", "tokens_per_second", "ttft_p50_seconds", "ttft_p99_seconds", "degraded_responses_total", "gateway_circuits", "recent_errors", "warnings", "resumptions_total", "models")
    TAKEN_UNIX_MILLIS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RERANKER_CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_RESPONSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_CIRCUITS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    RESUMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    taken_unix_millis: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSnapshot]
    reranker_circuit: CircuitState
    requests_per_second: float
    tokens_per_second: float
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    degraded_responses_total: int
    gateway_circuits: _containers.RepeatedCompositeFieldContainer[GatewayCircuit]
    recent_errors: _containers.RepeatedCompositeFieldContainer[ErrorCount]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    resumptions_total: int
    models: _containers.RepeatedCompositeFieldContainer[ModelFigures]
    def __init__(self, taken_unix_millis: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerSnapshot, _Mapping]]] = ..., reranker_circuit: _Optional[_Union[CircuitState, str]] = ..., requests_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ..., degraded_responses_total: _Optional[int] = ..., gateway_circuits: _Optional[_Iterable[_Union[GatewayCircuit, _Mapping]]] = ..., recent_errors: _Optional[_Iterable[_Union[ErrorCount, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., resumptions_total: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelFigures, _Mapping]]] = ...) -> None: ...

class ModelFigures(_message.Message):
    __slots__ = ("model", "tokens_per_second", "streams_per_second", "failed_streams_per_second", "ttft_p50_seconds", "ttft_p99_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STREAMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    FAILED_STREAMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens_per_second: float
    streams_per_second: float
    failed_streams_per_second: float
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    def __init__(self, model: _Optional[str] = ..., tokens_per_second: _Optional[float] = ..., streams_per_second: _Optional[float] = ..., failed_streams_per_second: _Optional[float] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ...) -> None: ...

class WorkersRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WorkersSnapshot(_message.Message):
    __slots__ = ("taken_unix_millis", "workers")
    TAKEN_UNIX_MILLIS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    taken_unix_millis: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSnapshot]
    def __init__(self, taken_unix_millis: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerSnapshot, _Mapping]]] = ...) -> None: ...
