"""What `--executor ray` checks before any work: Ray installed, a cluster's address answering (apart from
``repack.exec.ray_executor``, which imports the pool: the engine checks before it plans)."""

from __future__ import annotations

import importlib.util
import os
import socket

from repack.errors import UsageError

INSTALL_HINT = "--executor ray needs Ray, which is not installed: pip install 'repack[ray]'"


def check_ray(address: str | None) -> None:
    """Fail fast (UsageError) where Ray is not installed, or a host:port ``address`` (else ``RAY_ADDRESS``, which
    the executor joins as well) does not answer (ray.init would retry for minutes)."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(INSTALL_HINT)
    address = address or os.environ.get("RAY_ADDRESS")
    host, sep, port = (address or "").rpartition(":")
    if not sep or "://" in (address or "") or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None
