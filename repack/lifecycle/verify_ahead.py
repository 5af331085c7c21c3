"""`repack verify OUT`'s work started before the command line is parsed: the first thing
``python -m repack verify OUT`` does (``repack.__main__``), ahead of the CLI's imports (~0.08 CPU-s of
click, the commands and the verify modules): the sha256 of the tars (``verify_digests``) from the
first ~0.05 CPU-s, then, once numpy and the sinks are imported, the pool of shard checks with its first
round of tasks submitted (``verify_shards.start_ahead``; only when every file of every shard entry is
plainly inside OUT), so that the cores work while the driver is still starting up.

Only the plain local form is taken (``verify OUT`` with ``--json`` and ``--workers N`` in any place,
or ``REPACK_VERIFY_WORKERS``; anything else, ``--version`` (or its variable) and ``--help`` included,
leaves the work to the command). The tars are those
``verify_digests.early_files`` names, found with the stdlib alone: ``OUT/manifest.json`` parsed as JSON
(no validation), and only paths that are plainly relative and resolve inside OUT (a subset of
``safe_join``'s rule: nothing outside OUT is read). The verify that follows reads and validates the
manifest as always and takes these processes over only when it wants exactly the same files on the
same number of processes (``EarlyDigests.start_or_take``, ``verify_shards.check_shards``); otherwise
they are stopped and it starts its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from repack.lifecycle.verify_digests import start_ahead

MANIFEST_BYTES = 64 << 20  # a larger manifest is left to the command
SHARD_FILES = ("path", "index", "checksums", "source_runs")  # the files of a shard entry a check may read


def start_verify_hashing(args: list[str]) -> None:
    """Start hashing the tars of the dataset that ``args`` (what follows ``verify`` on the command line)
    names, when they are the plain local form; never raises for what it does not understand."""
    try:
        found = _out_and_workers(args)
        if found is None:
            return
        out, workers = found
        if workers is None:
            from repack.exec.cpus import available_cpus

            workers = available_cpus()
        root, data, files = tars_to_hash(out)
        if not files or workers <= 1:
            return
        hashing = start_ahead(files, workers)
        if all(_inside(root, shard[name]) for shard in data["shards"] for name in SHARD_FILES if name in shard):
            from repack.lifecycle.verify_shards import start_ahead as start_checks

            start_checks("webdataset", [(str(root), shard) for shard in data["shards"]], hashing.queued, workers)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return  # the command finds and reports whatever this met


def _out_and_workers(args: list[str]) -> tuple[str, int | None] | None:
    """(OUT, --workers or None) of ``verify`` arguments in their plain form; None for anything else."""
    out, workers, rest = None, None, list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--json":
            continue
        if arg == "--workers" and rest and rest[0].isdigit():
            workers = int(rest.pop(0))
        elif arg.startswith("--workers=") and arg[len("--workers="):].isdigit():
            workers = int(arg[len("--workers="):])
        elif arg.startswith("-") or out is not None:
            return None
        else:
            out = arg
    if workers is None and os.environ.get("REPACK_VERIFY_WORKERS", "").isdigit():  # the option's variable
        workers = int(os.environ["REPACK_VERIFY_WORKERS"])
    if out is None or "://" in out or workers == 0 or os.environ.get("REPACK_VERIFY_VERSION"):
        return None
    return out, workers


def tars_to_hash(out: str) -> tuple[Path, dict, list[tuple[int, str, int]]]:
    """(the real root, the manifest's JSON, ``verify_digests.early_files`` of it) for the folder ``out``,
    from the stdlib alone; shards whose paths are not plainly inside ``out`` are left out (the command's
    list then differs, and it hashes on its own)."""
    root = Path(os.path.realpath(out))
    with open(root / "manifest.json", "rb") as fh:
        raw = fh.read(MANIFEST_BYTES + 1)
    if len(raw) > MANIFEST_BYTES:
        return root, {}, []
    data = json.loads(raw)
    if data.get("format") != "webdataset":
        return root, data, []
    files = []
    for number, shard in enumerate(data["shards"]):
        if not shard.get("index"):
            continue
        path = _inside(root, shard["path"])
        if path is not None:
            files.append((number, path, int(shard.get("bytes", 0))))
    return root, data, files


def _inside(root: Path, rel) -> str | None:
    """``root/rel`` as ``safe_join`` spells it, when ``rel`` is a plain relative path that resolves
    inside ``root``; else None."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel or rel.startswith("/"):
        return None
    parts = PurePosixPath(rel).parts
    if any(part in ("..", ".") for part in parts):
        return None
    joined = root.joinpath(*parts)
    real = Path(os.path.realpath(joined))
    if real != root and root not in real.parents:
        return None
    return str(joined)
