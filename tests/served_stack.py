"""A real served stack on loopback (target, drafter and orchestrator gRPC servers) for tests."""

import threading
from contextlib import contextmanager

from drafter_service.servicer import DrafterConfig
from mirrorspec.cli.local_stack import LocalStack, start_local_stack
from mirrorspec.client import Client
from mirrorspec.config import DEFAULT_DRAFT_QUANTIZE
from target_service.servicer import TargetConfig


def start_stack(target_dir, draft_dir=None, strategy="draft-model", proposal_top_k=4, k=3,
                target_max_sessions=64, hint_layer=None, hint_vocab=None, prompt_lookup=0, draft_confidence=0.0,
                quantize=DEFAULT_DRAFT_QUANTIZE, **replicas) -> LocalStack:
    drafter = None
    if strategy is not None:
        drafter = DrafterConfig(strategy=strategy, model=str(draft_dir) if draft_dir else None,
                                proposal_top_k=proposal_top_k, prompt_lookup=prompt_lookup,
                                draft_confidence=draft_confidence, quantize=quantize)
    target = TargetConfig(model=str(target_dir), max_sessions=target_max_sessions, hint_layer=hint_layer,
                          hint_vocab=hint_vocab)
    return start_local_stack(target, drafter, port=0, num_speculative_tokens=k, **replicas)


def two_mirror_requests(target_dir, draft_dir, **stack_options) -> None:
    """Two greedy mirror requests, one after the other, through a stack of their own."""
    stack = start_stack(target_dir, draft_dir, k=3, **stack_options)
    try:
        with Client(stack.address) as client:
            for prompt in ([0, 3, 5, 2, 6], [1, 4, 7, 2, 9]):
                client.generate(prompt, max_tokens=16, mirror=True)
    finally:
        stack.stop()


@contextmanager
def targets_held(stack: LocalStack):
    """Every target replica's compute lane waits until the block exits: a request in flight stays
    in flight (its next Verify queues), however fast the tiny models decode."""
    release = threading.Event()
    for server in stack.targets:
        server.servicer.lane._pool.submit(release.wait, 60)
    try:
        yield
    finally:
        release.set()
