"""The shards of a dataset checked in parallel, each through its format's ``verify_shard``, results in
manifest order whatever order they finish in.

A local folder: a process pool of ``workers`` (default: the usable CPUs, as the jobs' ``--workers``),
one shard a task; only JSON and raw bytes cross the process boundary (the pool's own transport aside).
Processes, not threads: hashing releases the GIL, but the structure checks hold it between their numpy
calls (docs/benchmarks.md has the measurement). An object-store prefix: threads, each
downloading one shard's files with concurrent ranged GETs (``RemoteFiles.local``) and checking them.

Each task also gives back its shard's sample keys, hashed to 8 bytes each (``index_key_hashes``), so
that the uniqueness check of the whole dataset needs no second pass over the indexes.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repack.manifest.paths import PathEscapeError
from repack.sinks import get_sink
from repack.sinks.keys import index_key_hashes


@dataclass(frozen=True)
class ShardsChecked:
    """Per shard, in manifest order: its problems and its sample keys' hashes (uint64; empty where the
    format keeps no webdataset index)."""

    problems: tuple[tuple[str, ...], ...]
    key_hashes: tuple[np.ndarray, ...]


def check_shards(files, manifest, workers: int | None = None) -> ShardsChecked:
    """Every shard of ``manifest`` checked through ``files`` (``LocalFiles`` or ``RemoteFiles``)."""
    shards = manifest.data["shards"]
    escaped = {}
    for i, shard in enumerate(shards):
        try:
            manifest.path(shard["path"])
        except PathEscapeError as exc:
            escaped[i] = ([str(exc)], b"")
    todo = [i for i in range(len(shards)) if i not in escaped]
    if files.remote:
        done = _on_threads(files, manifest.format, [shards[i] for i in todo])
    else:
        done = _on_processes(str(files.root), manifest.format, [shards[i] for i in todo], workers)
    found = dict(escaped)
    found.update(zip(todo, done))
    results = [found[i] for i in range(len(shards))]
    return ShardsChecked(tuple(tuple(problems) for problems, _ in results),
                         tuple(np.frombuffer(raw, dtype=np.uint64) for _, raw in results))


def check_one(root: Path, fmt: str, shard: dict, fetch_problems: list[str] | None = None) -> tuple[list[str], bytes]:
    """One shard's problems (after ``fetch_problems``, those met while fetching it) and its keys' hashes."""
    problems = list(fetch_problems or ())
    get_sink(fmt).verify_shard(root, shard, lambda ok, message: ok or problems.append(message))
    hashes = b""
    if fmt == "webdataset" and shard.get("index"):
        try:
            hashes = index_key_hashes((Path(root) / shard["index"]).read_bytes()).tobytes()
        except OSError:
            pass  # a missing index: verify_shard reported it
    return problems, hashes


def _check_json(task: str) -> tuple[str, bytes]:
    """Pool entry point: ``task`` is JSON {root, format, shard}; the problems come back as JSON."""
    args = json.loads(task)
    problems, hashes = check_one(Path(args["root"]), args["format"], args["shard"])
    return json.dumps(problems), hashes


def default_workers() -> int:
    """The usable CPUs (affinity mask and cgroup quota), as the jobs' default ``--workers``."""
    from repack.exec.cpus import available_cpus

    return available_cpus()


def _on_processes(root: str, fmt: str, shards: list[dict], workers: int | None) -> list[tuple[list[str], bytes]]:
    """``check_one`` of each shard on a process pool (inline for one worker or one shard)."""
    workers = min(workers or default_workers(), len(shards))
    if workers <= 1:
        return [check_one(Path(root), fmt, shard) for shard in shards]
    from repack.exec.local import _pool_context

    tasks = [json.dumps({"root": root, "format": fmt, "shard": shard}) for shard in shards]
    results: list[tuple[list[str], bytes]] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=signal.signal,
                             initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:  # Ctrl-C: the driver's to handle
        futures = [pool.submit(_check_json, task) for task in tasks]
        try:
            for shard, future in zip(shards, futures):
                try:
                    problems, hashes = future.result()
                except BrokenProcessPool as exc:
                    results.append(([f"{shard['path']}: not checked: the process checking it died ({exc})"], b""))
                    continue
                results.append((json.loads(problems), hashes))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results


def _on_threads(files, fmt: str, shards: list[dict]) -> list[tuple[list[str], bytes]]:
    """``check_one`` of each shard on ``files.threads`` threads, each shard's files fetched first."""

    def one(shard: dict) -> tuple[list[str], bytes]:
        rels = [shard["path"]] + [shard[side] for side in ("index", "checksums", "source_runs") if shard.get(side)]
        with files.local(rels) as (root, fetch_problems):
            return check_one(root, fmt, shard, fetch_problems)

    with ThreadPoolExecutor(max(1, min(files.threads, len(shards)))) as pool:
        return list(pool.map(one, shards))
