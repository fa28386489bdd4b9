from mirrorspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenDraftSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "params", "seed", "caller_looks_up", "target_vocab_size", "session_id")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CALLER_LOOKS_UP_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    seed: int
    caller_looks_up: bool
    target_vocab_size: int
    session_id: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., caller_looks_up: _Optional[bool] = ..., target_vocab_size: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class OpenDraftSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "context_length", "k", "keep", "branch_tokens", "branch_forks", "own_token_branch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FORKS_FIELD_NUMBER: _ClassVar[int]
    OWN_TOKEN_BRANCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    k: int
    keep: int
    branch_tokens: _containers.RepeatedScalarFieldContainer[int]
    branch_forks: _containers.RepeatedScalarFieldContainer[int]
    own_token_branch: bool
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., k: _Optional[int] = ..., keep: _Optional[int] = ..., branch_tokens: _Optional[_Iterable[int]] = ..., branch_forks: _Optional[_Iterable[int]] = ..., own_token_branch: _Optional[bool] = ...) -> None: ...

class TokenAlternatives(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tokens", "q", "draft_time_s", "alternatives")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _common_pb2.ProposalDistribution
    draft_time_s: float
    alternatives: _containers.RepeatedCompositeFieldContainer[TokenAlternatives]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_common_pb2.ProposalDistribution, _Mapping]] = ..., draft_time_s: _Optional[float] = ..., alternatives: _Optional[_Iterable[_Union[TokenAlternatives, _Mapping]]] = ...) -> None: ...

class DraftBranchesResponse(_message.Message):
    __slots__ = ("drafts", "draft_time_s", "forked", "own_token")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FORKED_FIELD_NUMBER: _ClassVar[int]
    OWN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftResponse]
    draft_time_s: float
    forked: bool
    own_token: int
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftResponse, _Mapping]]] = ..., draft_time_s: _Optional[float] = ..., forked: _Optional[bool] = ..., own_token: _Optional[int] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("strategy", "model", "open_sessions", "max_sessions", "proposal_top_k", "prompt_lookup", "step_cost", "draft_confidence")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_TOP_K_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    model: _common_pb2.ModelDescription
    open_sessions: int
    max_sessions: int
    proposal_top_k: int
    prompt_lookup: int
    step_cost: float
    draft_confidence: float
    def __init__(self, strategy: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelDescription, _Mapping]] = ..., open_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., proposal_top_k: _Optional[int] = ..., prompt_lookup: _Optional[int] = ..., step_cost: _Optional[float] = ..., draft_confidence: _Optional[float] = ...) -> None: ...
