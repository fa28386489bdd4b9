"""The served path as benchmark modes: drafter, target and front door gRPC servers on loopback,
started once per run in this process (sharing the already-loaded target), called through Client.

Run benchmarks that use these modes inside a loopback-only network namespace on shared machines.
"""

from __future__ import annotations

import torch

from drafter_service.servicer import DrafterConfig
from drafter_service.servicer import serve as serve_drafter
from mirrorspec.client import Client
from mirrorspec.models import LoadedModel
from mirrorspec.serving.server import BackgroundServer
from orchestrator.servicer import OrchestratorConfig
from orchestrator.servicer import serve as serve_orchestrator
from target_service.servicer import TargetConfig
from target_service.servicer import serve as serve_target


class ServedStacks:
    """One stack per drafter kind ("ngram" or the draft model), created on first use."""

    def __init__(self) -> None:
        self._servers: dict[str, list[BackgroundServer]] = {}
        self._clients: dict[str, Client] = {}

    def client(self, target: LoadedModel, draft_model: torch.nn.Module | None) -> Client:
        kind = "ngram" if draft_model is None else "draft-model"
        if kind not in self._clients:
            self._clients[kind] = self._start(kind, target, draft_model)
        return self._clients[kind]

    def _start(self, kind: str, target: LoadedModel, draft_model: torch.nn.Module | None) -> Client:
        target_server = BackgroundServer(lambda: serve_target(TargetConfig(model=target.source), loaded=target)).start()
        draft = None if draft_model is None else LoadedModel(model=draft_model, tokenizer=None, source="draft")
        drafter_server = BackgroundServer(
            lambda: serve_drafter(DrafterConfig(strategy=kind, model=None if draft is None else "draft"),
                                  loaded=draft)).start()
        front = BackgroundServer(lambda: serve_orchestrator(OrchestratorConfig(
            target=f"127.0.0.1:{target_server.port}", drafter=f"127.0.0.1:{drafter_server.port}", port=0))).start()
        self._servers[kind] = [front, drafter_server, target_server]
        return Client(f"127.0.0.1:{front.port}")

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        for servers in self._servers.values():
            for server in servers:
                server.stop()
        self._clients.clear()
        self._servers.clear()
