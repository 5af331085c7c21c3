"""The driver's CPU seconds (``time.process_time``) at each ``os.fork`` of `python -m repack verify OUT ARGS`
(the hashers first, then the pool's workers) and at its end, as one JSON line on stderr: how much of the
driver's start-up the shard work waits for.

    PYTHONPATH=TREE python tests/tools/verify_forks.py OUT [--workers N]
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

forks: list[float] = []


def _hook(event: str, args) -> None:
    if event == "os.fork":
        forks.append(round(time.process_time(), 3))


def _report(*_code) -> None:
    sys.stderr.write(json.dumps({"forks_cpu": forks, "end_cpu": round(time.process_time(), 3)}) + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    import atexit

    sys.addaudithook(_hook)
    leave = os._exit
    os._exit = lambda code: (_report(), leave(code))  # verify leaves through os._exit
    atexit.register(_report)  # a tree whose verify returns normally
    sys.argv = ["repack", "verify", *sys.argv[1:]]
    runpy.run_module("repack", run_name="__main__")
