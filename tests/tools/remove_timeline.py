"""One `repack remove --sources` with a timeline of its phases (seconds since this process started).

    python -m tests.tools.remove_timeline OUT NAMES_FILE

Runs ``remove_samples`` in this process with its main steps wrapped, and prints one JSON line per step
(``{"step", "start", "end"}``) to stderr, then one to stdout: the samples removed, the seconds importing
repack's remove (numpy with it) and the seconds of the remove itself. Whatever ``repack`` is first on
PYTHONPATH runs (an older tree exported with `git archive <commit> repack` and put first compares two
versions); steps an older tree lacks are left out.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time

START = time.perf_counter()
STEPS = [("repack.lifecycle.remove", name) for name in ("current_version", "published_record", "held_spellings",
                                                         "record_removed", "publish")] + \
        [("repack.lifecycle.remove_tar", name) for name in ("wanted_positions", "shard_spans", "_fan_out",
                                                             "_shard_index", "_hits", "copy_kept")]


def _timed(module, name: str):
    """Wrap ``module.name`` to print its step; the function it was."""
    function = getattr(module, name)

    @functools.wraps(function)
    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            print(json.dumps({"step": name, "start": round(began - START, 3),
                              "end": round(time.perf_counter() - START, 3)}), file=sys.stderr, flush=True)
    setattr(module, name, timed)
    return function


def main(argv: list[str]) -> dict:
    out, names_file = argv
    imported = time.perf_counter()
    from repack.lifecycle.remove import RemoveSpec, read_names, remove_samples

    wrapped = []
    for module_name, name in STEPS:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            wrapped.append((module, name, _timed(module, name)))
    names = read_names(names_file)
    began = time.perf_counter()
    try:
        result = remove_samples(RemoveSpec(out=out, names=names, by="sources"))
    finally:  # the modules as they were (a test runs this in a process that goes on)
        for module, name, function in wrapped:
            setattr(module, name, function)
    summary = {"removed": result.removed, "imports_s": round(began - imported, 3),
               "remove_s": round(time.perf_counter() - began, 3)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
