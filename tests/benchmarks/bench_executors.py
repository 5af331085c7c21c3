"""Issue 6/29 benchmark: the same `repack images` job on the local process pool vs Ray.

Ray is measured three ways: started by the job itself (cold, `--executor ray`), joined by the job
(`ray start --head` first, then `--ray-address`), which is how a cluster runs it, and joined with
`--ray-driver-cpus 0` (every task a Ray task: no pool on the driver's node, as before that option).
Same worker count everywhere (the usable CPUs, or REPACK_BENCH_EXECUTOR_WORKERS); ratios are against the
local pool measured in the same run, REPACK_BENCH_REPEATS times each (the median counts), the
executors taking turns so that a noisy neighbour hits each alike; besides wall time, the CPU seconds
each job cost (the driver, its pool, and on a joined cluster the head's processes meanwhile: raylet,
GCS, Ray workers), which other work on the machine barely changes. The Ray head this bench starts
runs in a session of its own with its own temp folder, and only that session is stopped.

REPACK_BENCH_EXECUTOR_BASELINE_TREE=DIR (another checkout, e.g. `git archive` of main): a second head
whose Ray workers import repack from DIR, joined by DIR's driver in the same rounds
(``ray_joined_cluster_baseline``): before/after under the same load. REPACK_BENCH_EXECUTOR_SOURCE=DIR
packs the image folder DIR instead of the bench's photos, with repack's default shard size (the scale
bench's tiny files: `bench-out/scale-data/jpg-1000000`).
"""

from __future__ import annotations

import filecmp
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from repack.exec.cpus import available_cpus
from tests.benchmarks.bench_images import make_dataset

IMAGES = int(os.environ.get("REPACK_BENCH_IMAGES") or 4000)
SOURCE = os.environ.get("REPACK_BENCH_EXECUTOR_SOURCE")  # an image folder to pack instead (default shard size)
WORKERS = str(int(os.environ.get("REPACK_BENCH_EXECUTOR_WORKERS") or available_cpus()))
REPEATS = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
RAY_ENV = {"RAY_AUTH_MODE": "token"}  # Ray >= 2.5x clusters started by `ray start` use token auth; the driver opts in
ROOT = Path(__file__).resolve().parents[2]  # this checkout: its drivers and its head's Ray workers import repack from here
BASELINE = os.environ.get("REPACK_BENCH_EXECUTOR_BASELINE_TREE")  # another checkout, joined to a head of its own


TICKS = os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_env(tree: Path | str) -> dict:
    """The environment of a process that imports repack from ``tree``."""
    return {**os.environ, **RAY_ENV, "PYTHONPATH": str(tree)}


def _repack(*args: str, head: "RayHead | None" = None, tree: Path | str = ROOT) -> tuple[float, float]:
    """Wall seconds and CPU seconds of one job: the driver and its pool (reaped children), plus on a
    joined cluster what the head's processes spent meanwhile (raylet, GCS, the Ray workers: sampled
    every 0.1 s while the job runs, as the raylet does not account its reaped workers)."""
    cpu = _children_cpu()
    before = head.cpu_by_pid() if head else {}
    seen = dict(before)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            seen.update(head.cpu_by_pid())

    sampler = threading.Thread(target=sample, daemon=True)
    if head:
        sampler.start()
    started = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "repack", *args], check=True, capture_output=True,
                       env=_tree_env(tree), cwd=tree)
        wall = time.perf_counter() - started
        if head:
            time.sleep(0.5)  # the job's Ray workers leave once their driver left
    finally:
        done.set()
    if head:
        sampler.join()
        seen.update(head.cpu_by_pid())
    ray_cpu = sum(ticks - before.get(pid, 0) for pid, ticks in seen.items()) / TICKS
    return wall, _children_cpu() - cpu + ray_cpu


def _same_dataset(a: Path, b: Path) -> bool:
    """Every shard and index of ``a`` and ``b`` byte-identical (the manifest differs in its run section)."""
    names = sorted(p.name for p in a.iterdir() if p.is_file() and p.name != "manifest.json")
    return names == sorted(p.name for p in b.iterdir() if p.is_file() and p.name != "manifest.json") and \
        all(filecmp.cmp(a / name, b / name, shallow=False) for name in names)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _comm(pid: int) -> str:
    """A process's name, "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class RayHead:
    """`ray start --head --block` in a session of its own (its raylet, GCS and workers with it); its Ray
    workers import repack from ``tree``."""

    def __init__(self, cpus: str, tree: Path | str = ROOT) -> None:
        ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        self.temp = tempfile.mkdtemp(prefix="rb-")  # short: Ray's socket paths must fit 107 bytes
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}",
                                      "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp}"],
                                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=_tree_env(tree), cwd=tree)
        deadline = time.time() + 120
        while not self._ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("ray start --head did not come up")
            time.sleep(0.2)
        time.sleep(2.0)  # its idle workers prestarted, as on a cluster that has been up a while

    def _ready(self) -> bool:
        """Its GCS answers and its raylet runs (on a loaded host the raylet starts seconds after the GCS)."""
        host, port = self.address.split(":")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return False
        return any(_comm(pid) == "raylet" for pid in self.session())

    def cpu_by_pid(self) -> dict[int, int]:
        """{pid: CPU ticks so far} of the head's processes (an exited one's are in its stat until reaped)."""
        found = {}
        for pid in self.session(zombies=True):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[pid] = int(fields[11]) + int(fields[12])  # utime, stime
        return found

    def session(self, zombies: bool = False) -> list[int]:
        """The processes of the head's session (Ray workers leave its process group, not its session)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid and (zombies or fields[0] != "Z"):
                found.append(int(stat.parent.name))
        return found

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.session():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 10
            while self.session() and time.time() < deadline:
                time.sleep(0.2)
        self.proc.wait()
        shutil.rmtree(self.temp, ignore_errors=True)


def main(out_dir: str | os.PathLike) -> dict:
    if SOURCE:  # e.g. the scale bench's tiny files: packed as that bench packs them
        src, common = Path(SOURCE).absolute(), ["--workers", WORKERS, "--quiet"]
    else:
        src = make_dataset(Path(out_dir).absolute() / "images-data", IMAGES)  # the same photos as bench_images
        common = ["--shard-size", "100", "--workers", WORKERS, "--quiet"]
    out_dir = Path(out_dir).absolute() / "executors"  # absolute: the jobs run in the tree they import
    runs: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    head = RayHead(WORKERS)
    baseline = RayHead(WORKERS, BASELINE) if BASELINE else None

    def timed(name: str, *extra: str, joined: RayHead | None = None, tree: Path | str = ROOT) -> None:
        out = out_dir / name
        shutil.rmtree(out, ignore_errors=True)
        wall, cpu = _repack("images", str(src), str(out), *common, *extra, head=joined, tree=tree)
        runs.setdefault(name, []).append(wall)
        cpus.setdefault(name, []).append(cpu)

    try:
        for _ in range(REPEATS):
            timed("local")
            timed("ray_joined_cluster", "--executor", "ray", "--ray-address", head.address, joined=head)
            timed("ray_joined_workers_only", "--executor", "ray", "--ray-address", head.address,
                  "--ray-driver-cpus", "0", joined=head)  # every task a Ray task, no pool on the driver's node
            if baseline:
                timed("ray_joined_cluster_baseline", "--executor", "ray", "--ray-address", baseline.address,
                      joined=baseline, tree=BASELINE)
    finally:
        head.stop()
        if baseline:
            baseline.stop()
    timed("ray_started_by_job", "--executor", "ray")
    results = {name: statistics.median(times) for name, times in runs.items()}
    cpu = {name: statistics.median(times) for name, times in cpus.items()}
    cpu.pop("ray_started_by_job")  # not measured: the instance's daemons and workers are not all reaped by the driver
    names = ("ray_started_by_job", "ray_joined_cluster", "ray_joined_workers_only") + (("ray_joined_cluster_baseline",) if baseline else ())
    same = all(_same_dataset(out_dir / "local", out_dir / n) for n in names)
    images = json.loads((out_dir / "local" / "manifest.json").read_text())["totals"]["samples"]
    print(f"\n## executors: {images} images from {src}, --verify decode, {WORKERS} workers, {os.cpu_count()} cores, "
          f"median of {REPEATS} (Ray started by the job: 1 run)")
    print("| executor | seconds | images/s | time vs local pool | CPU seconds | CPU vs local pool | runs (s) |\n"
          "|---|---|---|---|---|---|---|")
    for name, seconds in results.items():
        cpu_cells = f"{cpu[name]:.2f} | {cpu[name] / cpu['local']:.2f}x" if name in cpu else "- | -"
        print(f"| {name} | {seconds:.2f} | {images / seconds:.0f} | {seconds / results['local']:.2f}x | {cpu_cells} | "
              f"{', '.join(f'{t:.2f}' for t in runs[name])} |")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"outputs byte-identical across executors: {same}")
    return {"images": images, "workers": int(WORKERS), "seconds": results, "runs": runs, "cpu_seconds": cpu,
            "load_average": os.getloadavg()[0], "identical": same, "ratios": {k: round(v / results["local"], 3) for k, v in results.items()},
            "cpu_ratios": {k: round(v / cpu["local"], 3) for k, v in cpu.items()}}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
