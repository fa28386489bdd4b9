"""The controller: a named, detached actor that owns the drafter pool and the target pool.

It launches replicas with their pool's resources (pending ones are what make the Ray autoscaler
add nodes of the matching type), promotes them to the pool once they serve, pings them, replaces
the dead, and drains on scale-down: a draining replica leaves the membership at once, the front
door moves its sessions at their next window by replaying its token log elsewhere, and the
replica is stopped once it holds no session (or after ``drain_timeout_s``). Front doors follow
the membership by long-polling ``membership``.

The controller is not a single point of failure. The front door, the replicas and their placement
groups are detached, so Ray's fate sharing does not take them down with it, and its state (the
pools' sizes and replicas) is checkpointed in the GCS's key-value store on every change. Ray
restarts a controller whose process died, and the new one adopts the replicas by name from the
checkpoint: requests in flight never notice, as the front door keeps its last membership meanwhile.
Replicas still starting at the crash are stopped and launched afresh.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.experimental import internal_kv
from ray.util.placement_group import get_placement_group, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.node_fit import describe, unplaceable
from cluster.replicas import DrafterReplica, FrontDoor, TargetFollower, TargetReplica
from cluster.spec import CONTROLLER_NAMESPACE, POOLS, PoolResources, StackSpec, check_pool, check_replicas
from mirrorspec.config import InvalidRequest

log = logging.getLogger(__name__)
MAX_EVENTS = 1000  # replica events a controller keeps for `serve` to print

SUPERVISE_EVERY_S = 0.5
PING_TIMEOUT_S = 10.0
# A pool whose replicas refuse their settings (InvalidRequest: a model that does not load) this
# many times in a row, with none serving, fails `start` with that refusal: every replacement would
# refuse alike. Other start failures (a node short of memory, a lost actor) are retried until the
# start timeout, whose message then carries the last of them.
REFUSALS_BEFORE_GIVING_UP = 2


@dataclass
class ReplicaRecord:
    pool: str
    replica_id: str
    actor: object
    ready: object  # ObjectRef of the address, resolved once the replica serves
    followers: list = field(default_factory=list)  # target ranks 1..tp-1
    group: object = None  # the replica's placement group (tp bundles for a target)
    state: str = "starting"  # starting -> serving -> draining; removed when stopped or dead
    address: str | None = None
    node: str | None = None
    resources: str = ""

    @property
    def actors(self) -> list:
        return [self.actor, *self.followers]

    def saved(self) -> dict:
        """What a restarted controller needs to find this replica again (its actors by name)."""
        return {"pool": self.pool, "replica_id": self.replica_id, "ranks": len(self.actors), "state": self.state,
                "address": self.address, "node": self.node, "resources": self.resources}


def role_resources(pool: str, res: PoolResources) -> dict:
    """One replica's (or target rank's) request; zero amounts are left out, as Ray wants."""
    wanted = {"CPU": res.cpus, "GPU": res.gpus, pool: 1}
    return {k: v for k, v in wanted.items() if v}


def own_error(err: BaseException) -> BaseException:
    """The error an actor itself raised, out of the RayTaskErrors wrapped around it (one per actor
    call it crossed: replica -> controller -> caller), so a message carries no Ray traceback."""
    while isinstance(getattr(err, "cause", None), BaseException):
        err = err.cause
    return err


@dataclass
class StartFailures:
    """A pool's replicas that failed to start since one last served."""

    count: int = 0
    refusals: int = 0  # in a row: the replica refused its settings (InvalidRequest)
    last: BaseException | None = None

    def add(self, err: BaseException) -> None:
        self.count += 1
        self.last = own_error(err)
        self.refusals = self.refusals + 1 if isinstance(self.last, InvalidRequest) else 0

    def refusal(self, pool: str) -> InvalidRequest:
        """The replicas' refusal, for `mirrorspec serve` to name the flag: ``model`` is the pool's
        model flag (--target or --draft)."""
        field = self.last.field
        if field == "model":
            field = "target" if pool == "target" else "draft"
        return InvalidRequest(f"the {pool} replicas failed to start {self.refusals} times in a row: {self.last}",
                              field=field)


class Controller:
    def __init__(self, spec: StackSpec):
        self.spec = spec
        self._changed = threading.Condition()
        self._replicas: dict[str, ReplicaRecord] = {}
        self._wanted = {"drafter": spec.drafters, "target": spec.targets}
        self._next_id = 1
        self._start_failures = {pool: StartFailures() for pool in POOLS}
        self._version = 0
        self._front_routes = -1  # the membership version the front door routes by, as its last poll said
        self._front = None
        self._front_address: str | None = None
        self._stopped = threading.Event()
        self._stopping = False
        self._drained: list[str] = []  # replicas stopped by ``drain``, so a retried call succeeds
        # what happened to replicas, for `serve` to print (``events_since``): its own log lines went
        # to Ray's worker logs alone, and an operator watching `serve` saw none (a review)
        self._events: list[str] = []
        self._events_dropped = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._restore()
        if not self._stopping:
            self._reconcile()
            threading.Thread(target=self._supervise, name="supervise", daemon=True).start()

    # ---- the operator's API ----------------------------------------------------------------
    def start(self, front_node: str, timeout_s: float = 600.0) -> str:
        """Wait for each pool's first replica, then start the front door on ``front_node``."""
        if self._front_address is not None:  # a retry of this call, after a restart of this actor
            return self._front_address
        if self._front is not None:  # created before a restart of this actor: its start is safe to repeat
            return self._started_front(timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._changed.wait_for(lambda: self._all_serving() or self._refused_pool() is not None, timeout=timeout_s)
            started, members, version = self._all_serving(), self._members(), self._version
        if not started:
            raise self._not_started(timeout_s)
        placement = NodeAffinitySchedulingStrategy(node_id=front_node, soft=False)
        # restarted by Ray on its node if its process dies (OOM, a crash): it serves again on its
        # port with the pools as they are then; the requests it held are lost to their clients
        self._front = ray.remote(FrontDoor).options(
            num_cpus=0, scheduling_strategy=placement, max_restarts=-1, name=self._front_name,
            namespace=CONTROLLER_NAMESPACE, lifetime="detached").remote(self.spec, members, version,
                                                                        self.spec.controller_name)
        return self._started_front(max(deadline - time.monotonic(), 30))

    def _not_started(self, timeout_s: float) -> Exception:
        if (pool := self._refused_pool()) is not None:
            return self._start_failures[pool].refusal(pool)
        if unplaced := self._unplaceable():
            record, why = unplaced[0]
            return InvalidRequest(f"no replica came up within {timeout_s:.0f} s: {_pending_because(record, why)}",
                                  field=why.field)
        return TimeoutError(f"no replica came up within {timeout_s:.0f} s: {self._pending_summary()}; "
                            f"check `ray status` for pending resources")

    def unplaced(self) -> list[str]:
        """Replicas Ray cannot place on any node there is now, and why: `serve` says so while it
        waits, as an autoscaler may still add such a node (or may have none to add)."""
        return [_pending_because(record, why) for record, why in self._unplaceable()]

    def _unplaceable(self) -> list[tuple[ReplicaRecord, InvalidRequest]]:
        with self._changed:
            starting = [r for r in self._replicas.values() if r.state == "starting"]
        pending = [r for r in starting if self._shown_state(r) == "pending"]
        nodes = ray.nodes() if pending else []
        found = [(r, unplaceable(r.pool, self._bundle(r.pool), self._ranks(r.pool), nodes)) for r in pending]
        return [(record, unplaced) for record, unplaced in found if unplaced is not None]

    def _started_front(self, timeout_s: float) -> str:
        address = ray.get(self._front.start.remote(), timeout=timeout_s)
        with self._changed:
            self._front_address = address
            self._save()
        return address

    def scale(self, pool: str, replicas: int, wait_s: float = 0.0) -> list[dict]:
        """Grow or shrink one pool. Returns once shrinking replicas are drained and stopped, and
        after up to ``wait_s`` for new ones to serve and the front door to route to them (pending
        ones wait for the autoscaler)."""
        check_replicas(check_pool(pool), replicas, "replicas")
        with self._changed:
            self._wanted[pool] = replicas
            self._save()
            active = [r for r in self._replicas.values() if r.pool == pool and r.state != "draining"]
        # stop replicas still starting first, then the ones holding the fewest sessions
        load = {r.replica_id: (self._sessions(r) or 0) if r.state == "serving" else -1 for r in active}
        active.sort(key=lambda r: load[r.replica_id])
        with self._changed:
            victims = [r for r in active[:max(len(active) - replicas, 0)] if r.replica_id in self._replicas]
            for victim in victims:
                victim.state = "draining"
            self._bump()
        self._reconcile()
        for victim in victims:
            self._drain_and_stop(victim)
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._changed.wait_for(lambda: self._count(pool, "serving") >= replicas, timeout=wait_s)
            self._changed.wait_for(self._front_is_current, timeout=max(deadline - time.monotonic(), 0.0))
        return self.status()

    def drain(self, replica_id: str) -> list[dict]:
        """Take one replica out (e.g. its node is going away); a replacement keeps the pool's size."""
        with self._changed:
            record = self._replicas.get(replica_id)
            if record is None and replica_id in self._drained:  # a retry, after a restart of this actor
                return self.status()
            if record is None:
                raise InvalidRequest(f"no replica {replica_id!r}; `mirrorspec status` lists them", field="replica")
            if record.state == "draining":  # already on its way out (a retry): wait for it
                self._changed.wait_for(lambda: replica_id not in self._replicas,
                                       timeout=self.spec.drain_timeout_s + 30)
                return self.status()
            record.state = "draining"
            self._bump()
        self._reconcile()
        self._drain_and_stop(record)
        return self.status()

    def membership(self, since_version: int = -1, wait_s: float = 0.0) -> tuple[int, dict[str, list[str]]]:
        """The serving replicas' addresses; waits up to ``wait_s`` for a version newer than
        ``since_version``, the version the front door routes by: it polls again only once it has
        applied the last answer, so each poll tells the controller how current its routing is."""
        with self._changed:
            if since_version >= 0:
                self._front_routes = since_version
                self._changed.notify_all()
            self._changed.wait_for(lambda: self._version != since_version, timeout=wait_s)
            return self._version, self._members()

    def _front_is_current(self) -> bool:
        """Whether the front door routes by the current membership. A replica the controller calls
        serving gets no request until it does: after a replacement or a scale-up that is a
        long-poll round trip, which a request sent at once could beat (and go without drafts)."""
        return self._front is None or self._front_routes == self._version

    def status(self) -> list[dict]:
        with self._changed:
            records = list(self._replicas.values())
        rows = []
        for r in records:
            rows.append({"replica": r.replica_id, "pool": r.pool, "state": self._shown_state(r),
                         "address": r.address or "-", "node": (r.node or "-")[:12], "resources": r.resources,
                         "sessions": self._sessions(r) if r.state != "starting" else None})
        if self._front is not None:
            try:
                front = ray.get(self._front.stats.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - down or restarting: shown so, status must not fail
                front = {}
            self._front_address = front.get("address", self._front_address)  # a restart on port 0 moves it
            rows.append({"replica": "front-door", "pool": "orchestrator", "state": "serving" if front else "unreachable",
                         "address": self._front_address, "node": "-", "resources": "CPU 0",
                         "sessions": sum(front.get("load", {}).get("target", {}).values()) if front else None,
                         "requests": front.get("requests"), "acceptance_rate": front.get("acceptance_rate"),
                         "metrics": front.get("metrics"),
                         "membership": ("current" if self._front_is_current() else "updating") if front else None})
        return rows

    def shutdown(self) -> None:
        """Stops everything. The checkpoint says so first and goes last: a restart in between
        (this call is retried then) finds what is left to stop, and launches nothing."""
        self._stopped.set()
        with self._changed:
            self._stopping = True
            self._save()
            records = list(self._replicas.values())
        if self._front is not None:
            ray.kill(self._front, no_restart=True)
        for record in records:
            self._stop(record)
        with self._changed:
            self._replicas.clear()
            self._bump()
        self._stop_orphans(keep=set())
        internal_kv._internal_kv_del(self._checkpoint_key, namespace=CONTROLLER_NAMESPACE)

    # ---- surviving a restart of this actor -------------------------------------------------------
    @property
    def _checkpoint_key(self) -> str:
        return checkpoint_key(self.spec.name)

    @property
    def _front_name(self) -> str:
        return f"{self.spec.name}-front-door"

    def _rank_name(self, replica_id: str, rank: int) -> str:
        return f"{self.spec.name}-{replica_id}-rank{rank}"

    def _save(self) -> None:
        """Called under the lock on every change a restarted controller must know of."""
        state = {"version": self._version, "wanted": self._wanted, "front_address": self._front_address,
                 "next_id": self._next_id, "stopping": self._stopping, "drained": self._drained,
                 "replicas": [r.saved() for r in self._replicas.values()]}
        internal_kv._internal_kv_put(self._checkpoint_key, json.dumps(state), namespace=CONTROLLER_NAMESPACE)

    def _restore(self) -> None:
        """Adopt what the last incarnation left: serving and draining replicas whose actors all
        live, and the front door. The rest (replicas still starting, or missing a rank) is stopped,
        and ``_reconcile`` launches replacements."""
        raw = internal_kv._internal_kv_get(self._checkpoint_key, namespace=CONTROLLER_NAMESPACE)
        state = json.loads(raw) if raw is not None else {}  # none: it died before its first one
        self._front = self._named_actor(self._front_name)
        if state.get("stopping"):  # it died in ``shutdown``, which its caller retries
            self._stopped.set()
            self._stopping = True
            return
        self._version = state.get("version", 0) + 1  # front doors then fetch the membership afresh
        self._wanted = state.get("wanted", self._wanted)
        self._front_address = state.get("front_address")
        self._drained = state.get("drained", [])
        for saved in state.get("replicas", []):
            record = self._adopt(saved)
            if record is not None:
                self._replicas[record.replica_id] = record
        highest = self._stop_orphans(keep={self._rank_name(r.replica_id, k) for r in self._replicas.values()
                                           for k in range(len(r.actors))})
        # never reuse a name an orphan held: Ray may not have freed it yet
        self._next_id = max(state.get("next_id", 1), highest + 1)
        for record in self._replicas.values():
            if record.state == "draining":
                threading.Thread(target=self._drain_and_stop, args=(record,), daemon=True).start()
        self._event(logging.WARNING, "controller restarted: adopted %s", ", ".join(self._replicas) or "no replica")

    def _adopt(self, saved: dict) -> ReplicaRecord | None:
        actors = [self._named_actor(self._rank_name(saved["replica_id"], k)) for k in range(saved["ranks"])]
        if saved["state"] == "starting" or None in actors:
            return None
        return ReplicaRecord(saved["pool"], saved["replica_id"], actors[0], None, actors[1:],
                             get_placement_group(self._group_name(saved["replica_id"])), saved["state"],
                             saved["address"], saved["node"], saved["resources"])

    def _stop_orphans(self, keep: set[str]) -> int:
        """Stop this deployment's replica actors and placement groups that no record holds: the
        ones a dead incarnation launched after its last checkpoint, or left starting. Returns the
        highest replica number seen, held or not."""
        return stop_replicas_by_name(self.spec.name, keep, {self._group_name(r.replica_id)
                                                            for r in self._replicas.values()})

    def _group_name(self, replica_id: str) -> str:
        return f"{self.spec.name}-{replica_id}"

    @staticmethod
    def _named_actor(name: str):
        return named_actor(name)

    # ---- supervision -----------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stopped.wait(SUPERVISE_EVERY_S):
            try:
                self._promote_started()
                self._replace_dead()
                self._reconcile()
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one bad replica
                log.exception("supervision pass failed")

    def _promote_started(self) -> None:
        with self._changed:
            starting = [r for r in self._replicas.values() if r.state == "starting"]
        for record in starting:
            done, _ = ray.wait([record.ready], timeout=0)
            if not done:
                continue
            try:
                address = ray.get(record.ready)
                node = ray.get(record.actor.node.remote(), timeout=PING_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - a replica that cannot start is replaced
                self._event(logging.ERROR, "%s failed to start: %s", record.replica_id, err)
                self._forget(record)
                with self._changed:
                    self._start_failures[record.pool].add(err)
                    self._changed.notify_all()
                continue
            with self._changed:
                if record.state == "starting":
                    record.address, record.node, record.state = address, node, "serving"
                    self._event(logging.INFO, "%s serves at %s", record.replica_id, address)
                    self._start_failures[record.pool] = StartFailures()
                    self._bump()

    def _event(self, level: int, message: str, *args) -> None:
        log.log(level, message, *args)
        with self._changed:
            self._events.append(message % args)
            if len(self._events) > MAX_EVENTS:  # the oldest go; the count goes on
                self._events_dropped += len(self._events) - MAX_EVENTS
                del self._events[:-MAX_EVENTS]

    def events_since(self, seen: int) -> tuple[int, list[str]]:
        """(events so far, those after the first ``seen``). A count below ``seen`` (a restarted
        controller counts afresh) gives all it holds."""
        with self._changed:
            total = self._events_dropped + len(self._events)
            return total, self._events[max(seen - self._events_dropped, 0):] if seen <= total else list(self._events)

    def _replace_dead(self) -> None:
        with self._changed:
            serving = [r for r in self._replicas.values() if r.state == "serving"]
        for record in serving:
            try:
                ray.get([a.ping.remote() for a in record.actors], timeout=PING_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - dead or wedged: either way it is replaced
                self._event(logging.WARNING, "%s at %s is down (%s); replacing it", record.replica_id,
                            record.address, type(err).__name__)
                self._forget(record)

    def _reconcile(self) -> None:
        """Launch replicas until each pool has the number wanted (starting ones count)."""
        with self._changed:
            if self._stopping:  # a supervision pass racing ``shutdown`` would leave detached replicas behind
                return
            launched = False
            for pool in POOLS:
                active = [r for r in self._replicas.values() if r.pool == pool and r.state != "draining"]
                for _ in range(self._wanted[pool] - len(active)):
                    record = self._launch(pool)
                    self._replicas[record.replica_id] = record
                    launched = True
            if launched:  # once: a checkpoint per replica made a big scale-up quadratic, all under the lock
                self._save()

    def _launch(self, pool: str) -> ReplicaRecord:
        """Every replica is a placement group (1 bundle for a drafter, tp for a target), so the
        state says honestly whether Ray has granted its resources yet."""
        replica_id = f"{pool}-{self._next_id}"
        self._next_id += 1
        ranks, want = self._ranks(pool), self._bundle(pool)
        group = placement_group([want] * ranks, strategy="STRICT_PACK", name=self._group_name(replica_id),
                                lifetime="detached")

        def on(rank: int, cls, *args):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            return ray.remote(cls).options(num_cpus=want.get("CPU", 0), num_gpus=want.get("GPU", 0),
                                           resources={pool: 1}, scheduling_strategy=strategy, max_restarts=0,
                                           max_concurrency=2, name=self._rank_name(replica_id, rank),
                                           namespace=CONTROLLER_NAMESPACE, lifetime="detached").remote(*args)

        described = describe(want) if ranks == 1 else f"{ranks} x ({describe(want)})"
        if pool == "drafter":
            actor = on(0, DrafterReplica, self.spec)
            return ReplicaRecord(pool, replica_id, actor, actor.start.remote(), group=group, resources=described)
        rank0 = on(0, TargetReplica, self.spec)
        followers = [on(rank, TargetFollower, self.spec, rank) for rank in range(1, ranks)]
        rendezvous = rank0.rendezvous.remote() if followers else None
        for follower in followers:
            follower.follow.remote(rendezvous)
        # the ref, not its value: rank 0 starts once its rendezvous call is done (max_concurrency=2
        # lets the two calls run in any order)
        return ReplicaRecord(pool, replica_id, rank0, rank0.start.remote(rendezvous), followers, group,
                             resources=described)

    def _ranks(self, pool: str) -> int:
        return self.spec.tp if pool == "target" else 1

    def _bundle(self, pool: str) -> dict:
        return role_resources(pool, self.spec.target_resources if pool == "target" else self.spec.drafter_resources)

    def _drain_and_stop(self, record: ReplicaRecord) -> None:
        deadline = time.monotonic() + self.spec.drain_timeout_s
        while record.address is not None and time.monotonic() < deadline:
            if self._sessions(record) in (0, None):
                break
            time.sleep(0.2)
        with self._changed:
            self._drained = [*self._drained[-63:], record.replica_id]
        self._forget(record)

    def _forget(self, record: ReplicaRecord) -> None:
        with self._changed:
            if self._replicas.pop(record.replica_id, None) is not None:
                if record.state == "starting":
                    self._save()
                else:
                    self._bump()
        self._stop(record)

    @staticmethod
    def _stop(record: ReplicaRecord) -> None:
        if record.followers:  # release the followers' loop before the processes go
            try:
                ray.get(record.actor.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - killed below anyway
                pass
        for actor in record.actors:
            ray.kill(actor, no_restart=True)
        try:
            remove_placement_group(record.group)
        except Exception:  # noqa: BLE001 - removed already (a supervision pass and shutdown racing)
            pass

    # ---- helpers -----------------------------------------------------------------------------------
    def _bump(self) -> None:
        self._version += 1
        self._save()
        self._changed.notify_all()

    def _members(self) -> dict[str, list[str]]:
        return {pool: [r.address for r in self._replicas.values() if r.pool == pool and r.state == "serving"]
                for pool in POOLS}

    def _serving(self, pool: str) -> bool:
        return self._count(pool, "serving") > 0

    def _count(self, pool: str, state: str) -> int:
        return sum(r.pool == pool and r.state == state for r in self._replicas.values())

    def _pending_summary(self) -> str:
        """Starting replicas by what they wait for: Ray to place them (pending: no node has their
        resources free) or their own start (loading the models)."""
        with self._changed:
            records = [r for r in self._replicas.values() if r.state == "starting"]
            failed = [f"; the {pool} replicas failed to start {f.count} times, the last with: {f.last}"
                      for pool, f in self._start_failures.items() if f.count]
        shown = [(self._shown_state(r), f"{r.replica_id} ({r.resources})") for r in records]
        waits = [f"{state}: " + ", ".join(name for s, name in shown if s == state)
                 for state in ("pending", "starting") if any(s == state for s, _ in shown)]
        return ("; ".join(waits) or "no replica starting") + "".join(failed)

    def _all_serving(self) -> bool:
        return all(self._serving(p) for p in POOLS if self._wanted[p])

    def _refused_pool(self) -> str | None:
        return next((pool for pool in POOLS if self._wanted[pool] and not self._serving(pool)
                     and self._start_failures[pool].refusals >= REFUSALS_BEFORE_GIVING_UP), None)

    @staticmethod
    def _shown_state(record: ReplicaRecord) -> str:
        """Pending: resources not granted yet (what makes the autoscaler add a node of this pool's
        type). Read from the GCS's table: a fresh ``group.ready()`` polled with no wait was not
        resolved yet for a group placed long ago, and a placed replica showed pending at random."""
        if record.state != "starting":
            return record.state
        return "starting" if placement_group_table(record.group).get("state") == "CREATED" else "pending"

    @staticmethod
    def _sessions(record: ReplicaRecord) -> int | None:
        try:
            return ray.get(record.actor.sessions.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - unreachable: unknown
            return None


def _pending_because(record: ReplicaRecord, why: InvalidRequest) -> str:
    return f"{record.replica_id} is pending, as {why}"


def checkpoint_key(deployment: str) -> str:
    """Where the controller of ``deployment`` keeps its state in Ray's internal KV."""
    return f"{deployment}/controller"


def named_actor(name: str):
    try:
        return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def stop_replicas_by_name(deployment: str, keep_actors: set[str] = frozenset(),
                          keep_groups: set[str] = frozenset()) -> int:
    """Kill deployment ``deployment``'s replica actors and remove its placement groups, found by
    their names, but those kept; returns the highest replica number seen. What a controller that
    cannot be asked (dead, or wedged) leaves is found this way too."""
    highest = 0
    replica = rf"{re.escape(deployment)}-(?:{'|'.join(POOLS)})-(\d+)"  # a placement group's name
    rank = re.compile(replica + r"-rank\d+")
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == CONTROLLER_NAMESPACE and (match := rank.fullmatch(actor["name"])):
            highest = max(highest, int(match.group(1)))
            if actor["name"] not in keep_actors and (handle := named_actor(actor["name"])) is not None:
                ray.kill(handle, no_restart=True)
    for info in placement_group_table().values():
        if (match := re.fullmatch(replica, info["name"])) and info["state"] != "REMOVED":
            highest = max(highest, int(match.group(1)))
            if info["name"] not in keep_groups:
                remove_placement_group(get_placement_group(info["name"]))
    return highest
