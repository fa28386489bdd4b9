"""Chunked prefill: a long prompt is fed to the target's cache a chunk per compute-lane job, so
other sessions' windows run between its chunks, and the output is what one pass gives."""

import threading

import grpc
import pytest

from mirrorspec import SamplingParams, SpeculationConfig, generate
from mirrorspec.config import InvalidRequest
from mirrorspec.drafting import DraftModelDrafter
from mirrorspec.engine import GenerationStats, decode_windows
from mirrorspec.models import load_causal_lm
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from orchestrator.pool import ReplicaPool
from orchestrator.remote import RemoteVerifier
from support import load, wait_until
from target_service.servicer import TargetConfig, TargetServicer

LONG_PROMPT = [(7 * i + 3) % 16 for i in range(60)]


class JobLog:
    """What the target's compute lane runs, in order: ("prefix", n) for a cache fed up to n
    tokens, ("verify", n) for a window after n."""

    def __init__(self, servicer: TargetServicer):
        self.jobs: list[tuple[str, int]] = []
        run_for = servicer.lane.run_for  # a session's work

        async def logged(session, fn, *args):
            kind = "verify" if getattr(fn, "__name__", "") == "verify" else "prefix"
            self.jobs.append((kind, len(args[0])))
            return await run_for(session, fn, *args)

        servicer.lane.run_for = logged


@pytest.fixture()
def chunked_target(tiny_dir):
    """A target that prefills 8 tokens per lane job; its servicer, and its address."""
    servicer = TargetServicer(load_causal_lm(str(tiny_dir["target16"]), tokenizer=False),
                              TargetConfig(model=str(tiny_dir["target16"]), prefill_chunk_tokens=8))
    server = BackgroundServer(lambda: start_grpc_server(
        [Service(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer, "mirrorspec.v1.TargetService")],
        "127.0.0.1", 0)).start()
    yield servicer, f"127.0.0.1:{server.port}"
    server.stop()


def test_another_sessions_window_runs_between_the_chunks_of_a_long_prefill(chunked_target):
    servicer, address = chunked_target
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address))
    params = common_pb2.SamplingParams(max_new_tokens=20)
    short = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[3, 1, 4], params=params)).session_id
    log = JobLog(servicer)
    release = threading.Event()
    servicer.lane._pool.submit(release.wait, 30)  # the lane is busy: what comes next queues, in order
    queued = servicer.lane._pool._work_queue.qsize
    try:
        opening = stub.OpenSession.future(target_pb2.OpenTargetSessionRequest(prompt_ids=LONG_PROMPT, params=params))
        assert wait_until(lambda: queued() == 1)  # the long prompt's first chunk
        window = stub.VerifyWindow.future(target_pb2.VerifyRequest(session_id=short, context_length=3))
        assert wait_until(lambda: queued() == 2)
    finally:
        release.set()
    window.result(timeout=30)
    opening.result(timeout=30)
    assert log.jobs == [("prefix", 8), ("verify", 3), *(("prefix", n) for n in range(16, 57, 8)), ("prefix", 60)]


def test_a_prompt_of_one_chunk_or_less_is_prefilled_in_one_job(chunked_target):
    servicer, address = chunked_target
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address))
    log = JobLog(servicer)
    stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=LONG_PROMPT[:8],
                                                         params=common_pb2.SamplingParams(max_new_tokens=4)))
    assert log.jobs == [("prefix", 8)]


@pytest.mark.parametrize("defer_prefill", [False, True], ids=["prefilled", "deferred"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chunked_prefill_decodes_what_the_engine_does_in_process(chunked_target, tiny_dir, defer_prefill,
                                                                   temperature):
    """Deferred, the first window brings all but the last chunk first, and scores that chunk with
    its drafts in one pass."""
    servicer, address = chunked_target
    log = JobLog(servicer)
    params = SamplingParams(max_new_tokens=40, temperature=temperature)
    with ReplicaPool("target", [address], target_pb2_grpc.TargetServiceStub) as pool:
        verifier = RemoteVerifier(pool, LONG_PROMPT, params, 9, 16, timeout_s=30, defer_prefill=defer_prefill)
        drafter = DraftModelDrafter(load(tiny_dir["draft16"]))
        served = [t for event in decode_windows(drafter, verifier, LONG_PROMPT, params,
                                                SpeculationConfig(num_speculative_tokens=3), 9, GenerationStats())
                  for t in event.tokens]
        verifier.release()
    alone = generate(load(tiny_dir["target16"]), DraftModelDrafter(load(tiny_dir["draft16"])), LONG_PROMPT, params,
                     num_speculative_tokens=3, seed=9)
    assert served == alone.token_ids and len(served) == 40
    chunks = [("prefix", n) for n in range(8, 57, 8)]
    assert log.jobs[:len(chunks) + 1] == chunks + ([("verify", 60)] if defer_prefill else [("prefix", 60)])


@pytest.mark.parametrize("tokens", [0, -4, 2.5, True])
def test_a_prefill_chunk_must_be_a_positive_whole_number(tokens):
    with pytest.raises(InvalidRequest, match="prefill_chunk_tokens must be a whole number of tokens >= 1") as err:
        TargetConfig(prefill_chunk_tokens=tokens)
    assert err.value.field == "prefill_chunk_tokens"
