"""`repack remove OUT --sources FILE | --keys FILE`: publish a version without some samples.

A sample is named by its source (the ``path`` of its ``.json`` member: the input's path relative to
SOURCE, or ``<shard>/<member>`` for converted datasets) or by its key (the member name before the
first dot). Only the shards holding a named sample are rewritten: their other samples are copied,
member bytes untouched and in order, into a new shard ``<stem>-vN.tar`` (+ its DALI index; a shard
left empty is dropped); every other shard stays as it is. The new version lists the shards in the
same order. The removed bytes stay in the files of older versions until ``repack gc`` deletes the
files no kept version names. Names that match no sample are reported (and recorded in the
version's change), never silently ignored; when none matches nothing is published.

Crash anywhere and re-run: the rewritten shards are deterministic (rewritten again, same bytes) and
the version is published as ``repack.jobs.publish`` says.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from repack.errors import UsageError
from repack.jobs.publish import current_version, locked_dataset, promote_pending, publish
from repack.manifest import Manifest
from repack.manifest.versions import number_of
from repack.sinks.webdataset import TarShardWriter


@dataclass(frozen=True)
class RemoveSpec:
    """What to remove: source paths or sample keys (one kind per run)."""

    out: str
    names: tuple[str, ...]
    by: str  # "sources" or "keys"


@dataclass(frozen=True)
class RemoveResult:
    manifest: dict
    published: bool
    removed: int
    not_found: tuple[str, ...]
    seconds: float


def read_names(path: str) -> tuple[str, ...]:
    """Non-empty lines of a names file (UsageError naming it when unreadable or empty)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            names = tuple(line.rstrip("\n") for line in fh if line.strip())
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    if not names:
        raise UsageError(f"{path!r} names nothing (one source path or key per line)")
    return names


def _samples(path: Path):
    """(key, [(ext, bytes)], source) of every sample of a repack tar shard, in order."""
    from repack.sinks.tar_format import iter_members

    samples: list[tuple[str, list, str | None]] = []
    with open(path, "rb") as fh:
        for member in list(iter_members(fh)):
            fh.seek(member.offset)
            data = fh.read(member.size)
            key, _, ext = member.name.partition(".")
            if not samples or samples[-1][0] != key:
                samples.append((key, [], None))
            samples[-1][1].append((ext, data))
            if ext == "json":
                samples[-1] = (key, samples[-1][1], json.loads(data).get("path"))
    return samples


def remove_samples(spec: RemoveSpec) -> RemoveResult:
    """Publish the version without the named samples (see the module docstring)."""
    started = time.time()
    with locked_dataset(spec.out) as (store, out):  # out: an object store's scratch holds one shard at a time
        current, raw = current_version(store)
        promoted = promote_pending(store, current)
        if promoted is not None:
            current, raw = current_version(store)
        if current["format"] != "webdataset":
            raise UsageError(f"repack remove rewrites webdataset shards; {out} holds {current['format']}")
        number = number_of(current) + 1
        for temp in out.glob(f".*-v{number}.*.tmp-*"):  # a rewrite killed before its rename
            temp.unlink(missing_ok=True)
        manifest = Manifest(out, current)
        wanted = set(spec.names)
        found: set[str] = set()
        shards: list[dict] = []
        rewritten: dict[str, str | None] = {}
        removed_classes: dict[str, int] = {}
        names_by_index = {index: name for name, index in (current.get("classes") or {}).items()}
        for entry in current["shards"]:
            local = manifest.path(entry["path"])
            if store.remote:
                store.fetch(entry["path"], local, entry["sha256"])
            samples = _samples(local)
            if store.remote:
                local.unlink()
            hit = [s for s in samples if (s[0] if spec.by == "keys" else s[2]) in wanted]
            if not hit:
                shards.append(entry)
                continue
            found.update(s[0] if spec.by == "keys" else s[2] for s in hit)
            for _, members, _ in hit:
                cls = dict(members).get("cls")
                name = names_by_index.get(int(cls)) if cls is not None else ""
                removed_classes[name] = removed_classes.get(name, 0) + 1
            stem = entry["path"][:-len(".tar")] + f"-v{number}"
            writer = TarShardWriter(out, stem)
            try:
                for sample in samples:
                    if sample not in hit:
                        writer.add_sample(sample[0], sample[1])
                new = writer.commit()
            except BaseException:
                writer.abort()
                raise
            rewritten[entry["path"]] = new["path"] if new else None
            if new and store.remote:
                store.publish(new["path"], out / new["path"], new["sha256"])
                store.publish(new["index"], out / new["index"])
            if new:
                shards.append({**{k: v for k, v in entry.items() if k not in ("path", "index")}, **new})
        not_found = tuple(sorted(wanted - found))
        if not found:
            return RemoveResult(current, False, 0, not_found, time.time() - started)
        removed = sum(s["samples"] for s in current["shards"]) - sum(s["samples"] for s in shards)
        body = {key: value for key, value in current.items() if key not in ("run", "dataset_version")}
        totals = dict(current["totals"])
        totals.update(samples=sum(s["samples"] for s in shards), bytes=sum(s["bytes"] for s in shards),
                      shards=len(shards), removed=totals.get("removed", 0) + removed)
        stats = dict(current.get("stats", {}))
        counts = dict(stats.get("class_counts", {}))
        for name, n in removed_classes.items():
            if name in counts:
                counts[name] -= n
        if "class_counts" in stats:
            stats["class_counts"] = counts
        body.update(shards=shards, totals=totals, stats=stats,
                    run={"command": "remove", "seconds": round(time.time() - started, 3)})
        change = {"kind": "remove", "by": spec.by, "removed_samples": removed, "rewritten": rewritten,
                  "not_found": list(not_found)}
        data = publish(store, out, current, raw, body, change)
        return RemoveResult(data, True, removed, not_found, time.time() - started)
