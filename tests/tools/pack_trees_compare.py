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
import shutil
import sys
from pathlib import Path

from tests.benchmarks.bench_scale import SHARDWRITER_SCRIPT, run_tree, usable_cpus

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
    """Run ``cmd`` (``bench_scale.run_tree``): its wall and CPU seconds, peak summed RSS/PSS (MB), and
    the CPU split it printed."""
    run = run_tree(cmd, quiet_stdout=True, cwd=cwd, env=env)
    split = next((json.loads(line[4:]) for line in run.stderr.splitlines() if line.startswith("CPU {")), {})
    return {"wall_s": round(run.wall, 2), "cpu_s": round(run.cpu, 2), **split,
            "rss_mb": round(run.peak_rss / 1e6), "pss_mb": round(run.peak_pss / 1e6)}


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
