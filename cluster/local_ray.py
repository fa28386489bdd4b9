"""Finding the local Ray of a running ``mirrorspec serve`` from another process (``status``,
``scale``, ``stop``). Ray's own ``auto`` takes whichever Ray it finds running on the machine, which need not
be this deployment's. No ray import here: ``use_announced_ray`` must run before Ray's is.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path


def local_ray_file(name: str) -> Path:
    from mirrorspec.models.demo_target import cache_root  # torch comes with it: not at import

    return cache_root() / "deployments" / f"{name}.ray"


@contextlib.contextmanager
def announced_local_ray(name: str, gcs_address: str):
    """Announce this process's local Ray under the deployment's name while it runs, with the
    authentication mode ``ray.init`` chose for it (it sets RAY_AUTH_MODE when it turns tokens on).
    Taken back only while it is still this one's, not another serve's of the same name."""
    path = local_ray_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = json.dumps({"address": gcs_address, "auth_mode": os.environ.get("RAY_AUTH_MODE")})
    path.write_text(mine)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if path.read_text() == mine:
                path.unlink()


def check_name_free(name: str) -> None:
    """A second local-Ray `serve` of a name a running one announced took the announcement over:
    `stop --name` then reached the second, and once it was gone `status` reached whichever Ray Ray's
    ``auto`` found, while the first served on unreachable by name (review 28 of stop 49)."""
    from mirrorspec.config import InvalidRequest

    if (announced := _announced(name)) is not None:
        raise InvalidRequest(f"a deployment named {name!r} already runs on a local Ray on this machine (its Ray at "
                             f"{announced['address']}); stop it first (`mirrorspec stop --name {name}`), or pick "
                             "another --name", field="name")


def use_announced_ray(address: str, name: str) -> str:
    """Where ``address`` is ``auto`` and a running ``serve --name NAME`` announced its local Ray,
    point Ray's ``auto`` at that one (RAY_ADDRESS) with its authentication mode: Ray takes up the
    machine's token for a cluster it finds itself, but for a given address only where
    RAY_AUTH_MODE says so before Ray is imported."""
    if address != "auto" or (announced := _announced(name)) is None:
        return address
    os.environ["RAY_ADDRESS"] = announced["address"]
    if announced["auth_mode"]:
        os.environ.setdefault("RAY_AUTH_MODE", announced["auth_mode"])
    return address


def _announced(name: str) -> dict | None:
    """What a running serve announced under ``name``; None where none did, or where its serve was
    killed before it could take the announcement back (then removed: its Ray no longer answers)."""
    path = local_ray_file(name)
    try:
        announced = json.loads(path.read_text())
        address = announced["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if why_silent(address, timeout_s=2) is not None:
        path.unlink(missing_ok=True)
        return None
    return announced


def why_silent(address: str, timeout_s: float) -> OSError | ValueError | None:
    """Why nothing answers a TCP connect at host:port (None: something does). A Ray address is
    probed so before ray.init, which retries a silent one for minutes."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        return err
    return None
