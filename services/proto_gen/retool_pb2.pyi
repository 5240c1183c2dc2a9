from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FULL: _ClassVar[TensorEncoding]
    SPARSE: _ClassVar[TensorEncoding]
FULL: TensorEncoding
SPARSE: TensorEncoding

class TensorSegment(_message.Message):
    __slots__ = ("name", "dtype", "shape", "total_bytes", "offset", "length", "data_offset", "encoding", "payload_bytes", "changed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset: int
    length: int
    data_offset: int
    encoding: TensorEncoding
    payload_bytes: int
    changed: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., data_offset: _Optional[int] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., payload_bytes: _Optional[int] = ..., changed: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "segments", "data", "last", "total_tensors", "total_bytes", "delta", "base_version", "lineage")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    segments: _containers.RepeatedCompositeFieldContainer[TensorSegment]
    data: bytes
    last: bool
    total_tensors: int
    total_bytes: int
    delta: bool
    base_version: int
    lineage: str
    def __init__(self, version: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[TensorSegment, _Mapping]]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ..., lineage: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version", "tensors", "bytes", "receive_seconds", "load_seconds", "delta", "changed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: int
    bytes: int
    receive_seconds: float
    load_seconds: float
    delta: bool
    changed: int
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., delta: _Optional[bool] = ..., changed: _Optional[int] = ...) -> None: ...

class VersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionReply(_message.Message):
    __slots__ = ("version", "serving_dtype", "lineage")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    serving_dtype: str
    lineage: str
    def __init__(self, version: _Optional[int] = ..., serving_dtype: _Optional[str] = ..., lineage: _Optional[str] = ...) -> None: ...

class ShmRequest(_message.Message):
    __slots__ = ("boot_id",)
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    def __init__(self, boot_id: _Optional[str] = ...) -> None: ...

class ShmTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "aliases")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class ShmLayout(_message.Message):
    __slots__ = ("layout_id", "paths", "segment_bytes", "tensors", "free_segment", "generation")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    segment_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[ShmTensor]
    free_segment: int
    generation: int
    def __init__(self, layout_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., segment_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[ShmTensor, _Mapping]]] = ..., free_segment: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ShmCommit(_message.Message):
    __slots__ = ("version", "segment", "generation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    segment: int
    generation: int
    def __init__(self, version: _Optional[int] = ..., segment: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...
