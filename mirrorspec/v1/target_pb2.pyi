from mirrorspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenTargetSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "params", "seed", "defer_prefill", "session_id")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEFER_PREFILL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    seed: int
    defer_prefill: bool
    session_id: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., defer_prefill: _Optional[bool] = ..., session_id: _Optional[str] = ...) -> None: ...

class OpenTargetSessionResponse(_message.Message):
    __slots__ = ("session_id", "prefill_time_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefill_time_s: float
    def __init__(self, session_id: _Optional[str] = ..., prefill_time_s: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "context_length", "draft_tokens", "q", "hints", "runner_up")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _common_pb2.ProposalDistribution
    hints: bool
    runner_up: int
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_common_pb2.ProposalDistribution, _Mapping]] = ..., hints: _Optional[bool] = ..., runner_up: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("num_accepted", "next_token", "next_kind", "verify_time_s", "runner_up")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_KIND_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    next_kind: _common_pb2.TokenKind
    verify_time_s: float
    runner_up: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., next_kind: _Optional[_Union[_common_pb2.TokenKind, str]] = ..., verify_time_s: _Optional[float] = ..., runner_up: _Optional[int] = ...) -> None: ...

class HintRow(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class EarlyExitHint(_message.Message):
    __slots__ = ("layer", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: _containers.RepeatedCompositeFieldContainer[HintRow]
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[HintRow, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("verdict", "hint")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    hint: EarlyExitHint
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., hint: _Optional[_Union[EarlyExitHint, _Mapping]] = ...) -> None: ...

class RunWindowsRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "context_length", "drafter_address", "drafter_session_id", "drafter_context_length", "k", "max_new_tokens", "runner_up", "draft_timeout_s", "max_branches", "branch_alternatives", "adaptive", "branch_every_window", "draft_vocab_size")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_EVERY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    drafter_address: str
    drafter_session_id: str
    drafter_context_length: int
    k: int
    max_new_tokens: int
    runner_up: bool
    draft_timeout_s: float
    max_branches: int
    branch_alternatives: int
    adaptive: AdaptiveK
    branch_every_window: bool
    draft_vocab_size: int
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., drafter_address: _Optional[str] = ..., drafter_session_id: _Optional[str] = ..., drafter_context_length: _Optional[int] = ..., k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., runner_up: _Optional[bool] = ..., draft_timeout_s: _Optional[float] = ..., max_branches: _Optional[int] = ..., branch_alternatives: _Optional[int] = ..., adaptive: _Optional[_Union[AdaptiveK, _Mapping]] = ..., branch_every_window: _Optional[bool] = ..., draft_vocab_size: _Optional[int] = ...) -> None: ...

class AdaptiveK(_message.Message):
    __slots__ = ("draft_cost", "pass_costs", "pass_cost_per_token", "prior_accepted", "prior_rejected", "decay", "probe_every", "probe_k", "accepted", "rejected", "windows_off")
    DRAFT_COST_FIELD_NUMBER: _ClassVar[int]
    PASS_COSTS_FIELD_NUMBER: _ClassVar[int]
    PASS_COST_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PRIOR_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PRIOR_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    PROBE_EVERY_FIELD_NUMBER: _ClassVar[int]
    PROBE_K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_OFF_FIELD_NUMBER: _ClassVar[int]
    draft_cost: float
    pass_costs: _containers.RepeatedScalarFieldContainer[float]
    pass_cost_per_token: float
    prior_accepted: float
    prior_rejected: float
    decay: float
    probe_every: int
    probe_k: int
    accepted: float
    rejected: float
    windows_off: int
    def __init__(self, draft_cost: _Optional[float] = ..., pass_costs: _Optional[_Iterable[float]] = ..., pass_cost_per_token: _Optional[float] = ..., prior_accepted: _Optional[float] = ..., prior_rejected: _Optional[float] = ..., decay: _Optional[float] = ..., probe_every: _Optional[int] = ..., probe_k: _Optional[int] = ..., accepted: _Optional[float] = ..., rejected: _Optional[float] = ..., windows_off: _Optional[int] = ...) -> None: ...

class WindowResult(_message.Message):
    __slots__ = ("verdict", "tokens", "num_drafted", "draft_time_s", "draft_call_s", "drafter_error", "context_length", "branches_drafted", "branch_hit", "branch_time_s")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HIT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TIME_S_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: int
    draft_time_s: float
    draft_call_s: float
    drafter_error: str
    context_length: int
    branches_drafted: int
    branch_hit: bool
    branch_time_s: float
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[int] = ..., draft_time_s: _Optional[float] = ..., draft_call_s: _Optional[float] = ..., drafter_error: _Optional[str] = ..., context_length: _Optional[int] = ..., branches_drafted: _Optional[int] = ..., branch_hit: _Optional[bool] = ..., branch_time_s: _Optional[float] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model", "open_sessions", "max_sessions", "max_speculative_tokens", "hint_layer", "runs_adaptive_k")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HINT_LAYER_FIELD_NUMBER: _ClassVar[int]
    RUNS_ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelDescription
    open_sessions: int
    max_sessions: int
    max_speculative_tokens: int
    hint_layer: int
    runs_adaptive_k: bool
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelDescription, _Mapping]] = ..., open_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_speculative_tokens: _Optional[int] = ..., hint_layer: _Optional[int] = ..., runs_adaptive_k: _Optional[bool] = ...) -> None: ...
