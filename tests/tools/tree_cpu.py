"""Wall seconds of a command and the CPU seconds (user + sys) of every process it started, also those it
left running (`repack verify` does not join its idle pool workers): this process is a child subreaper,
so every descendant is reaped here and counted in RUSAGE_CHILDREN. Linux only.

    python tests/tools/tree_cpu.py LABEL COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(label: str, command: list[str]) -> str:
    """One line: LABEL, the command's wall, and the user, sys and total CPU seconds of its process tree."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - started
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (f"{label} wall {wall:.2f} user {used.ru_utime:.2f} sys {used.ru_stime:.2f} "
            f"cpu {used.ru_utime + used.ru_stime:.2f}")


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2:]))
