"""`repack images SRC OUT --append`: pack only the inputs OUT does not hold yet, publish version N+1.

"Already in the dataset": an input with the same relative path and the same size and mtime as one
planned in an earlier version (``repack.jobs.publish.known_inputs``; an s3:// object: same key and
size). A changed file (same path, other size or mtime) is packed again; a removed one is not.

How (OUT's lock held throughout): an ordinary images job packs the new inputs into a staging
folder ``OUT/.repack/append-vN+1`` (the engine's resume and byte-identity apply: kill -9, re-run,
same bytes), with the dataset's class map (a new class gets the next index, existing indices
never move), its cls width and the next sample positions (keys stay unique). Its shards are then
renamed into OUT as ``shard-vN+1-XXXXXX.tar`` (+ ``.idx``): names no version used, so every
existing shard stays byte-identical and a reader of version N is never disturbed. The record of
known inputs for N+1 is written, then the version (``repack.jobs.publish``). With nothing new
nothing is published.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass

from repack.config import EngineOptions, ImagesSpec
from repack.errors import UsageError
from repack.jobs.base import STATE_DIR, Plan
from repack.jobs.publish import (current_version, inputs_record, known_inputs, locked_dataset, move, plan_inputs,
                                 promote_pending, publish, remove_prefix)
from repack.manifest import MANIFEST_NAME, atomic_write_bytes, dumps_canonical
from repack.manifest.versions import number_of


@dataclass(frozen=True)
class AppendResult:
    """What an append did: the published manifest (the current one when nothing was new)."""

    manifest: dict
    published: bool
    added: int
    seconds: float


def stage_folder(number: int) -> str:
    return f"{STATE_DIR}/append-v{number}"


def append_images(spec: ImagesSpec, options: EngineOptions) -> AppendResult:
    """Append ``spec.source``'s new inputs to the dataset in ``spec.out`` (see the module docstring)."""
    from repack.jobs.engine import Engine
    from repack.jobs.images import ImagesJob

    started = time.time()
    with locked_dataset(spec.out) as (store, out):
        current, current_raw = current_version(store)
        promoted = promote_pending(store, current)
        if promoted is not None:
            return AppendResult(promoted, True, 0, time.time() - started)
        if current["modality"] != "images" or current["format"] != spec.to or spec.to != "webdataset":
            raise UsageError(f"--append adds webdataset shards to an images dataset; {store.url} holds "
                             f"{current['modality']} in {current['format']} (--to {spec.to})")
        number = number_of(current) + 1
        stage = stage_folder(number)
        stale = {rel.split("/")[1] for rel in store.list_sizes(f"{STATE_DIR}/append-v")} | \
            {p.name for p in out.glob(f"{STATE_DIR}/append-v*")}
        for name in stale - {f"append-v{number}"}:  # left by appends that were published
            remove_prefix(store, f"{STATE_DIR}/{name}/")
        known = known_inputs(store, current)
        known_file = out / stage / "known-inputs.json"
        if not known_file.exists():
            known_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(known_file, dumps_canonical(known))
        classes = current.get("classes") or {}
        staged_spec = dataclasses.replace(
            spec, out=f"{store.url}/{stage}/out", known_inputs=str(known_file),
            known_classes=tuple(sorted(classes.items(), key=lambda kv: kv[1])),
            cls_width=len(str(max(classes.values(), default=0))) if classes else None)
        job = ImagesJob(staged_spec)
        if job.store.read_bytes(MANIFEST_NAME) is None:
            from repack.jobs.base import build_plan

            if not build_plan(job).tasks:
                remove_prefix(store, f"{stage}/")
                return AppendResult(current, False, 0, time.time() - started)
            Engine(job, dataclasses.replace(options, overwrite=False, strict=False)).run()
        staged = json.loads(job.store.read_bytes(MANIFEST_NAME))
        plan = Plan.from_json(json.loads(job.store.read_bytes(f"{STATE_DIR}/plan.json")))
        shards = [move_shard(store, f"{stage}/out", shard, number) for shard in staged["shards"]]
        store.put_bytes(inputs_record(number), dumps_canonical(plan_inputs(plan, known)))
        body = merged_manifest(current, staged, shards)
        change = {"kind": "append", "source": spec.source, "added_samples": staged["totals"]["samples"],
                  "added_shards": [s["path"] for s in shards],
                  "quarantined": len(body["quarantine"]) - len(current["quarantine"])}
        data = publish(store, out, current, current_raw, body, change)
        remove_prefix(store, f"{stage}/")
        if store.remote:
            shutil.rmtree(job.store.scratch, ignore_errors=True)  # the staged job's local scratch
        return AppendResult(data, True, staged["totals"]["samples"], time.time() - started)


def move_shard(store, staged: str, shard: dict, number: int) -> dict:
    """Rename a staged shard (and its index) into the dataset under names of version ``number``; its
    manifest entry."""
    renamed = dict(shard)
    for key in ("path", "index"):
        if shard.get(key):
            name = shard[key].replace("shard-", f"shard-v{number}-", 1)
            source = f"{staged}/{shard[key]}"
            if store.size(source) is not None:
                move(store, source, name)
            elif store.size(name) is None:
                raise UsageError(f"staged {source} is gone and {name} is not in {store.url}: remove "
                                 f"{store.url}/{staged.rpartition('/')[0]} and append again")
            renamed[key] = name
    return renamed


def merged_manifest(current: dict, staged: dict, shards: list[dict]) -> dict:
    """Version N+1: N's shards then the new ones; classes extended; totals, quarantine and the simple
    statistics summed (the new inputs' full statistics kept under stats.appended)."""
    known_sources = {q["source"] for q in current["quarantine"]}
    new_quarantine = [q for q in staged["quarantine"] if q["source"] not in known_sources]
    again = len(staged["quarantine"]) - len(new_quarantine)  # quarantined before, planned again: counted once
    all_shards = current["shards"] + shards
    quarantine = current["quarantine"] + new_quarantine
    body = {key: value for key, value in current.items() if key not in ("run", "dataset_version")}
    body.update(shards=all_shards, quarantine=quarantine, classes=staged.get("classes", {}),
                fields=dict(sorted({**current.get("fields", {}), **staged.get("fields", {})}.items())))
    totals = dict(current["totals"])
    totals.update(inputs=totals.get("inputs", 0) + staged["totals"]["inputs"] - again,
                  samples=sum(s["samples"] for s in all_shards), quarantined=len(quarantine),
                  bytes=sum(s["bytes"] for s in all_shards), shards=len(all_shards))
    body["totals"] = totals
    stats = dict(current.get("stats", {}))
    for key in ("formats", "class_counts"):
        merged = dict(stats.get(key, {}))
        for name, count in staged.get("stats", {}).get(key, {}).items():
            merged[name] = merged.get(name, 0) + count
        stats[key] = dict(sorted(merged.items()))
    stats["appended"] = [*stats.get("appended", []), staged.get("stats", {})]
    body["stats"] = stats
    body["run"] = staged.get("run", {})
    return body
