"""Two code trees' `repack images` against the scale bench's ShardWriter script, in one run.

``python -m tests.tools.pack_trees_compare SRC WORK BEFORE_TREE AFTER_TREE``: for ``--verify none`` and
the default decode check, in this order: the script of ``bench_scale`` (W processes; + a PIL check for the
decode row), then ``repack images SRC OUT --verify LEVEL`` run from each tree (``cwd`` and ``PYTHONPATH`` =
the tree), each once. Per run, one JSON line: wall seconds, CPU seconds of the whole process tree
(``RUSAGE_CHILDREN``), for repack the driver's and the workers' CPU seconds, peaks of the tree's summed
RSS and PSS (``bench_scale.run_tree``'s sampling), and the ratios against the script; then whether both
trees wrote byte-identical shards, indexes and checksum files. SRC: tiny files as ``tiny_files.tiny_jpegs``
makes them.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.benchmarks.bench_scale import SAMPLE_EVERY_S, SHARDWRITER_SCRIPT, memory, tree_pids, usable_cpus

# `python -m repack ...` with the driver's own CPU seconds and its reaped workers' on stderr, last line
CPU_SPLIT = r"""
import atexit, resource, runpy, sys
def report():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("CPU " + '{"driver_cpu_s": %.2f, "workers_cpu_s": %.2f}' % (own.ru_utime + own.ru_stime,
          kids.ru_utime + kids.ru_stime), file=sys.stderr)
atexit.register(report)
sys.argv = ["repack", *sys.argv[1:]]
runpy.run_module("repack", run_name="__main__")
"""


def measured(cmd: list[str], cwd: str, env: dict | None = None) -> dict:
    """Run ``cmd``; its wall and CPU seconds, peak summed RSS/PSS (MB), and the CPU split it printed."""
    os.sync()
    with tempfile.TemporaryFile() as err:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
        peak, done = [0, 0], threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_EVERY_S):
                sizes = [memory(pid) for pid in tree_pids(proc.pid)]
                peak[0] = max(peak[0], sum(r for r, _ in sizes))
                peak[1] = max(peak[1], sum(p for _, p in sizes))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        err.seek(0)
        text = err.read().decode(errors="replace")
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} ... exited {proc.returncode}: {text[-2000:]}")
    split = next((json.loads(line[4:]) for line in text.splitlines() if line.startswith("CPU {")), {})
    return {"wall_s": round(wall, 2), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            **split, "rss_mb": round(peak[0] / 1e6), "pss_mb": round(peak[1] / 1e6)}


def main(src: str, work: str, trees: dict[str, str]) -> None:
    Path(work).mkdir(parents=True, exist_ok=True)
    for level in ("none", "decode"):
        out = os.path.join(work, "script")
        base = measured([sys.executable, "-c", SHARDWRITER_SCRIPT, src, out, str(usable_cpus()),
                         "1" if level == "decode" else "0"], work)
        shutil.rmtree(out)
        print(json.dumps({"run": f"script{' + PIL check' if level == 'decode' else ''}", **base}), flush=True)
        outs = {}
        for name, tree in trees.items():
            outs[name] = os.path.join(work, f"out-{name}-{level}")
            shutil.rmtree(outs[name], ignore_errors=True)
            got = measured([sys.executable, "-c", CPU_SPLIT, "images", src, outs[name], "--verify", level, "--quiet"],
                           tree, {"PYTHONPATH": tree})
            print(json.dumps({"run": f"repack {name} --verify {level}", **got,
                              "wall_ratio": round(base["wall_s"] / got["wall_s"], 3),
                              "cpu_ratio": round(base["cpu_s"] / got["cpu_s"], 3)}), flush=True)
        files = sorted(f for f in os.listdir(outs["before"]) if f.startswith("shard-"))
        same = files == sorted(f for f in os.listdir(outs["after"]) if f.startswith("shard-")) and all(
            Path(outs["before"], f).read_bytes() == Path(outs["after"], f).read_bytes() for f in files)
        print(json.dumps({"run": f"--verify {level}: shard files of both trees", "files": len(files),
                          "byte_identical": same}), flush=True)
        for path in outs.values():
            shutil.rmtree(path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], {"before": sys.argv[3], "after": sys.argv[4]})
