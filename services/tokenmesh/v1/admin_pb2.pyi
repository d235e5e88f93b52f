from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterAdminRequest(_message.Message):
    __slots__ = ("name", "directory", "pool")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    name: str
    directory: str
    pool: str
    def __init__(self, name: _Optional[str] = ..., directory: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class WorkerAdapterResult(_message.Message):
    __slots__ = ("address", "code", "message", "held")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    address: str
    code: str
    message: str
    held: bool
    def __init__(self, address: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., held: _Optional[bool] = ...) -> None: ...

class AdapterAdminReply(_message.Message):
    __slots__ = ("cluster", "workers")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAdapterResult]
    def __init__(self, cluster: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerAdapterResult, _Mapping]]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class RememberedAdapter(_message.Message):
    __slots__ = ("name", "directory", "forgotten")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    directory: str
    forgotten: bool
    def __init__(self, name: _Optional[str] = ..., directory: _Optional[str] = ..., forgotten: _Optional[bool] = ...) -> None: ...

class WorkerAdapters(_message.Message):
    __slots__ = ("address", "adapters", "held_adapters", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HELD_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    held_adapters: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, address: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., held_adapters: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class ListAdaptersReply(_message.Message):
    __slots__ = ("cluster", "remembered", "workers")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REMEMBERED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    remembered: _containers.RepeatedCompositeFieldContainer[RememberedAdapter]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAdapters]
    def __init__(self, cluster: _Optional[str] = ..., remembered: _Optional[_Iterable[_Union[RememberedAdapter, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerAdapters, _Mapping]]] = ...) -> None: ...

class WorkerAdapterRequest(_message.Message):
    __slots__ = ("name", "directory")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    directory: str
    def __init__(self, name: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class WorkerAdapterReply(_message.Message):
    __slots__ = ("changed", "held", "adapter_id")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    held: bool
    adapter_id: int
    def __init__(self, changed: _Optional[bool] = ..., held: _Optional[bool] = ..., adapter_id: _Optional[int] = ...) -> None: ...
