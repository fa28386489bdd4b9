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


def describe(resources: dict) -> str:
    """Resources as `status` and the messages show them: "CPU 1, drafter 1"."""
    return ", ".join(f"{name} {amount:g}" for name, amount in resources.items())


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
    short = [name for name, amount in need.items() if largest[name] < amount]
    asked = describe(need)
    where = (f"a {pool} replica asks one node for {asked}{_per_rank(ranks)}, and none of the cluster's "
             f"live nodes ({len(totals)}) has that much")
    if not short:
        return InvalidRequest(f"{where} at once (each has some of it); add a node that has all of it, or ask for less",
                              field="address")
    sized = [name for name in short if name != pool]  # CPU and GPU, which serve's flags set
    flags = ["tp" if name == "GPU" and ranks > 1 else _FLAGS[name, pool] for name in sized]
    fixes = [f"the largest has {name} {largest[name]:g}: lower --{flag.replace('_', '-')}, or add a node with more "
             f"{name}" for name, flag in zip(sized, flags)]
    if pool in short:  # the role resource: nodes meant for this pool say so when they start
        fixes.append(f"no node offers the {pool!r} resource: start the nodes meant for {pool}s with "
                     f"`ray start --resources '{{\"{pool}\": 4}}'` (cluster/*.yaml do)")
    return InvalidRequest(f"{where}: " + "; ".join(fixes), field=flags[0] if flags else "address")


def _per_rank(ranks: int) -> str:
    return f" ({ranks} ranks of --tp, packed together)" if ranks > 1 else ""
