"""The served path as benchmark modes: target and drafter gRPC servers in their own processes (as
deployed), a front door in this process, called through Client.

The servers get this process's torch thread count, like the in-process modes. They do not run
as threads of this process: they would share its GIL with the front door and the client, and past
one torch thread their OpenMP pools would oversubscribe the cores beside the in-process modes'
(see ``mirrorspec.serving.server.ComputeLane``), slowing every mode after the first served call.
Only a draft no server process can load (``truncate:N``, built from the loaded target) is served
from threads of this process.

Run benchmarks that use these modes inside a loopback-only network namespace on shared machines.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from drafter_service.servicer import DrafterConfig
from mirrorspec.cli.local_stack import start_local_stack
from mirrorspec.client import Client
from mirrorspec.config import DEFAULT_DRAFT_QUANTIZE, AdaptiveKConfig
from mirrorspec.models import LoadedModel
from target_service.servicer import TargetConfig

from benchmarks.data_plane import start_processes


class ServedStacks:
    """One stack per drafter kind ("ngram" or the draft model), created on first use."""

    def __init__(self, draft_quantize: str = DEFAULT_DRAFT_QUANTIZE) -> None:
        self.draft_quantize = draft_quantize  # what a drafter server process loads the draft model with
        self._stops: dict[str, Callable[[], None]] = {}
        self._clients: dict[str, Client] = {}

    def client(self, target: LoadedModel, draft_model: torch.nn.Module | None, draft_source: str | None = None,
               prompt_lookup: int = 0, front_door_lookup: bool = True, draft_confidence: float = 0.0,
               adaptive: bool = False, runner_up: bool = False, windows_on_target: bool = False) -> Client:
        """``draft_source`` names the draft for a server process to load; without one, a draft
        model is served from threads of this process. ``prompt_lookup``, ``draft_confidence``: the
        drafter's settings;
        ``front_door_lookup``: the orchestrator runs that lookup (the default), or leaves it to
        the drafter server; ``adaptive``: the orchestrator chooses K per window (``serve --adaptive``);
        ``runner_up``: windows offer the draft's runner-up too (what ``serve`` does by default);
        ``windows_on_target``: the target runs the windows, calling the drafter itself."""
        kind = "ngram" if draft_model is None else f"draft-model, prompt lookup {prompt_lookup}"
        kind += "" if front_door_lookup else ", looked up by the drafter"
        kind += f", confidence {draft_confidence}" if draft_confidence else ""
        kind += ", adaptive K" if adaptive else ""
        kind += ", runner-up" if runner_up else ""
        kind += ", windows on the target" if windows_on_target else ""
        drafter = {"prompt_lookup": prompt_lookup, "draft_confidence": draft_confidence, "quantize": self.draft_quantize}
        front = {"front_door_lookup": front_door_lookup, "adaptive": AdaptiveKConfig() if adaptive else None,
                 "runner_up": runner_up, "windows_on_target": windows_on_target}
        if kind not in self._clients:
            if draft_model is not None and draft_source is None:
                address, stop = _stack_in_this_process(target, draft_model, drafter, front)
            else:
                address, stop = _stack_in_processes(target.source, draft_source if draft_model is not None else None,
                                                    drafter, front, server_placement(target))
            self._stops[kind] = stop
            self._clients[kind] = Client(address)
        return self._clients[kind]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        for stop in self._stops.values():
            stop()
        self._clients.clear()
        self._stops.clear()


def server_placement(target: LoadedModel) -> tuple[str, ...]:
    """The server processes' --device and --dtype: the in-process modes', so a served mode and its
    in-process twin run on the same device in the same dtype (left to ``auto``, a server on a GPU
    machine would take the GPU under ``--device cpu``)."""
    return "--device", str(target.model.device), "--dtype", target.dtype_name


def _stack_in_processes(target_source: str, draft_source: str | None, drafter: dict,
                        front: dict, placement: tuple[str, ...]) -> tuple[str, Callable[[], None]]:
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import OrchestratorConfig, serve

    target, drafter, stop_servers = start_processes(target_source, draft_source,
                                                    DrafterConfig.proposal_top_k, threads=torch.get_num_threads(),
                                                    target_args=placement, drafter_args=placement, **drafter)
    config = OrchestratorConfig(target=target, drafter=drafter, port=0, **front)
    front = BackgroundServer(lambda: serve(config), "orchestrator").start(timeout=300)

    def stop() -> None:
        front.stop()
        stop_servers()

    return f"127.0.0.1:{front.port}", stop


def _stack_in_this_process(target: LoadedModel, draft_model: torch.nn.Module, drafter: dict,
                           front: dict) -> tuple[str, Callable[[], None]]:
    draft = LoadedModel(model=draft_model, tokenizer=None, source="draft")
    stack = start_local_stack(TargetConfig(model=target.source),
                              DrafterConfig(strategy="draft-model", model="draft", **drafter),
                              target_model=target, draft_model=draft, port=0, **front)
    return stack.address, stack.stop
