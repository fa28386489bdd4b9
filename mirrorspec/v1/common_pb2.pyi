from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_KIND_UNSPECIFIED: _ClassVar[TokenKind]
    TOKEN_KIND_ACCEPTED: _ClassVar[TokenKind]
    TOKEN_KIND_RECOVERED: _ClassVar[TokenKind]
    TOKEN_KIND_BONUS: _ClassVar[TokenKind]
TOKEN_KIND_UNSPECIFIED: TokenKind
TOKEN_KIND_ACCEPTED: TokenKind
TOKEN_KIND_RECOVERED: TokenKind
TOKEN_KIND_BONUS: TokenKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...

class ProposalDistribution(_message.Message):
    __slots__ = ("probs", "ids")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    probs: TensorFrame
    ids: TensorFrame
    def __init__(self, probs: _Optional[_Union[TensorFrame, _Mapping]] = ..., ids: _Optional[_Union[TensorFrame, _Mapping]] = ...) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("source", "architecture", "vocab_size", "max_context", "device", "dtype", "stop_token_ids")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    architecture: str
    vocab_size: int
    max_context: int
    device: str
    dtype: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
