"""Where a command's CPU goes over time: its process tree sampled from /proc, beside the bare tokenizer script.

    python -m tests.tools.cpu_timeline [--every S] [--bucket S] [--label L] [--cwd DIR] -- CMD ...

Runs CMD, reads every ``--every`` seconds (default 0.05) the CPU ticks of each process of its tree
(``/proc/PID/stat``: user and system apart) and prints one JSON line: wall seconds, the tree's user and
system CPU-seconds, minor faults and context switches (``RUSAGE_CHILDREN``), the root process's own CPU
(a job's driver) and its children's, the seconds its threads waited runnable for a CPU (``schedstat``: more
runnable threads than CPUs), and a timeline: per ``--bucket`` seconds (default 0.5) the CPUs in
use (CPU-seconds over the bucket's seconds), the root's share of them, and the processes alive. A
process's ticks after its last sample are not in the timeline (the totals from rusage hold them).

``BARE_TIMED`` is the scale bench's bare tokenizer script (``bench_scale.TOKENIZE_SCRIPT``) with the
seconds its processes spent in ``encode_batch_fast`` and in reading files added to its output, so that a
`repack text` run's ``run.tokenize_seconds`` (its workers' seconds in ``encode_batch``) has a counterpart:
``python -m tests.tools.cpu_timeline -- python -c "$(python -c 'from tests.tools.cpu_timeline import
BARE_TIMED; print(BARE_TIMED)')" TOKENIZER SRC 16``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

from tests.benchmarks.bench_scale import TOKENIZE_SCRIPT, tree_pids

TICK = os.sysconf("SC_CLK_TCK")

BARE_TIMED = TOKENIZE_SCRIPT.replace(
    "    tokens = 0\n",
    "    import time\n    tokens, encode_s, read_s = 0, 0.0, 0.0\n").replace(
    "        docs = []\n",
    "        docs = []\n        t0 = time.perf_counter()\n").replace(
    "        tokens += sum(",
    "        t1 = time.perf_counter()\n        encoded = tok.encode_batch_fast(docs)\n"
    "        t2 = time.perf_counter()\n        read_s += t1 - t0\n        encode_s += t2 - t1\n"
    "        tokens += sum(").replace(
    "for e in tok.encode_batch_fast(docs))\n    return tokens\n",
    "for e in encoded)\n    return tokens, encode_s, read_s\n").replace(
    '        print(json.dumps({"tokens": sum(pool.map(count,',
    '        got = pool.map(count,').replace(
    "                                                          for r in range(workers)]))}))\n",
    "                                                          for r in range(workers)])\n"
    '        print(json.dumps({"tokens": sum(g[0] for g in got), "encode_seconds": round(sum(g[1] for g in got), 3),'
    ' "read_seconds": round(sum(g[2] for g in got), 3)}))\n')
if BARE_TIMED.count("encode_s") < 3:  # the bench's script changed shape: say so rather than time something else
    raise RuntimeError("tests.tools.cpu_timeline: BARE_TIMED no longer matches bench_scale.TOKENIZE_SCRIPT")


def _ticks(pid: int) -> tuple[int, int] | None:
    """(user, system) clock ticks of one process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]), int(fields[12])


def _thread_waits(pid: int) -> dict[int, tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable but waiting for one)} of one process (``/proc/PID/task/TID/schedstat``)."""
    got: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return got
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                on_cpu, waiting = fh.read().split()[:2]
        except (OSError, ValueError):
            continue
        got[int(tid)] = (int(on_cpu), int(waiting))
    return got


def run(cmd: list[str], every: float = 0.05, bucket: float = 0.5, cwd: str | None = None) -> dict:
    """Run ``cmd`` (from ``cwd``: a tree's ``python -m repack`` is the one in its working directory) and measure
    it (see the module docstring)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=cwd)
    last: dict[int, int] = {}
    timeline: dict[int, list[float]] = {}  # bucket -> [cpu ticks, root's ticks, processes seen]
    root = [0, 0]
    threads: dict[int, tuple[int, int]] = {}  # thread id -> its last (on CPU, waiting) ns
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every):
            slot = timeline.setdefault(int((time.perf_counter() - started) / bucket), [0, 0, 0])
            pids = tree_pids(proc.pid)
            slot[2] = max(slot[2], len(pids))
            for pid in pids:
                got = _ticks(pid)
                if got is None:
                    continue
                total = got[0] + got[1]
                slot[0] += total - last.get(pid, 0)
                if pid == proc.pid:
                    slot[1] += total - last.get(pid, 0)
                    root[:] = got
                last[pid] = total
                threads.update(_thread_waits(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"cmd": " ".join(map(str, cmd))[:160], "rc": proc.returncode, "wall_s": round(wall, 3),
            "user_s": round(user, 2), "sys_s": round(system, 2),
            "root_user_s": round(root[0] / TICK, 2), "root_sys_s": round(root[1] / TICK, 2),
            "children_cpu_s": round(user + system - (root[0] + root[1]) / TICK, 2),
            "threads_seen": len(threads), "runqueue_wait_s": round(sum(w for _, w in threads.values()) / 1e9, 2),
            "minflt": after.ru_minflt - before.ru_minflt,
            "vol_switches": after.ru_nvcsw - before.ru_nvcsw, "invol_switches": after.ru_nivcsw - before.ru_nivcsw,
            "timeline": [[round(b * bucket, 2), round(t / TICK / bucket, 1), round(r / TICK / bucket, 2), int(n)]
                         for b, (t, r, n) in sorted(timeline.items())],
            "stdout_tail": stdout.decode(errors="replace")[-400:]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.05)
    parser.add_argument("--bucket", type=float, default=0.5)
    parser.add_argument("--label", default="")
    parser.add_argument("--cwd", default=None, help="run CMD from this folder")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    got = {"label": args.label, **run(cmd, args.every, args.bucket, args.cwd)}
    print(json.dumps(got), flush=True)
    return got


if __name__ == "__main__":
    main()
