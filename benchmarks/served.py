"""The served path as benchmark modes: drafter, target and front door gRPC servers on loopback,
started once per run in this process (sharing the already-loaded target), called through Client.

Run benchmarks that use these modes inside a loopback-only network namespace on shared machines.
"""

from __future__ import annotations

import torch

from drafter_service.servicer import DrafterConfig
from mirrorspec.cli import LocalStack, start_local_stack
from mirrorspec.client import Client
from mirrorspec.models import LoadedModel
from target_service.servicer import TargetConfig


class ServedStacks:
    """One stack per drafter kind ("ngram" or the draft model), created on first use."""

    def __init__(self) -> None:
        self._stacks: dict[str, LocalStack] = {}
        self._clients: dict[str, Client] = {}

    def client(self, target: LoadedModel, draft_model: torch.nn.Module | None) -> Client:
        kind = "ngram" if draft_model is None else "draft-model"
        if kind not in self._clients:
            draft = None if draft_model is None else LoadedModel(model=draft_model, tokenizer=None, source="draft")
            stack = start_local_stack(TargetConfig(model=target.source),
                                      DrafterConfig(strategy=kind, model=None if draft is None else "draft"),
                                      target_model=target, draft_model=draft, port=0)
            self._stacks[kind] = stack
            self._clients[kind] = Client(stack.address)
        return self._clients[kind]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        for stack in self._stacks.values():
            stack.stop()
        self._clients.clear()
        self._stacks.clear()
