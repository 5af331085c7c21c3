"""`--executor ray` joining a running cluster: the driver's pool starts on the plan's first calls before Ray
answers where the cluster's raylet on this host offers CPUs (``repack.exec.ray_node``, read from the real
raylets' command lines), and never where it offers none (a head started with ``--num-cpus 0``). ``import
ray`` is held 6 s in the driver (an import hook that writes when it ended): the first task's record is written
before it ends (an order, not a time bound: a loaded CI host shifts both), and the dataset equals the local
pool's byte for byte."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import run_repack

pytest.importorskip("ray")

from tests.benchmarks.bench_executors import RAY_ENV, RayHead  # noqa: E402

IMPORT_HOLD_S = 6.0
SLOW_RAY = f'''import importlib.machinery, os, sys, time


class _HoldRay:
    """Holds the execution of package `ray` {IMPORT_HOLD_S} s (finding it is not held: `check_ray` finds it), then
    writes when its import ended to $RAY_IMPORTED (the driver's import; Ray's own workers import it unheld)."""

    def find_spec(self, name, path=None, target=None):
        if name != "ray":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def held(module):
            time.sleep({IMPORT_HOLD_S})
            run(module)
            marker = os.environ.get("RAY_IMPORTED")
            if marker and not os.path.exists(marker):
                with open(marker, "w") as fh:
                    fh.write(repr(time.time()))

        spec.loader.exec_module = held
        return spec


sys.meta_path.insert(0, _HoldRay())
'''


@pytest.fixture(scope="module")
def heads():
    """Two heads on this host: one offering 2 CPUs to tasks, one offering none."""
    with_cpus, without = RayHead("2"), RayHead("0")
    yield with_cpus, without
    for head in (with_cpus, without):  # its `ray start --block` ends its node's processes on SIGTERM, as on ^C
        head.proc.send_signal(signal.SIGTERM)  # (each process signalled at once: up to 10 s of a head's stop)
    for head in (with_cpus, without):
        head.stop()  # what is left, if anything


def test_the_local_raylets_cpus_are_read_per_cluster(heads):
    from repack.exec.ray_node import local_node_cpus

    with_cpus, without = heads
    assert local_node_cpus(with_cpus.address) == 2
    assert local_node_cpus(without.address) == 0  # its raylet lists no CPU: the pool waits for Ray's grant
    assert local_node_cpus("127.0.0.1:1") == 0  # no raylet of that cluster here
    assert local_node_cpus("ray://127.0.0.1:10001") == 0  # Ray Client: the driver is no node


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx")}


def test_the_drivers_pool_starts_before_ray_answers(heads, photo_tree, tmp_path):
    with_cpus, _ = heads
    reference = tmp_path / "local"
    run_repack("images", photo_tree, reference, "--shard-size", "10", "--workers", "2", "--quiet")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_RAY)
    out, imported = tmp_path / "ray", tmp_path / "ray-imported"
    run_repack("images", photo_tree, out, "--shard-size", "10", "--workers", "2", "--quiet", "--executor", "ray",
               "--ray-address", with_cpus.address,
               env={**RAY_ENV, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "RAY_IMPORTED": str(imported)})
    first = min(p.stat().st_mtime for p in (out / ".repack" / "tasks").glob("*.json"))
    ended = float(imported.read_text())
    assert first < ended, (first, ended)  # a task's record was written while `import ray` was still held
    assert shard_bytes(out) == shard_bytes(reference)
    ran = json.loads((out / "manifest.json").read_text())["run"]["tasks_ran"]
    assert ran["driver_pool"] >= 12 and not ran["ray"], ran  # the head's 2 CPUs: the pool's, held from Ray
