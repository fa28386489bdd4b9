from mirrorspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "raw_text", "params", "seed", "stop", "num_speculative_tokens", "mirror", "timeline", "ignore_eos")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    raw_text: str
    params: _common_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    mirror: bool
    timeline: bool
    ignore_eos: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., raw_text: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., mirror: _Optional[bool] = ..., timeline: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("windows", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "per_position_acceptance", "draft_time_s", "verify_time_s", "network_time_s", "drafter_fallback", "time_to_first_token_s", "total_time_s", "rejected", "token_acceptance_rate", "target_moves", "drafter_moves", "mirror_windows", "branches_drafted", "branch_hits", "branch_hit_rate", "draft_time_off_path_s", "mean_k", "timeline", "speculation_paused_windows", "runner_up_hits", "windows_on_target", "first_verify_time_s", "adaptive_off_windows")
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NETWORK_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MOVES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MOVES_FIELD_NUMBER: _ClassVar[int]
    MIRROR_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_OFF_PATH_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_K_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_PAUSED_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_HITS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_ON_TARGET_FIELD_NUMBER: _ClassVar[int]
    FIRST_VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_OFF_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    windows: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    per_position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    draft_time_s: float
    verify_time_s: float
    network_time_s: float
    drafter_fallback: bool
    time_to_first_token_s: float
    total_time_s: float
    rejected: int
    token_acceptance_rate: float
    target_moves: int
    drafter_moves: int
    mirror_windows: int
    branches_drafted: int
    branch_hits: int
    branch_hit_rate: float
    draft_time_off_path_s: float
    mean_k: float
    timeline: _containers.RepeatedCompositeFieldContainer[TimelineSpan]
    speculation_paused_windows: int
    runner_up_hits: int
    windows_on_target: int
    first_verify_time_s: float
    adaptive_off_windows: int
    def __init__(self, windows: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., per_position_acceptance: _Optional[_Iterable[float]] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., network_time_s: _Optional[float] = ..., drafter_fallback: _Optional[bool] = ..., time_to_first_token_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., rejected: _Optional[int] = ..., token_acceptance_rate: _Optional[float] = ..., target_moves: _Optional[int] = ..., drafter_moves: _Optional[int] = ..., mirror_windows: _Optional[int] = ..., branches_drafted: _Optional[int] = ..., branch_hits: _Optional[int] = ..., branch_hit_rate: _Optional[float] = ..., draft_time_off_path_s: _Optional[float] = ..., mean_k: _Optional[float] = ..., timeline: _Optional[_Iterable[_Union[TimelineSpan, _Mapping]]] = ..., speculation_paused_windows: _Optional[int] = ..., runner_up_hits: _Optional[int] = ..., windows_on_target: _Optional[int] = ..., first_verify_time_s: _Optional[float] = ..., adaptive_off_windows: _Optional[int] = ...) -> None: ...

class TimelineSpan(_message.Message):
    __slots__ = ("what", "start_s", "end_s")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    what: str
    start_s: float
    end_s: float
    def __init__(self, what: _Optional[str] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "seed", "stats", "prompt_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    seed: int
    stats: RequestStats
    prompt_tokens: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., seed: _Optional[int] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "seed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: RequestStats
    seed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("target", "drafter_strategy", "draft", "default_num_speculative_tokens", "max_speculative_tokens")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.ModelDescription
    drafter_strategy: str
    draft: _common_pb2.ModelDescription
    default_num_speculative_tokens: int
    max_speculative_tokens: int
    def __init__(self, target: _Optional[_Union[_common_pb2.ModelDescription, _Mapping]] = ..., drafter_strategy: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.ModelDescription, _Mapping]] = ..., default_num_speculative_tokens: _Optional[int] = ..., max_speculative_tokens: _Optional[int] = ...) -> None: ...
