"""Protobuf <-> domain objects, in one place, so servicers stay thin."""

from __future__ import annotations

import math

from mirrorspec.adaptive import AdaptiveK
from mirrorspec.codec import decode_proposal, encode_proposal
from mirrorspec.config import AdaptiveKConfig, InvalidRequest, SamplingParams
from mirrorspec.drafting import Proposal, RankedTokens
from mirrorspec.models import LoadedModel
from mirrorspec.models.early_exit import EarlyExitHint
from mirrorspec.sampling import ProposalRows, TokenKind, WindowVerdict
from mirrorspec.v1 import common_pb2, drafter_pb2, target_pb2


def params_from_proto(msg: common_pb2.SamplingParams, *, default_max_new_tokens: int = 128) -> SamplingParams:
    """Unset fields mean "off" / server default; validation errors name the field."""
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        max_new_tokens=int(msg.max_new_tokens) or default_max_new_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
    )


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                     max_new_tokens=params.max_new_tokens, stop_token_ids=params.stop_token_ids)


def proposal_to_proto(rows: ProposalRows) -> common_pb2.ProposalDistribution:
    probs, ids = encode_proposal(rows)
    msg = common_pb2.ProposalDistribution(probs=common_pb2.TensorFrame(frame=probs))
    if ids is not None:
        msg.ids.frame = ids
    return msg


def proposal_from_proto(tokens, q: common_pb2.ProposalDistribution, vocab_size: int,
                        alternatives=(), min_dense_width: int | None = None) -> Proposal:
    """``alternatives``: repeated ``TokenAlternatives`` (a drafter's runner-ups), if sent;
    ``min_dense_width``: the narrowest dense q rows taken, where a draft's table is narrower than
    ``vocab_size`` (``decode_proposal``)."""
    tokens = tuple(int(t) for t in tokens)
    if not tokens:
        return Proposal.empty()
    if not q.probs.frame:
        raise InvalidRequest(f"{len(tokens)} draft tokens came without their q; send q with one row per draft",
                             field="q")
    rows = decode_proposal(q.probs.frame, q.ids.frame or None, num_tokens=len(tokens), vocab_size=vocab_size,
                           draft_tokens=list(tokens), min_dense_width=min_dense_width)
    ranked = ranked_from_proto(alternatives)
    outside = sorted({t for row in ranked.ids for t in row if not 0 <= t < vocab_size})
    if outside:  # a runner-up among them would reach the target's verify
        raise InvalidRequest(f"alternatives hold ids {outside[:8]} outside the vocabulary of {vocab_size}",
                             field="alternatives")
    return Proposal(tokens=tokens, q=rows, alternatives=ranked.ids, alternative_probs=ranked.probs)


def ranked_to_proto(ranked: RankedTokens) -> list[drafter_pb2.TokenAlternatives]:
    return [drafter_pb2.TokenAlternatives(ids=ids, probs=ranked.probs_at(j) or ())
            for j, ids in enumerate(ranked.ids)]


def ranked_from_proto(alternatives) -> RankedTokens:
    """From repeated ``TokenAlternatives``; a row's probabilities are dropped unless there is one
    per id (a replica that sends none, or a malformed row, leaves guesses ranked by order alone)."""
    ids = tuple(tuple(int(t) for t in a.ids) for a in alternatives)
    probs = tuple(tuple(float(p) for p in a.probs) if len(a.probs) == len(a.ids) else () for a in alternatives)
    return RankedTokens(ids, probs)


def hint_to_proto(hint: EarlyExitHint) -> target_pb2.EarlyExitHint:
    return target_pb2.EarlyExitHint(layer=hint.layer, rows=[target_pb2.HintRow(ids=ids, probs=probs)
                                                            for ids, probs in zip(hint.top_tokens, hint.top_probs)])


def hint_from_proto(msg: target_pb2.EarlyExitHint) -> EarlyExitHint:
    return EarlyExitHint(msg.layer, tuple(tuple(r.ids) for r in msg.rows), tuple(tuple(r.probs) for r in msg.rows))


TOKEN_KIND_TO_PROTO = {
    TokenKind.ACCEPTED: common_pb2.TOKEN_KIND_ACCEPTED,
    TokenKind.RECOVERED: common_pb2.TOKEN_KIND_RECOVERED,
    TokenKind.BONUS: common_pb2.TOKEN_KIND_BONUS,
}
TOKEN_KIND_FROM_PROTO = {v: k for k, v in TOKEN_KIND_TO_PROTO.items()}


def verdict_from_proto(msg: target_pb2.Verdict) -> WindowVerdict:
    return WindowVerdict(num_accepted=msg.num_accepted, next_token=msg.next_token,
                         next_kind=TOKEN_KIND_FROM_PROTO[msg.next_kind],
                         runner_up=msg.runner_up if msg.HasField("runner_up") else None)


def adaptive_to_proto(policy: AdaptiveK) -> target_pb2.AdaptiveK:
    """The policy with its state, the drafter's step cost resolved where the config leaves it."""
    config = policy.config
    return target_pb2.AdaptiveK(
        draft_cost=policy.draft_cost if config.draft_cost is None else config.draft_cost,
        pass_costs=config.pass_costs, pass_cost_per_token=config.pass_cost_per_token,
        prior_accepted=config.prior_accepted, prior_rejected=config.prior_rejected, decay=config.decay,
        probe_every=config.probe_every, probe_k=config.probe_k or 0,
        accepted=policy.accepted, rejected=policy.rejected, windows_off=policy.windows_off)


def adaptive_from_proto(msg: target_pb2.AdaptiveK, max_k: int) -> AdaptiveK:
    """The policy where the caller left it: the same choices of K from here on, as doubles
    travel exactly. Errors name ``adaptive``."""
    config = AdaptiveKConfig(
        draft_cost=msg.draft_cost, pass_costs=tuple(msg.pass_costs), pass_cost_per_token=msg.pass_cost_per_token,
        prior_accepted=msg.prior_accepted, prior_rejected=msg.prior_rejected, decay=msg.decay,
        probe_every=msg.probe_every, probe_k=msg.probe_k or None)
    if not (0 <= msg.accepted < math.inf and 0 <= msg.rejected < math.inf):  # NaN fails too
        raise InvalidRequest(f"the state's accepted and rejected counts must be finite and >= 0, got "
                             f"{msg.accepted} and {msg.rejected}", field="adaptive")
    return AdaptiveK(config, max_k, msg.draft_cost, msg.accepted, msg.rejected, msg.windows_off)


def check_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    ids = [int(t) for t in ids]
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"{field} holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})", field=field)
    return ids


def describe_model(loaded: LoadedModel) -> common_pb2.ModelDescription:
    model = loaded.model
    return common_pb2.ModelDescription(
        source=loaded.source, architecture=type(model).__name__, vocab_size=int(model.config.vocab_size),
        max_context=loaded.max_context, device=str(model.device), dtype=loaded.dtype_name,
        stop_token_ids=loaded.stop_token_ids())
