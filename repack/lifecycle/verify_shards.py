"""The shards of a dataset checked in parallel, each through its format's ``verify_shard``, results in
manifest order whatever order they finish in.

``workers`` processes (default: the usable CPUs, as the jobs' ``--workers``; this process for one
worker) run small tasks, biggest first, so that no single shard bounds the wall (for a folder, forked
for each round and leaving as it runs dry, their exits never waited for: ``verify_pool``): a shard whose
format splits its check (``verify_split``: webdataset tars) is a digest task (the sha256 of its tar,
sequential by nature) and parts of its index checked against the tar (``tar_check.check_part``); any
other shard is one task (``check_one``). A split shard that does not pass is checked again whole, which
names its problems with the messages of ``verify_shard``. A task whose process died leaves its shard
"not checked: the process checking it died", never passed. Only JSON and raw bytes cross the process
boundary (the pool's own transport aside). Processes, not threads: hashing releases the GIL, but the
structure checks hold it between their numpy calls.

An object-store prefix: ``RemoteFiles.threads`` shards at a time are downloaded into local temporary
folders with concurrent ranged GETs (``RemoteFiles.local``, written to disk at their offsets, never
held whole in memory), their tasks run on the same pool as soon as they arrive, and each folder is
removed once its shard is checked.

Each shard also gives back its sample keys, hashed to 8 bytes each, so that the uniqueness check of the
whole dataset needs no second pass over the indexes.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from repack.lifecycle.verify_digests import Died, EarlyDigests

from repack.manifest.paths import PathEscapeError
from repack.sinks import get_sink
from repack.sinks.checks import sha256_file
from repack.sinks.keys import index_key_hashes

DATASET_FACTS = "dataset_facts"  # the key under which a shard entry carries its format's ``verify_facts``
# one shard's problems, its key hashes (uint64 bytes) and its [class index, samples] pairs (a tar shard that
# passed in parts, with .cls members; else None)
Checked = tuple[list[str], bytes, "list[list[int]] | None"]


@dataclass(frozen=True)
class ShardsChecked:
    """Per shard, in manifest order: its problems, its sample keys' hashes (uint64, in no set order: a
    split shard's are its parts' sorted runs; empty where the format keeps no webdataset index) and its
    [class index, samples] pairs (``tar_check.PartCheck.classes``; None where not counted)."""

    problems: tuple[tuple[str, ...], ...]
    key_hashes: tuple[np.ndarray, ...]
    classes: tuple = ()


def check_shards(files, manifest, workers: int | None = None, early: EarlyDigests | None = None) -> ShardsChecked:
    """Every shard of ``manifest`` checked through ``files`` (``LocalFiles`` or ``RemoteFiles``); ``early``:
    the tars already being hashed (``verify_digests``), whose digest tasks are not run again."""
    shards = manifest.data["shards"]
    facts_of = getattr(get_sink(manifest.format), "verify_facts", None)
    facts = facts_of(manifest.data) if facts_of is not None else None
    if facts:  # what a shard's check needs to know of the whole dataset
        shards = [{**shard, DATASET_FACTS: facts} for shard in shards]
    escaped = {}
    for i, shard in enumerate(shards):
        try:
            manifest.path(shard["path"])
        except PathEscapeError as exc:
            escaped[i] = ([str(exc)], b"", None)
    todo = [i for i in range(len(shards)) if i not in escaped]
    if todo:
        get_sink(manifest.format)  # imported before the workers fork: they inherit it
        with _Pool(workers, files.remote) as pool:
            if files.remote:
                done = _fetched_then_checked(pool, files, manifest.format, [shards[i] for i in todo])
            else:
                number = {shard: i for i, shard in enumerate(todo)}
                queued = early.queued if early is not None else frozenset()
                done = pool.check(manifest.format, [(str(files.root), shards[i]) for i in todo],
                                  frozenset(number[i] for i in queued if i in number),
                                  lambda: {number[i]: d for i, d in early.collect().items() if i in number})
    found = dict(escaped)
    found.update(zip(todo, done if todo else []))
    results = [found[i] for i in range(len(shards))]
    return ShardsChecked(tuple(tuple(problems) for problems, _, _ in results),
                         tuple(np.frombuffer(raw, dtype=np.uint64) for _, raw, _ in results),
                         tuple(classes for _, _, classes in results))


def check_one(root: Path, fmt: str, shard: dict, fetch_problems: list[str] | None = None) -> Checked:
    """One shard's problems (after ``fetch_problems``, those met while fetching it) and its keys' hashes."""
    problems = list(fetch_problems or ())
    get_sink(fmt).verify_shard(root, shard, lambda ok, message: ok or problems.append(message))
    hashes = b""
    if fmt == "webdataset" and shard.get("index"):
        try:
            hashes = index_key_hashes((Path(root) / shard["index"]).read_bytes()).tobytes()
        except OSError:
            pass  # a missing index: verify_shard reported it
    return problems, hashes, None


def default_workers() -> int:
    """The usable CPUs (affinity mask and cgroup quota), as the jobs' default ``--workers``."""
    from repack.exec.cpus import available_cpus

    return available_cpus()


@dataclass(frozen=True)
class Task:
    """One unit of the pool's work on shard number ``shard`` (of the list given to ``plan_tasks``):
    ``kind`` "whole" (``check_one``), "digest" (the sha256 of the shard's main file) or "part" (``part``
    of ``parts`` of its format's ``verify_split``); ``cost``: the bytes it reads, to start the biggest first."""

    kind: str
    shard: int
    part: int = 0
    parts: int = 0
    cost: int = 0


def plan_tasks(fmt: str, shards: list[dict], digested: frozenset[int] = frozenset(),
               actual: list[int | None] | None = None) -> list[Task]:
    """The first round of tasks, biggest first: each shard whose format splits its check
    (``verify_split``) as a digest task (none for the shard numbers in ``digested``: their sha256 is
    known) and its parts, any other shard whole. ``actual``: each shard's main file's real size, which
    bounds its parts (a manifest declaring 10^30 samples plans no more parts than its file can hold)."""
    split = getattr(get_sink(fmt), "verify_split", None)
    tasks = []
    for i, shard in enumerate(shards):
        size = int(shard.get("bytes", 0)) + int(shard.get("index_bytes", 0))
        parts = split.parts(shard, actual[i] if actual else None) if split is not None else 0
        if not parts:
            tasks.append(Task("whole", i, cost=size))
            continue
        if i not in digested:
            tasks.append(Task("digest", i, cost=int(shard.get("bytes", 0))))
        tasks += [Task("part", i, part, parts, size // parts) for part in range(parts)]
    return sorted(tasks, key=lambda task: -task.cost)


def run_task(task: str) -> tuple[str, bytes]:
    """Pool entry point: ``task`` is JSON {kind, root, format, shard, part, parts}; the answer comes back
    as JSON and raw bytes (key hashes)."""
    args = json.loads(task)
    root, fmt, shard = Path(args["root"]), args["format"], args["shard"]
    if args["kind"] == "digest":
        try:
            return json.dumps(sha256_file(root / shard["path"])), b""
        except OSError:
            return json.dumps(None), b""  # missing: the whole check names it
    if args["kind"] == "part":
        summary, hashes = get_sink(fmt).verify_split.check(root, shard, args["part"], args["parts"])
        return json.dumps(summary), hashes
    problems, hashes, _ = check_one(root, fmt, shard)
    return json.dumps(problems), hashes


class _Pool:
    """The processes checking shards and the two rounds of tasks of a list of shards. A local dataset:
    each round on processes forked for it (``verify_pool.run_tasks``: they leave as the round runs
    dry, nobody waits for their exit); an object store, whose shards arrive one by one from download
    threads, or a caller running other threads (a fork would copy their locks mid-step): one
    ``ProcessPoolExecutor`` for the whole check (``exec.local._pool_context``: forkserver then).
    One worker: in this process."""

    def __init__(self, workers: int | None, remote: bool = False) -> None:
        from repack.exec.reap import only_thread

        self.workers = workers or default_workers()
        self.executor = None
        pool = remote or not (self.workers <= 1 or hasattr(os, "fork") and only_thread())
        if pool and self.workers <= 1:
            self.executor = ThreadPoolExecutor(1)
        elif pool:  # shards arriving from download threads, or threads alive that a fork would copy mid-step
            from concurrent.futures import ProcessPoolExecutor  # not imported for a local dataset: ~40 ms

            from repack.exec.local import _pool_context

            self.executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=_pool_context(),
                                                initializer=signal.signal,  # Ctrl-C: the driver's to handle
                                                initargs=(signal.SIGINT, signal.SIG_IGN))
            self.executor.submit(int).result()  # the workers start now, before any download thread does

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self.executor is None:
            return
        if kind is None:
            self.executor.shutdown()
        else:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def check(self, fmt: str, shards: list[tuple[str, dict]], known: frozenset[int] = frozenset(),
              digests: Callable[[], dict[int, str | None | Died]] = dict) -> list[Checked]:
        """Each (root, shard entry) checked: the planned tasks, then the whole check of every split shard
        that did not pass. ``known``: the shard numbers whose main file's sha256 comes from elsewhere,
        ``digests()`` gives it once the first round is done (None: unreadable; ``Died``: its process died)."""
        entries = [shard for _, shard in shards]
        sizes = [_file_size(root, shard) for root, shard in shards]
        answers = self._run(fmt, shards, plan_tasks(fmt, entries, known, sizes))
        outside = digests() if known else {}
        results: dict[int, Checked] = {}
        again = []
        for i, shard in enumerate(entries):
            got = answers[i]
            if isinstance(got, str):
                results[i] = ([got], b"", None)
            elif got and got[0][0].kind == "whole":
                results[i] = _whole(got[0][1])
            elif isinstance(outside.get(i), Died):
                results[i] = ([f"{shard['path']}: not checked: the process checking it died (its sha256: "
                               f"{outside[i].reason})"], b"", None)
            else:
                passed = _passed(fmt, shard, got, outside[i] if i in outside else _TASK)
                if passed is None:
                    again.append(Task("whole", i))
                else:
                    results[i] = ([], *passed)
        for i, got in self._run(fmt, shards, again).items():
            results[i] = ([got], b"", None) if isinstance(got, str) else _whole(got[0][1])
        return [results[i] for i in range(len(entries))]

    def _run(self, fmt: str, shards: list[tuple[str, dict]], tasks: list[Task]) -> dict[int, list | str]:
        """{shard number: [(task, answer)] of its tasks, or the message "not checked" when a process
        running one of them died}."""
        answers: dict[int, list | str] = {task.shard: [] for task in tasks}
        orders = []
        for task in tasks:
            root, shard = shards[task.shard]
            orders.append(json.dumps({"kind": task.kind, "root": root, "format": fmt, "shard": shard,
                                      "part": task.part, "parts": task.parts}))
        for task, answer in zip(tasks, self._answers(orders)):
            if isinstance(answer, Died):
                answers[task.shard] = _died(shards[task.shard][1], answer.reason)
            elif not isinstance(answers[task.shard], str):
                answers[task.shard].append((task, answer))
        return answers

    def _answers(self, orders: list[str]) -> list[tuple[str, bytes] | Died]:
        """``run_task`` of each order: on processes forked for them, or on the pool of an object store."""
        if self.executor is None:
            from repack.lifecycle.verify_pool import run_tasks

            return run_tasks(orders, run_task, self.workers)
        from concurrent.futures.process import BrokenProcessPool

        found: list[tuple[str, bytes] | Died] = []
        pending = []
        for order in orders:
            try:
                pending.append(self.executor.submit(run_task, order))
            except BrokenProcessPool as exc:
                pending.append(Died(str(exc)))
        for future in pending:
            try:
                found.append(future if isinstance(future, Died) else future.result())
            except BrokenProcessPool as exc:
                found.append(Died(str(exc)))
        return found


def _file_size(root: str, shard: dict) -> int | None:
    """The real size of a shard's main file (None when missing or unreadable)."""
    try:
        return os.stat(Path(root) / shard["path"]).st_size
    except (OSError, ValueError):
        return None


def _whole(answer: tuple[str, bytes]) -> Checked:
    """A "whole" task's answer: its problems (JSON) and key hashes."""
    return json.loads(answer[0]), answer[1], None


def _died(shard: dict, reason: str) -> str:
    return f"{shard['path']}: not checked: the process checking it died ({reason})"


_TASK = object()  # a shard's digest comes from its digest task


def _passed(fmt: str, shard: dict, got: list, digest: str | None | object = _TASK) -> tuple | None:
    """(the key hashes, the samples per class index or None) of a split shard whose digest (``digest``, else
    its digest task's) and parts pass its format's ``verify_split``; None when it does not pass (no verdict:
    check it whole)."""
    if digest is _TASK:
        digest = next(json.loads(answer[0]) for task, answer in got if task.kind == "digest")
    parts = [(json.loads(answer[0]), answer[1])
             for task, answer in sorted(got, key=lambda pair: pair[0].part) if task.kind == "part"]
    split = get_sink(fmt).verify_split
    if not split.passes(shard, parts, digest):
        return None
    return b"".join(hashes for _, hashes in parts), split.classes(parts)


def _fetched_then_checked(pool: _Pool, files, fmt: str, shards: list[dict]) -> list[Checked]:
    """Each shard's files downloaded into a temporary folder (``files.threads`` shards at a time), then
    checked on ``pool``, the sha256 computed while downloading standing for the digest task; the folder
    removed once its shard is checked."""

    def one(shard: dict) -> Checked:
        rels = [shard["path"]] + [shard[side] for side in ("index", "checksums", "source_runs") if shard.get(side)]
        with files.fetched(rels) as (root, fetch_problems, digests):
            known = {0: digests[shard["path"]]} if shard["path"] in digests else {}
            (problems, hashes, classes), = pool.check(fmt, [(str(root), shard)], frozenset(known), lambda: known)
            return fetch_problems + problems, hashes, classes

    with ThreadPoolExecutor(max(1, min(files.threads, len(shards)))) as threads:
        return list(threads.map(one, shards))
