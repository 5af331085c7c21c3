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
from repack.sinks.checks import sha256_file
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


@dataclass(frozen=True)
class _Task:
    """One unit of the pool's work: ``kind`` "whole" (``check_one``), "digest" (the sha256 of the shard's
    main file) or "part" (``part`` of ``parts`` of the format's ``verify_split``) of shard ``shard``
    (its place in the list); ``cost``: the bytes it reads, to start the biggest first."""

    kind: str
    shard: int
    part: int = 0
    parts: int = 0
    cost: int = 0


def _run_task(task: str) -> tuple[str, bytes]:
    """Pool entry point: ``task`` is JSON {kind, root, format, shard, part, parts}; the answer comes back
    as JSON and raw bytes (the key hashes)."""
    args = json.loads(task)
    root, fmt, shard = Path(args["root"]), args["format"], args["shard"]
    if args["kind"] == "digest":
        try:
            return json.dumps(sha256_file(root / shard["path"])), b""
        except OSError:
            return json.dumps(None), b""
    if args["kind"] == "part":
        summary, hashes = get_sink(fmt).verify_split.check(root, shard, args["part"], args["parts"])
        return json.dumps(summary), hashes
    problems, hashes = check_one(root, fmt, shard)
    return json.dumps(problems), hashes


def default_workers() -> int:
    """The usable CPUs (affinity mask and cgroup quota), as the jobs' default ``--workers``."""
    from repack.exec.cpus import available_cpus

    return available_cpus()


def plan_tasks(fmt: str, shards: list[dict]) -> list[_Task]:
    """The first round of tasks, biggest first: each shard whose format splits its check (``verify_split``)
    as a digest task and its parts, any other shard whole."""
    split = getattr(get_sink(fmt), "verify_split", None)
    tasks = []
    for i, shard in enumerate(shards):
        size = int(shard.get("bytes", 0)) + int(shard.get("index_bytes", 0))
        parts = split.parts(shard) if split is not None else 0
        if not parts:
            tasks.append(_Task("whole", i, cost=size))
            continue
        tasks.append(_Task("digest", i, cost=int(shard.get("bytes", 0))))
        tasks += [_Task("part", i, part, parts, size // parts) for part in range(parts)]
    return sorted(tasks, key=lambda task: -task.cost)


def _on_processes(root: str, fmt: str, shards: list[dict], workers: int | None) -> list[tuple[list[str], bytes]]:
    """Each shard checked on a process pool (one thread for one worker): split shards as parts and a
    digest, joined by their format's ``verify_split.passes``; a shard that does not pass, and any shard of a
    format that does not split, checked whole (``check_one``). A task whose process died leaves its shard
    "not checked", never passed."""
    tasks = plan_tasks(fmt, shards)
    workers = min(workers or default_workers(), len(tasks))
    if workers <= 1:
        pool = ThreadPoolExecutor(1)
    else:
        from repack.exec.local import _pool_context

        pool = ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=signal.signal,
                                   initargs=(signal.SIGINT, signal.SIG_IGN))  # Ctrl-C: the driver's to handle

    def submit(task: _Task):
        return pool.submit(_run_task, json.dumps({"kind": task.kind, "root": root, "format": fmt,
                                                  "shard": shards[task.shard], "part": task.part,
                                                  "parts": task.parts}))

    answers: dict[int, list] = {i: [] for i in range(len(shards))}
    died: dict[int, str] = {}

    def collect(pending: list) -> None:
        for task, future in pending:
            try:
                answers[task.shard].append((task, future.result()))
            except BrokenProcessPool as exc:
                died.setdefault(task.shard, f"{shards[task.shard]['path']}: not checked: the process checking it "
                                            f"died ({exc})")

    results: dict[int, tuple[list[str], bytes]] = {}
    try:
        collect([(task, submit(task)) for task in tasks])
        again = []
        for i in range(len(shards)):
            if i in died:
                continue
            got = answers[i]
            whole = [answer for task, answer in got if task.kind == "whole"]
            if whole:
                results[i] = (json.loads(whole[0][0]), whole[0][1])
                continue
            digest = next(json.loads(answer[0]) for task, answer in got if task.kind == "digest")
            parts = [(json.loads(answer[0]), answer[1])
                     for task, answer in sorted(got, key=lambda pair: pair[0].part) if task.kind == "part"]
            if get_sink(fmt).verify_split.passes(shards[i], parts, digest):
                results[i] = ([], b"".join(hashes for _, hashes in parts))
            else:
                answers[i] = []
                again.append(_Task("whole", i))
        pending = []
        for task in again:
            try:
                pending.append((task, submit(task)))
            except BrokenProcessPool as exc:
                died.setdefault(task.shard, f"{shards[task.shard]['path']}: not checked: the process checking "
                                            f"it died ({exc})")
        collect(pending)
        for task in again:
            if task.shard not in died:
                problems, hashes = answers[task.shard][0][1]
                results[task.shard] = (json.loads(problems), hashes)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    for i, message in died.items():
        results[i] = ([message], b"")
    return [results[i] for i in range(len(shards))]


def _on_threads(files, fmt: str, shards: list[dict]) -> list[tuple[list[str], bytes]]:
    """``check_one`` of each shard on ``files.threads`` threads, each shard's files fetched first."""

    def one(shard: dict) -> tuple[list[str], bytes]:
        rels = [shard["path"]] + [shard[side] for side in ("index", "checksums", "source_runs") if shard.get(side)]
        with files.local(rels) as (root, fetch_problems):
            return check_one(root, fmt, shard, fetch_problems)

    with ThreadPoolExecutor(max(1, min(files.threads, len(shards)))) as pool:
        return list(pool.map(one, shards))
