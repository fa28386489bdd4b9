"""Replica pools: which drafter or target replica holds a request's session.

Routing is sticky per request (a session stays on the replica it was opened on) and least loaded
across requests. Membership changes at run time: the Ray controller scales, drains and replaces
replicas and pushes the new address list with ``set_members``. A session whose replica left the
pool, or failed a call, moves at its next window by replaying the orchestrator's token log on
another replica; the pool only says where to go, the callers in ``remote.py`` do the replay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from mirrorspec.serving.errors import NoReplicaAvailable
from mirrorspec.serving.server import BACKEND_CHANNEL_OPTIONS, health_status
from mirrorspec.v1 import common_pb2
from orchestrator.window_stream import Watchdog

log = logging.getLogger(__name__)

__all__ = ["NoReplicaAvailable", "Replica", "ReplicaPool", "parse_addresses"]


@dataclass(eq=False)  # one per member: compared and hashed by identity
class Replica:
    address: str
    channel: grpc.Channel
    stub: object
    sessions: int = 0  # sessions this orchestrator holds on it
    retired: bool = False  # left the pool; its channel closes once its last session has moved
    # its channel's state as gRPC last reported it: TRANSIENT_FAILURE from a failed connect until
    # a reconnect (which gRPC retries by itself, every few seconds) succeeds
    connectivity: grpc.ChannelConnectivity | None = None

    def note_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        self.connectivity = state

    @property
    def unreachable(self) -> bool:
        return self.connectivity is grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def answers_serving(self, timeout_s: float) -> bool:
        """Whether its server answers the health check SERVING within ``timeout_s``. A stopped
        process answers nothing, and a wedged compute lane NOT_SERVING; a busy one answers at
        once, since the check runs on its event loop, not its lane."""
        try:
            return health_status(self.channel, timeout_s) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def parse_addresses(spec: str | Iterable[str] | None) -> list[str]:
    """``"h:p,h:p"`` or a list of addresses -> a list without blanks or repeats, in order."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return list(dict.fromkeys(a.strip() for a in items if a.strip()))


class ReplicaPool:
    """Thread-safe: request worker threads acquire and release while the controller's updates
    arrive on another thread."""

    def __init__(self, name: str, addresses: Iterable[str], make_stub: Callable[[grpc.Channel], object],
                 failure_cooldown_s: float = 5.0):
        self.name = name
        self._make_stub = make_stub
        self._cooldown_s = failure_cooldown_s
        self._changed = threading.Condition()
        self._members: dict[str, Replica] = {}
        self._failed_at: dict[str, float] = {}  # gone or hung: kept off for the cooldown
        self._slow_at: dict[str, float] = {}  # a call ran out of time there: others first for the cooldown
        self._retiring: set[Replica] = set()  # left the pool with sessions on it: its channel still open
        self.closed = False  # its channels closed under the calls in flight (the front door stopped)
        self._held: set[tuple[Replica, str]] = set()  # the sessions open on its replicas now
        self.watchdog = Watchdog(f"{name}-deadlines")  # per-window deadlines of its sessions' streams
        self.set_members(addresses)

    @property
    def cooldown_s(self) -> float:
        """How long a replica reported failed is kept off."""
        return self._cooldown_s

    @property
    def addresses(self) -> list[str]:
        with self._changed:
            return list(self._members)

    def set_members(self, addresses: Iterable[str]) -> None:
        """The pool's replicas from now on. Sessions on replicas that left move at their next call."""
        wanted = parse_addresses(addresses)
        with self._changed:
            for address in list(self._members):
                if address not in wanted:
                    self._retire(self._members.pop(address))
                    self._failed_at.pop(address, None)  # replacements come on new ports: no pile of old ones
                    self._slow_at.pop(address, None)
            for address in wanted:
                if address not in self._members:
                    channel = grpc.insecure_channel(address, options=BACKEND_CHANNEL_OPTIONS)
                    self._members[address] = Replica(address, channel, self._make_stub(channel))
                    channel.subscribe(self._members[address].note_connectivity, try_to_connect=False)
                    self._failed_at.pop(address, None)
                    self._slow_at.pop(address, None)
            self._changed.notify_all()

    def is_member(self, replica: Replica) -> bool:
        with self._changed:
            return self._members.get(replica.address) is replica

    def acquire(self, avoid: Iterable[str] = (), wait_s: float = 0.0, stop: threading.Event | None = None) -> Replica:
        """The least-loaded healthy member not in ``avoid``; waits up to ``wait_s`` for one to join
        (a replacement starting up) before giving up, or until ``stop`` is set (the request ended:
        a client that left must not hold its other sessions and its worker through the wait)."""
        avoid = set(avoid)
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                replica = self._least_loaded(avoid)
                if replica is not None:
                    replica.sessions += 1
                    return replica
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReplicaAvailable(self._why_none(avoid))
                if stop is not None and stop.is_set():
                    raise NoReplicaAvailable(f"stopped waiting for a {self.name} replica: the request ended")
                self._changed.wait(min(left, 0.25))

    def _least_loaded(self, avoid: set[str]) -> Replica | None:
        now = time.monotonic()
        healthy = [r for a, r in self._members.items()
                   if a not in avoid and now - self._failed_at.get(a, -1e9) > self._cooldown_s]

        def preference(replica: Replica) -> tuple:
            troubled_at = max(self._failed_at.get(replica.address, -1e9), self._slow_at.get(replica.address, -1e9))
            # one slow of late only where no other is free; then the least loaded; among those, the
            # one in trouble longest ago (or never): a replica that hung and idles once its
            # cooldown ends must not be every new session's first pick again
            return now - self._slow_at.get(replica.address, -1e9) <= self._cooldown_s, replica.sessions, troubled_at

        return min(healthy, key=preference, default=None)

    def takes_sessions_besides(self, address: str) -> bool:
        """Whether a new session could go to a member other than ``address`` now."""
        with self._changed:
            return self._least_loaded({address}) is not None

    def unusable(self) -> str | None:
        """Why no new session could go to this pool now (no member, every one failed of late, or
        every one's connection fails), or None where one could. (Once a failure's cooldown ended,
        this said None while every target was still down: a load balancer sent requests here
        that could only fail, until the next failure; a review.)"""
        with self._changed:
            if self._least_loaded(set()) is None:
                return self._why_none(set())
            members = list(self._members.values())
        if not all(r.unreachable for r in members):
            return None
        which = f"the only {self.name} replica" if len(members) == 1 else f"all {len(members)} {self.name} replicas"
        return (f"{which} cannot be reached ({', '.join(r.address for r in members)}: connecting fails); gRPC "
                f"reconnects by itself every few seconds, and a deployment replaces one that died")

    def _why_none(self, avoid: set[str]) -> str:
        if not self._members:
            return f"no {self.name} replica is registered; scale the {self.name} pool up (mirrorspec scale {self.name} 1)"
        now = time.monotonic()
        off = ", ".join(sorted((avoid | set(self._failed_at)) & set(self._members)))
        which, were = ((f"the only {self.name} replica", "was") if len(self._members) == 1
                       else (f"all {len(self._members)} {self.name} replicas", "were"))
        back_in = [self._cooldown_s - (now - self._failed_at[a]) for a in self._members
                   if a in self._failed_at and a not in avoid]
        if not back_in:  # each was tried by this request: another request may find one well
            return f"{which} failed or {were} tried already by this request ({off}); retry it"
        return (f"{which} failed in the last {self._cooldown_s:g} s or {were} tried already ({off}); the first is "
                f"tried again in {max(min(back_in), 0.0):.1f} s, and a deployment replaces one that died: retry "
                f"then, or scale the {self.name} pool up (mirrorspec scale {self.name} N)")

    def release(self, replica: Replica) -> None:
        with self._changed:
            replica.sessions = max(replica.sessions - 1, 0)
            if replica.retired and replica.sessions == 0:
                replica.channel.close()
                self._retiring.discard(replica)

    def _retire(self, replica: Replica) -> None:
        """In-flight calls and the closing of moved sessions still need the channel."""
        replica.retired = True
        if replica.sessions == 0:
            replica.channel.close()
        else:
            self._retiring.add(replica)

    def report_failure(self, replica: Replica) -> None:
        """Keep new sessions off this replica for a cooldown; the controller replaces dead ones."""
        with self._changed:
            self._failed_at[replica.address] = time.monotonic()

    def report_slow(self, replica: Replica) -> None:
        """A call there ran out of its deadline: the replica hangs, or was busy, or the client's own
        deadline was short; which, the caller cannot tell. New sessions go to others for a
        cooldown, but still to this one where no other is free: a client that gives up behind a
        busy replica must not keep every other request off the pool's only one."""
        with self._changed:
            self._slow_at[replica.address] = time.monotonic()

    def holds(self, replica: Replica, session_id: str) -> None:
        """A session opened on ``replica``: ``close`` closes it there if its caller has not."""
        with self._changed:
            self._held.add((replica, session_id))

    def let_go(self, replica: Replica, session_id: str) -> None:
        with self._changed:
            self._held.discard((replica, session_id))

    def load(self) -> dict[str, int]:
        with self._changed:
            return {a: r.sessions for a, r in self._members.items()}

    def close(self) -> None:
        """Every channel closes now, sessions or not: the calls still in flight on them are
        cancelled, so the threads making them unwind (a stopped front door waited on them, for as
        long as a slow backend took, before its process could exit)."""
        self.closed = True
        self._close_held_sessions()
        self.set_members([])
        with self._changed:
            for replica in self._retiring:
                replica.channel.close()
            self._retiring.clear()
        self.watchdog.stop()

    def _close_held_sessions(self, timeout_s: float = 2.0) -> None:
        """Closes, on their replicas, the sessions still open (requests cut off as the front door
        stops), waiting up to ``timeout_s`` in all: they held their KV caches and session slots
        there until the replicas' TTL, ten minutes, and a restarted front door found them full."""
        with self._changed:
            held, self._held = list(self._held), set()
        settle(*(start_close(replica.stub, session_id, timeout_s) for replica, session_id in held))

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_close(stub, session_id: str, timeout_s: float) -> grpc.Future:
    """Closes a session on its replica without waiting for the answer: the call, under way. A
    failure is logged (down or hung: the replica's TTL frees the session), never raised."""
    call = stub.CloseSession.future(common_pb2.CloseSessionRequest(session_id=session_id), timeout=timeout_s)
    call.add_done_callback(lambda done: done.code() != grpc.StatusCode.OK and log.info(
        "closing session %s failed: %s", session_id, done.code().name))
    return call


def settle(*calls: grpc.Future) -> None:
    """Waits for closes under way, all at once: several sessions cost one round trip, not one each."""
    for call in calls:
        try:
            call.result()
        except (grpc.RpcError, grpc.FutureCancelledError):  # logged by start_close
            pass
