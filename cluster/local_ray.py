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
    authentication mode ``ray.init`` chose for it (it sets RAY_AUTH_MODE when it turns tokens on)."""
    path = local_ray_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"address": gcs_address, "auth_mode": os.environ.get("RAY_AUTH_MODE")}))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def use_announced_ray(address: str, name: str) -> str:
    """Where ``address`` is ``auto`` and a running ``serve --name NAME`` announced its local Ray,
    point Ray's ``auto`` at that one (RAY_ADDRESS) with its authentication mode: Ray takes up the
    machine's token for a cluster it finds itself, but for a given address only where
    RAY_AUTH_MODE says so before Ray is imported."""
    path = local_ray_file(name)
    if address != "auto" or not path.exists():
        return address
    announced = json.loads(path.read_text())
    if not _answers(announced["address"]):  # its serve was killed before it could take this back
        path.unlink(missing_ok=True)
        return address
    os.environ["RAY_ADDRESS"] = announced["address"]
    if announced["auth_mode"]:
        os.environ.setdefault("RAY_AUTH_MODE", announced["auth_mode"])
    return address


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True
