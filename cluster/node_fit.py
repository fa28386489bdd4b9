"""Why Ray has not placed a replica: its placement group against what each live node has in all.

A replica whose group fits no node waits for a node that an autoscaler may never add (a cluster
started by hand, or with no node type that big). `serve` waited out --start-timeout (10 minutes)
for one and then blamed --start-timeout, saying the replica was "still starting" (a Ray review).
"""

from __future__ import annotations

from mirrorspec.config import InvalidRequest

# the serve flag that sets each resource a replica asks for, by pool
_FLAGS = {("CPU", "drafter"): "replica_cpus", ("CPU", "target"): "replica_cpus",
          ("GPU", "drafter"): "drafter_gpus", ("GPU", "target"): "target_gpus"}


def group_need(bundle: dict, ranks: int) -> dict:
    """What one node must have in all for a STRICT_PACK group of ``ranks`` bundles."""
    return {name: amount * ranks for name, amount in bundle.items() if amount}


def unplaceable(pool: str, bundle: dict, ranks: int, nodes: list[dict]) -> InvalidRequest | None:
    """None where some live node has, in all, what the group asks for (it waits for that node to
    have it free); else what no node has, naming the setting to change. ``nodes`` is ``ray.nodes()``."""
    need = group_need(bundle, ranks)
    totals = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    if any(all(total.get(name, 0) >= amount for name, amount in need.items()) for total in totals):
        return None
    largest = {name: max((total.get(name, 0) for total in totals), default=0) for name in need}
    short = next((name for name, amount in need.items() if largest[name] < amount), None)
    asked = ", ".join(f"{name} {amount:g}" for name, amount in need.items())
    where = (f"a {pool} replica asks one node for {asked}{_per_rank(ranks)}, and none of the cluster's "
             f"live nodes ({len(totals)}) has that much")
    if short is None:
        return InvalidRequest(f"{where} at once (each has some of it); add a node that has all of it, or ask for less",
                              field="address")
    if short == pool:  # the role resource: nodes meant for this pool say so when they start
        return InvalidRequest(f"{where}: no node offers the {pool!r} resource; start the nodes meant for {pool}s "
                              f"with `ray start --resources '{{\"{pool}\": 4}}'` (cluster/*.yaml do)",
                              field="address")
    flag = "tp" if short == "GPU" and ranks > 1 else _FLAGS[short, pool]
    return InvalidRequest(f"{where}: the largest has {short} {largest[short]:g}; lower --{flag.replace('_', '-')}, "
                          f"or add a node with more {short}", field=flag)


def _per_rank(ranks: int) -> str:
    return f" ({ranks} ranks of --tp, packed together)" if ranks > 1 else ""
