"""The CPUs a Ray cluster's node on this host offers tasks, read from its raylet's command line, before Ray answers.

``import ray`` takes 0.25 s on 2 cores and 0.8-1.5 s on a 16-core storage node, then joining and Ray's grant of
the driver's CPUs follow (``repack.exec.driver_share``). Whether the driver's node runs tasks at all is known
sooner: every Ray node on a host is a ``raylet`` process started with ``--static_resource_list=...,CPU,N,...``
(no ``CPU`` entry: ``ray start --num-cpus 0``, the usual head of a cluster that keeps tasks off it) and
``--gcs-address=HOST:PORT``. Where every raylet of the cluster on this host offers CPUs, the driver's pool may
start on the plan's first calls while Ray is still joining; anything unclear (no raylet found, another user's
process, Ray Client's ``ray://``, a raylet whose arguments read otherwise) says nothing, and the pool waits for
Ray's grant as before.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def local_node_cpus(address: str | None) -> int:
    """CPUs for tasks that the cluster at ``address`` (``host:port``; None: ``RAY_ADDRESS``, else any cluster on
    this host) offers on this host: the fewest over its raylets here, 0 where one offers none or none is seen."""
    address = address or os.environ.get("RAY_ADDRESS") or ""
    if "://" in address:
        return 0  # Ray Client: the driver is not a node
    port = address.rpartition(":")[2] if ":" in address else ""
    offered = [cpus for gcs, cpus in _raylets() if not port or gcs.rpartition(":")[2] == port]
    return int(min(offered)) if offered else 0


def _raylets() -> list[tuple[str, float]]:
    """(GCS address, CPUs offered) of each raylet process this user can see."""
    found = []
    try:
        entries = list(PROC.iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "raylet":
                continue
            args = (entry / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        parsed = _raylet_args(args)
        if parsed is not None:
            found.append(parsed)
    return found


def _raylet_args(args: list[str]) -> tuple[str, float] | None:
    """(GCS address, CPUs) from a raylet's arguments; None where either is not there as expected."""
    gcs = resources = None
    for arg in args:
        if arg.startswith("--gcs-address=") and gcs is None:
            gcs = arg.partition("=")[2]
        elif arg.startswith("--static_resource_list="):
            resources = arg.partition("=")[2].split(",")
    if not gcs or resources is None or len(resources) % 2:
        return None
    listed = dict(zip(resources[::2], resources[1::2]))
    try:
        return gcs, float(listed.get("CPU", 0))
    except ValueError:
        return None
