"""The actors: one per drafter replica, one per target rank, and the front door.

Each hosts the very server ``python -m <service>`` would run (through ``BackgroundServer``), so
a replica in an actor and a replica in a terminal are the same code. Actors are created by the
controller with the resources of their pool (see ``controller.py``).
"""

from __future__ import annotations

import logging
import socket
import threading

import ray
import torch

from cluster.spec import CONTROLLER_NAMESPACE, POOLS, StackSpec

log = logging.getLogger(__name__)

# Under the controller's PING_TIMEOUT_S, so a wedged server is reported as such, not as a timeout.
HEALTH_TIMEOUT_S = 5.0


def _bind_host(spec: StackSpec) -> str:
    return ray.util.get_node_ip_address() if spec.replica_host == "auto" else spec.replica_host


def dialable(host: str) -> str:
    """A wildcard bind (the clusters' front doors listen on 0.0.0.0) is no address to dial: the
    banner and `status` said 0.0.0.0:50051 (a review's find). This node's IP is."""
    return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


class _ServerActor:
    """What every replica answers: where it listens, where it runs, and how busy it is."""

    server = None
    host = ""

    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    def node(self) -> str:
        return _node()

    def sessions(self) -> int:
        store = self.server.servicer.sessions
        return self.server.call(lambda: (store.evict_expired(), len(store))[1], HEALTH_TIMEOUT_S)

    def ping(self) -> bool:
        """Raises unless the server answers its gRPC health check: the actor answering is not
        enough, since its server can have stopped or its event loop be wedged while it does."""
        from mirrorspec.serving.server import check_health

        if self.server is None or self.server.running is None:
            raise RuntimeError("the replica's server is not running")
        check_health(self.address(), HEALTH_TIMEOUT_S)
        return True

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class DrafterReplica(_ServerActor):
    """Loads in ``start``, not in the constructor, like ``TargetReplica``: a model that fails to
    load then comes back to the controller as its own error (a RayTaskError's cause), not as a
    dead actor."""

    def __init__(self, spec: StackSpec):
        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.host = _bind_host(spec)

    def start(self) -> str:
        from drafter_service.servicer import DrafterConfig, serve
        from mirrorspec.serving.server import BackgroundServer

        spec = self.spec
        config = DrafterConfig.for_draft(spec.draft, dtype=spec.dtype, device=spec.device, host=self.host, port=0,
                                         max_sessions=spec.max_sessions, proposal_top_k=spec.proposal_top_k,
                                         prompt_lookup=spec.prompt_lookup, draft_confidence=spec.draft_confidence,
                                         quantize=spec.draft_quantize, stall_timeout_s=spec.stall_timeout_s)
        self.server = BackgroundServer(lambda: serve(config), "drafter").start(timeout=600)
        return self.address()


class TargetReplica(_ServerActor):
    """Rank 0 of a target replica: serves gRPC and, with tp > 1, drives the follower ranks."""

    def __init__(self, spec: StackSpec):
        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.host = _bind_host(spec)
        self._driver = None

    def rendezvous(self) -> str:
        """The process group's init address, on this rank's node (STRICT_PACK keeps ranks together)."""
        with socket.socket() as s:
            s.bind((self.host, 0))
            return f"tcp://{self.host}:{s.getsockname()[1]}"

    def start(self, rendezvous: str | None = None) -> str:
        """``rendezvous``: with tp > 1, ``rendezvous()``'s address, passed as its ObjectRef so Ray
        runs this only once that call is done (a threaded actor keeps no order between calls)."""
        from mirrorspec.serving.server import BackgroundServer
        from target_service.servicer import TargetConfig, serve

        spec = self.spec
        config = TargetConfig(model=spec.target, dtype=spec.dtype, device=spec.device, host=self.host, port=0,
                              max_sessions=spec.max_sessions, hint_layer=spec.hint_layer, hint_vocab=spec.hint_vocab,
                              hint_lens=spec.hint_lens, stall_timeout_s=spec.stall_timeout_s,
                              prefill_chunk_tokens=spec.prefill_chunk_tokens)
        if spec.tp == 1:
            self.server = BackgroundServer(lambda: serve(config), "target").start(timeout=600)
        else:
            from mirrorspec.models.tensor_parallel import ShardDriver, load_shard

            loaded = load_shard(spec.target, 0, spec.tp, rendezvous, spec.dtype, spec.device)
            self._driver = ShardDriver(loaded.model)
            self.server = BackgroundServer(lambda: serve(config, loaded, new_session=self._driver.session),
                                           "target").start(timeout=600)
        return self.address()

    def stop(self) -> None:
        """Stop serving and release the followers (they leave their loop and exit)."""
        super().stop()
        if self._driver is not None:
            self._driver.stop()


class TargetFollower:
    """Rank r > 0 of a target replica: replays rank 0's session operations on its shard."""

    def __init__(self, spec: StackSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self._ended: str | None = None

    def follow(self, rendezvous: str) -> None:
        """Runs for the replica's whole life. Nobody waits on it, so how it ended is kept for
        ``ping``: a follower that failed while its process lives would leave rank 0 waiting in
        a collective for good."""
        from mirrorspec.models.tensor_parallel import run_follower

        try:
            run_follower(self.spec.target, self.rank, self.spec.tp, rendezvous, self.spec.threads, self.spec.dtype,
                         self.spec.device)
        except BaseException as err:
            self._ended = f"failed: {type(err).__name__}: {err}"
            raise
        self._ended = "ended (its rank 0 stopped)"

    def ping(self) -> bool:
        if self._ended is not None:
            raise RuntimeError(f"rank {self.rank}'s follower loop {self._ended}")
        return True


def front_door_config(spec: StackSpec, members: dict[str, list[str]]):
    """The front door's OrchestratorConfig for a deployment whose pools are ``members``."""
    from orchestrator.servicer import OrchestratorConfig

    return OrchestratorConfig(
        target=",".join(members["target"]), drafter=",".join(members["drafter"]) or None, host=spec.host,
        port=spec.port, num_speculative_tokens=spec.num_speculative_tokens, adaptive=spec.adaptive,
        mirror=spec.mirror, metrics_port=spec.metrics_port, speculation_off_above=spec.speculation_off_above,
        runner_up=spec.runner_up, windows_on_target=spec.windows_on_target,
        max_concurrent_requests=spec.max_concurrent_requests)


class FrontDoor:
    """The orchestrator's GenerationService, following the controller's pool membership. It
    starts in ``start``, not in the constructor, so a refused setting (its port in use) reaches
    the controller as its own error rather than as a dead actor."""

    def __init__(self, spec: StackSpec, members: dict[str, list[str]], version: int, controller_name: str):
        self._controller = ray.get_actor(controller_name, namespace=CONTROLLER_NAMESPACE)
        # Ray restarts this actor where its process died (the controller asks for restarts): then the
        # pools are as they are now, not as at the first start, and nobody calls ``start`` again
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            version, members = ray.get(self._controller.membership.remote())
        self._config = front_door_config(spec, members)
        self.server = None
        self.host = spec.host
        self._version, self._members = version, members
        if restarted:
            log.warning("front door restarted after its process died; serving again on %s:%s", spec.host, spec.port)
            self.start()

    def start(self) -> str:
        """Safe to repeat (the controller retries its calls after a restart): one server."""
        from mirrorspec.serving.server import BackgroundServer
        from orchestrator.servicer import serve

        if self.server is not None:
            return self.address()
        self.server = BackgroundServer(lambda: serve(self._config), "orchestrator").start(timeout=600)
        threading.Thread(target=self._follow_membership, name="membership", daemon=True).start()
        return self.address()

    def _follow_membership(self) -> None:
        servicer = self.server.servicer
        while True:
            try:
                version, members = ray.get(self._controller.membership.remote(self._version, 10.0))
            except Exception as err:  # noqa: BLE001 - the controller restarting; keep the last membership
                log.warning("membership update failed (%s); retrying", err)
                threading.Event().wait(1.0)
                continue
            if version != self._version:
                servicer.targets.set_members(members["target"])
                servicer.drafters.set_members(members["drafter"])
                if emptied := [pool for pool in POOLS if self._members[pool] and not members[pool]]:
                    # requests now wait for a target or go without drafts: worth a line in the log
                    log.warning("membership %d leaves the %s pool empty (was %d)", version, " and ".join(emptied),
                                self._version)
                self._version, self._members = version, members

    def drain(self, grace_s: float) -> None:
        """Stop serving: new requests are refused, those in flight get ``grace_s`` to finish."""
        if self.server is not None:
            self.server.stop(grace=grace_s)

    def address(self) -> str:
        return f"{dialable(self.host)}:{self.server.port}"

    def stats(self) -> dict:
        servicer = self.server.servicer
        metrics_port = servicer.metrics.port  # the one taken, where --metrics-port 0 asked for a free one
        return {"load": {"target": servicer.targets.load(), "drafter": servicer.drafters.load()},
                "address": self.address(), **servicer.metrics.summary(),
                "metrics": None if metrics_port is None else f"http://{dialable(self.host)}:{metrics_port}/metrics"}
