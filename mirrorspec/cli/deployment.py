"""`mirrorspec scale`, `status` and `stop`: a running deployment, found on its Ray by name."""

from __future__ import annotations

import argparse
import json
import sys
import time

from mirrorspec.cli.flags import check_wait, is_set
from mirrorspec.cli.lifecycle import drain_and_tear_down
from mirrorspec.config import InvalidRequest


def join_deployment_ray(args: argparse.Namespace) -> bool:
    """Joins the Ray that deployment ``--name`` runs on, for `scale`, `status` and `stop`; returns
    whether it is the local Ray a running `serve` announced. Where none was announced and no Ray
    runs here, the deployment is named: a second `stop` blamed an --address nobody gave."""
    from cluster.local_ray import local_ray_file, use_announced_ray

    address = use_announced_ray(args.address, args.name)  # before Ray is imported
    local = address == "auto" and local_ray_file(args.name).exists()
    from cluster.deploy import AutoFindsASilentRay, connect

    try:
        connect(address)
    except InvalidRequest as err:
        if address != "auto" or is_set(args, "address") or isinstance(err, AutoFindsASilentRay):
            raise
        raise InvalidRequest(f"no deployment named {args.name!r} runs on this machine (stopped already?), and no Ray "
                             f"cluster runs here to look for it on; pass --address of the cluster it runs on",
                             field="name") from None
    return local


def cmd_scale(args: argparse.Namespace) -> int:
    from cluster.spec import check_replicas

    check_replicas(args.pool, args.replicas, "replicas")
    check_wait(args.wait, "wait")
    local = join_deployment_ray(args)
    from cluster.deploy import ask_controller

    if local:
        rows = _scaled_on_local_ray(args.name, args.pool, args.replicas, args.wait)
    else:
        rows = ask_controller(args.name, lambda controller: controller.scale.remote(args.pool, args.replicas,
                                                                                    args.wait))
    print(format_status(rows))
    mine = [r for r in rows if r["pool"] == args.pool]
    serving, pending = (sum(r["state"] == state for r in mine) for state in ("serving", "pending"))
    if serving != args.replicas:
        when, why = f" after {args.wait:g} s", "the rest wait for resources (see `ray status`)"
        if local and pending:  # no autoscaler will ever add the node they wait for
            when, why = "", (f"{pending} cannot be placed: a local Ray has no autoscaler, and its CPUs are taken; "
                             f"scale down again, or serve with more --num-cpus or less --replica-cpus")
        print(f"mirrorspec scale: {serving} of {args.replicas} {args.pool} replicas serve{when}; {why}",
              file=sys.stderr)
        return 1  # it exited 0, so a script could not tell its pool short (a review)
    return 0


def _scaled_on_local_ray(name: str, pool: str, replicas: int, wait_s: float, settle_s: float = 3.0) -> list[dict]:
    """A local Ray has no autoscaler: once a pool's only replicas not serving are ones Ray could not
    place (for ``settle_s``, as a new one is placed in a moment), no wait makes them serve. `scale`
    stood silent for all of --wait (300 s) before saying so (review 26 of stop 49)."""
    from cluster.deploy import ask_controller

    rows = ask_controller(name, lambda controller: controller.scale.remote(pool, replicas, 0))
    deadline, unplaced_since = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        states = [r["state"] for r in rows if r["pool"] == pool]
        if states.count("serving") >= replicas and _front_door_routes_current_membership(rows):
            break
        unplaced = "pending" in states and "starting" not in states
        unplaced_since = (unplaced_since or time.monotonic()) if unplaced else None
        if unplaced_since is not None and time.monotonic() - unplaced_since >= settle_s:
            break
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
        rows = ask_controller(name, lambda controller: controller.status.remote())
    return rows


def _front_door_routes_current_membership(rows: list[dict]) -> bool:
    """Whether new replicas already get requests. Not known (None) for a front door that does not
    answer, nor from a controller from before stop 51: no wait for what may never come."""
    return all(r.get("membership") != "updating" for r in rows if r["pool"] == "orchestrator")


def cmd_status(args: argparse.Namespace) -> int:
    join_deployment_ray(args)
    from cluster.deploy import ask_controller

    rows = ask_controller(args.name, lambda controller: controller.status.remote())
    print(json.dumps(rows, indent=2) if args.json else format_status(rows))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """What Ctrl-C does to a `serve` that waits for it, for a deployment that has none (``--detach``)
    or from another shell: the front door refuses new requests, those in flight get
    ``--shutdown-grace`` to finish, then the controller stops every replica and itself. A `serve`
    still waiting on the deployment sees it gone and exits."""
    check_wait(args.shutdown_grace, "shutdown_grace")
    join_deployment_ray(args)
    from cluster.deploy import find_controller

    drain_and_tear_down(args.name, find_controller(args.name), args.shutdown_grace)
    print(f"mirrorspec: deployment {args.name!r} stopped", flush=True)
    return 0


def format_status(rows: list[dict]) -> str:
    columns = ["replica", "pool", "state", "address", "node", "resources", "sessions", "requests", "acceptance_rate"]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    # a URL too wide for a column that every other row leaves empty
    lines += [f"{r['replica']} metrics: {r['metrics']}" for r in rows if r.get("metrics")]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
