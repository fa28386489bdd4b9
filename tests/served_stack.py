"""A real served stack on loopback: target, drafter and orchestrator gRPC servers."""

from dataclasses import dataclass, field

from drafter_service.servicer import DrafterConfig
from drafter_service.servicer import serve as serve_drafter
from mirrorspec.serving.server import BackgroundServer
from orchestrator.servicer import OrchestratorConfig
from orchestrator.servicer import serve as serve_orchestrator
from target_service.servicer import TargetConfig
from target_service.servicer import serve as serve_target


@dataclass
class Stack:
    target: BackgroundServer
    drafter: BackgroundServer | None
    front: BackgroundServer
    extra: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.front.port}"

    def stop(self) -> None:
        for server in [self.front, self.drafter, self.target, *self.extra]:
            if server is not None:
                server.stop()


def start_stack(target_dir, draft_dir=None, strategy="draft-model", proposal_top_k=4, k=3,
                target_max_sessions=64) -> Stack:
    target = BackgroundServer(lambda: serve_target(TargetConfig(model=str(target_dir),
                                                                max_sessions=target_max_sessions))).start()
    drafter = None
    if strategy is not None:
        config = DrafterConfig(strategy=strategy, model=str(draft_dir) if draft_dir else None,
                               proposal_top_k=proposal_top_k)
        drafter = BackgroundServer(lambda: serve_drafter(config)).start()
    front_config = OrchestratorConfig(target=f"127.0.0.1:{target.port}",
                                      drafter=f"127.0.0.1:{drafter.port}" if drafter else None, port=0,
                                      num_speculative_tokens=k, metrics_port=None)
    front = BackgroundServer(lambda: serve_orchestrator(front_config)).start()
    return Stack(target, drafter, front)
