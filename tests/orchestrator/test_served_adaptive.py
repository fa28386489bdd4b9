"""Adaptive K behind the front door prices a draft step as the drafter replica reports it
(``DrafterInfo.step_cost``): an int8 draft is cheaper, so adaptive K drafts further for the same
acceptance, exactly as the in-process engine does with the same drafter."""

import grpc
import pytest

from drafter_service.servicer import DrafterConfig, DrafterServicer
from mirrorspec import Client, SamplingParams, generate
from mirrorspec.config import DRAFT_MODEL_STEP_COST, INT8_DRAFT_MODEL_STEP_COST, AdaptiveKConfig
from mirrorspec.drafting import DraftModelDrafter, NgramDrafter
from mirrorspec.models import load_causal_lm
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from orchestrator.remote import replica_step_cost
from served_stack import start_stack
from support import load, load_as_served_draft

K, TOP_K, PROMPT, MAX_TOKENS = 4, 4, [0, 3, 5, 2], 40


def drafter_info(config: DrafterConfig, loaded) -> drafter_pb2.DrafterInfo:
    server = BackgroundServer(lambda: start_grpc_server(
        [Service(drafter_pb2_grpc.add_DrafterServiceServicer_to_server, DrafterServicer(config, loaded),
                 "mirrorspec.v1.DrafterService")], "127.0.0.1", 0)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            return drafter_pb2_grpc.DrafterServiceStub(channel).Info(common_pb2.InfoRequest())
    finally:
        server.stop()


@pytest.mark.parametrize("quantize, cost", [("int8", INT8_DRAFT_MODEL_STEP_COST), ("none", DRAFT_MODEL_STEP_COST)])
def test_a_draft_model_replica_reports_the_step_cost_of_its_quantization(tiny_dir, quantize, cost):
    loaded = load_causal_lm(str(tiny_dir["draft16"]), tokenizer=False, quantize=quantize)
    info = drafter_info(DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft16"]), quantize=quantize),
                        loaded)
    assert info.step_cost == cost == DraftModelDrafter(loaded.model).step_cost
    assert replica_step_cost(info) == cost


def test_an_ngram_replica_costs_nothing_and_an_older_replica_gets_the_default():
    info = drafter_info(DrafterConfig(strategy="ngram"), None)
    assert info.step_cost == 0.0 == NgramDrafter.step_cost == replica_step_cost(info)
    # a draft-model replica built before the field reports 0: priced at the plain default, not free
    assert replica_step_cost(drafter_pb2.DrafterInfo(strategy="draft-model")) == DRAFT_MODEL_STEP_COST


def test_served_adaptive_k_drafts_as_the_engine_does_with_the_same_int8_drafter(tiny_dir):
    target = load(tiny_dir["target16"])
    int8_draft = load_causal_lm(str(tiny_dir["draft16"]), tokenizer=False, quantize="int8").model
    params = SamplingParams(max_new_tokens=MAX_TOKENS)

    def in_process(step_cost: float):
        drafter = DraftModelDrafter(int8_draft, proposal_top_k=TOP_K)
        drafter.step_cost = step_cost
        return generate(target, drafter, PROMPT, params, num_speculative_tokens=K, adaptive=True).stats

    engine, priced_plain = in_process(INT8_DRAFT_MODEL_STEP_COST), in_process(DRAFT_MODEL_STEP_COST)
    assert engine.drafted != priced_plain.drafted  # the price changes K here, so the check below sees it
    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"], proposal_top_k=TOP_K, k=K, quantize="int8",
                        adaptive=AdaptiveKConfig())
    try:
        with Client(stack.address) as client:
            served = client.generate(PROMPT, max_tokens=MAX_TOKENS)
    finally:
        stack.stop()
    assert served.token_ids == list(generate(target, None, PROMPT, params).token_ids)
    assert (served.stats.drafted, served.stats.windows) == (engine.drafted, engine.windows)


def test_windows_adaptive_k_sent_without_drafts_are_counted_at_the_front_door_as_in_process(tiny_dir,
                                                                                            near_draft16_dir):
    """RequestStats.adaptive_off_windows: the windows where speculation did not pay, so adaptive
    K drafted nothing (K swings over [0, 4] on the near draft, priced at 0.2 a step)."""
    adaptive = AdaptiveKConfig(draft_cost=0.2, probe_every=8)
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(near_draft16_dir)
    stack = start_stack(tiny_dir["target16"], near_draft16_dir, proposal_top_k=TOP_K, k=K, adaptive=adaptive)
    switched_off = 0
    try:
        with Client(stack.address) as client:
            for seed in (1, 2, 3):
                served = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
                engine = generate(target, draft, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=MAX_TOKENS),
                                  num_speculative_tokens=K, seed=seed, proposal_top_k=TOP_K, adaptive=adaptive)
                assert served.token_ids == engine.token_ids and served.stats.windows_on_target == 0
                assert served.stats.adaptive_off_windows == engine.stats.adaptive_off_windows
                switched_off += served.stats.adaptive_off_windows
            assert stack.front.servicer.metrics.adaptive_off_windows._value.get() == switched_off
    finally:
        stack.stop()
    assert switched_off > 0
