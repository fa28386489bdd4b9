"""Target replicas, drafter replicas and the front door as gRPC servers in one process: what
`serve --in-process` runs, and what tests and benchmarks stand up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:  # the services are imported when used, so `mirrorspec --help` stays fast
    from drafter_service.servicer import DrafterConfig
    from mirrorspec.models import LoadedModel
    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig


@dataclass
class LocalStack:
    """Target replicas, drafter replicas and the front door, each a gRPC server in this process."""

    targets: list[BackgroundServer]
    drafters: list[BackgroundServer]
    front: BackgroundServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.front.port}"

    @property
    def target(self) -> BackgroundServer:
        return self.targets[0]

    @property
    def drafter(self) -> BackgroundServer | None:
        return self.drafters[0] if self.drafters else None

    def stop(self) -> None:
        for server in (self.front, *self.drafters, *self.targets):
            server.stop()


def start_local_stack(target: TargetConfig, drafter: DrafterConfig | None, *, target_model: LoadedModel | None = None,
                      draft_model: LoadedModel | None = None, target_replicas: int = 1, drafter_replicas: int = 1,
                      **front_options) -> LocalStack:
    """Start target and drafter replicas (no drafter if None) and the orchestrator routing over
    them; ``front_options`` are OrchestratorConfig fields (host, port, num_speculative_tokens, ...).
    Models already loaded in this process can be shared instead of loaded again."""
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import OrchestratorConfig
    from orchestrator.servicer import serve as serve_orchestrator
    from target_service.servicer import serve as serve_target

    started: list[BackgroundServer] = []

    def start(factory, name: str) -> BackgroundServer:
        started.append(BackgroundServer(factory, name))
        return started[-1].start()

    try:
        targets = [start(lambda: serve_target(target, loaded=target_model), "target") for _ in range(target_replicas)]
        drafters = [start(lambda: serve_drafter(drafter, loaded=draft_model), "drafter")
                    for _ in range(drafter_replicas if drafter is not None else 0)]
        front = OrchestratorConfig(target=",".join(f"127.0.0.1:{t.port}" for t in targets),
                                   drafter=",".join(f"127.0.0.1:{d.port}" for d in drafters) or None, **front_options)
        return LocalStack(targets, drafters, start(lambda: serve_orchestrator(front), "orchestrator"))
    except BaseException:  # one that failed to start: the rest stop too, rather than serve on, unreachable
        for server in reversed(started):
            server.stop()
        raise
