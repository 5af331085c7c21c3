"""`repack images SRC OUT --append`: pack only the inputs OUT does not hold yet, publish version N+1.

"Already in the dataset": an input with the same relative path and the same size and mtime as one
planned in an earlier version, or the same content where only the mtime differs (an s3:// object: same
key, size and ETag, or the same content where only the ETag differs); a source `repack remove` took down is never packed again; a changed file with a sample is
refused by name (``repack.lifecycle.input_record``).

How (OUT's lock held throughout): an ordinary images job packs the new inputs into a staging
folder ``OUT/.repack/append-vN+1`` (the engine's resume and byte-identity apply: kill -9, re-run,
same bytes), with the dataset's class map (a new class gets the next index, existing indices
never move), its cls width and the next sample positions (keys stay unique). Version N's record is that
job's input, handed over in memory (``held_known``) and read while its folder walk runs on the pool:
only the new inputs are planned, checked and packed. Its shards are then
renamed into OUT as ``shard-vN+1-XXXXXX.tar`` (+ ``.idx``): names no version used, so every
existing shard stays byte-identical and a reader of version N is never disturbed. The record of
known inputs for N+1 is written, then the version (``repack.lifecycle.publish``). With nothing new
nothing is published. New inputs that are all quarantined are not an empty dataset (exit 7 is for a
new one): version N+1 holds N's shards and adds their quarantine records, so the manifest names every
input SOURCE held, and the next append does not plan them again until they change.

`repack text --append`: the new files' parts become ``NAME-vN+1.bin/.idx``. `repack video --append`
(a dataset made with --transcode, same --to/--target/--dali-reader): the staged job writes the new videos
under ``videos-vN+1/`` (so the names inside its tar shards are final; a changed video never overwrites
the old one) with the dataset's recorded ``codec``: the legacy reader's one codec is reused, not decided
again from the new videos alone; ``probe-vN+1.jsonl`` and ``file_list-vN+1.txt`` hold N's lines then
the new videos'.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from repack.config import EngineOptions
from repack.errors import ConfinementError, NothingPackedError, StrictModeError, UsageError
from repack.exec.cpus import available_cpus
from repack.jobs.base import STATE_DIR, Plan, read_plan
from repack.lifecycle.input_columns import InputColumns
from repack.lifecycle.input_record import (KnownInputs, append_delta, dataset_record, dropped_copies, held_known,
                                            published_digests)
from repack.lifecycle.record_child import ChildRecord, record_parts
from repack.lifecycle.publish import (changeable_version, locked_dataset, move, promote_pending, publish,
                                      refuse_names_in_use, remove_prefix, warner, write_inputs_record)
from repack.manifest import MANIFEST_NAME
from repack.manifest.duplicate_groups import file_name as groups_file_name
from repack.manifest.quarantine_records import expand as expand_quarantine
from repack.manifest.paths import PathEscapeError, no_links_below
from repack.manifest.versions import number_of
from repack.sources.base import copy_base
from repack.sinks.checks import bytes_digest


@dataclass(frozen=True)
class AppendResult:
    """What an append did: the published manifest (the current one when nothing was new)."""

    manifest: dict
    published: bool
    added: int
    seconds: float
    removed_skipped: int = 0  # sources `repack remove` took down, found in SOURCE again and left out


def names_a_copy(record: dict) -> bool:
    """A quarantine record of another copy of a packed input under the packed one's own name, as repack wrote it
    before such copies were named apart (``tar_shards.again_name``): a tar's second member of one name, a list
    row naming a listed file again. Its name holds a sample: never planned again as a quarantined input."""
    reason = str(record.get("reason", ""))  # a text list's repeated row: "listed twice: read once" (older repack)
    return reason.startswith("listed twice") or (reason.startswith("second '") and " member of sample " in reason)


def planned_once(job, plan: Plan):
    """``job`` whose ``plan()`` returns ``plan``: the append planned it to see whether anything is new, and
    the engine would otherwise scan SOURCE and select the new inputs a second time."""
    job.plan = lambda: plan
    return job


def staged_alike(job) -> bool:
    """Whether the staged job in ``job``'s OUT was run with ``job``'s SOURCE and options (an append killed
    after its stage finished is published by the re-run only when that re-run asks for the same append)."""
    from repack.jobs.engine import options_fingerprint, read_json

    state = read_json(job.store, f"{STATE_DIR}/job.json")
    return state is not None and state.get("options_sha256") == options_fingerprint(job)


def stage_folder(number: int) -> str:
    return f"{STATE_DIR}/append-v{number}"


@dataclass(frozen=True)
class Appender:
    """What differs between modalities: which datasets accept the append, the job that packs the new
    inputs, how its shard names become version N's, and how two manifests merge."""

    accepts: Callable[[dict, object], str | None]  # (current manifest, spec) -> why not, or None
    staged_job: Callable[[object, str, Path, dict], object]  # (spec, staged OUT, known-inputs key, current)
    rename: Callable[[str, object, int], str]  # (staged file name, spec, version) -> name in the dataset
    # (current, staged, renamed shards, quarantined sources planned again) -> version N+1's body
    merge: Callable[[dict, dict, list[dict], frozenset], dict]
    # (store, staged job's store, staged folder, current, staged, version) -> more of N+1's body (side files)
    side_files: Callable[[object, object, str, dict, dict, int], dict] | None = None
    change_note: Callable[[dict], dict] | None = None  # (current) -> more of the change record
    # (current, staged manifest) -> why the staged inputs cannot join the dataset, or None; checked before anything
    # staged is moved in (a refused staged job is discarded: the append run again with the right options restages)
    staged_refusal: Callable[[dict, dict], str | None] | None = None
    # (store, OUT, current) -> of some recorded rels, those without a sample and without a quarantine record (a
    # text file that gave no document): a changed one is packed, not refused (``InputColumns.sampleless_of``)
    sampleless: Callable[[object, Path, dict], Callable[[list[str]], set[str]]] | None = None


def append(spec, options: EngineOptions) -> AppendResult:
    """Append ``spec.source``'s new inputs to the dataset in ``spec.out`` (see the module docstring)."""
    from repack.jobs.engine import Engine, UnresumableJob

    if options.num_nodes > 1:  # the partitions would each stage and publish a version of their own
        raise UsageError("--append cannot be combined with --num-nodes: an append runs on one node (with "
                         "--executor ray for more machines)")
    appender = APPENDERS[type(spec).__name__]
    started = time.time()
    with locked_dataset(spec.out) as (store, out):
        current, current_raw = changeable_version(store)
        promoted = promote_pending(store, current, warner(options.log_json))
        if promoted is not None:  # a writer killed between its two writes (any writer: a remove too): its version
            current, current_raw = changeable_version(store)  # is the latest now, and this append goes on from it
        refusal = appender.accepts(current, spec)
        if refusal is not None:
            raise UsageError(f"--append: {store.url} {refusal}")
        # the record is derived in a forked child from here on, while the staged job is set up and SOURCE walked
        parts = record_parts(available_cpus())
        record = ChildRecord(lambda: dataset_record(store, current, digests=False, parts=parts),
                             lambda columns, rows: published_digests(store, current, columns, rows))
        try:
            number = number_of(current) + 1
            stage = stage_folder(number)
            stale = {rel.split("/")[1] for rel in store.list_sizes(f"{STATE_DIR}/append-v")} | \
                {p.name for p in out.glob(f"{STATE_DIR}/append-v*")}
            for name in stale - {f"append-v{number}"}:  # left by appends that were published
                remove_prefix(store, f"{STATE_DIR}/{name}/")
            # the staged job's input, held in memory and read while its scan runs (held_known); the key keeps the
            # name of the file it once was, so a staged job killed under an older repack resumes with the same options
            known_key = out / stage / "known-inputs.npz"
            # the inputs without a sample: quarantined whole (a record of one line of a text file leaves the
            # file's other documents in the dataset: it is a packed file, compared as any other, unless the file
            # gave no document: "no_documents", repack.jobs.text)
            unpacked = list(dict.fromkeys(q["source"] for q in current["quarantine"]
                                          if (q.get("line") is None or q.get("no_documents")) and not names_a_copy(q)))
            first_source = str(((current.get("created_by") or {}).get("options") or {}).get("source") or "")
            copies, copy_prints = dropped_copies(current, store)
            known = KnownInputs(record, unpacked, first_source.startswith("s3://"),
                                appender.sampleless(store, out, current) if appender.sampleless else None,
                                copies, copy_prints)
            try:  # a link planted there would stage (and overwrite) outside OUT
                no_links_below(out, f"{stage}/out")
            except PathEscapeError as exc:
                raise ConfinementError(f"{store.url}: refused {stage}/out: {exc}") from None
            job = appender.staged_job(spec, f"{store.url}/{stage}/out", known_key, current)
            if job.store.read_bytes(MANIFEST_NAME) is not None and not staged_alike(job):
                remove_prefix(store, f"{stage}/")  # a finished stage of another SOURCE or options: not this append's
            if job.store.read_bytes(MANIFEST_NAME) is None:
                from repack.jobs.base import build_plan

                with held_known(str(known_key), known):
                    planned = build_plan(job)
                planned = without_held(planned, known.staged_input())
                held_records = {q["source"] for q in current["quarantine"]}
                # a copy named apart that an older repack recorded under the packed name is recorded already
                older_copies = {q["source"] for q in current["quarantine"] if names_a_copy(q)}
                if not planned.tasks and not planned.info.get("dedup") and \
                        all(q["source"] in held_records or copy_base(q["source"]) in older_copies
                            for q in planned.quarantine):
                    # nothing new (published: a pending version was, the re-run of a killed append); a new input
                    # quarantined while planning (a hard link to a packed file) is new, and so is a new copy --dedup
                    # leaves out: N+1 records them
                    remove_prefix(store, f"{stage}/")
                    return AppendResult(current, promoted is not None, 0, time.time() - started,
                                        planned.info.get("removed_skipped", 0))
                try:
                    staged_options = dataclasses.replace(options, overwrite=False, strict=False)
                    try:
                        Engine(planned_once(job, planned), staged_options).run()
                    except UnresumableJob:  # staged by another repack, of another SOURCE or with other options, and
                        # killed: it published nothing, so it is staged again from what SOURCE holds now
                        Engine(planned_once(job, planned), dataclasses.replace(staged_options, overwrite=True)).run()
                except NothingPackedError:  # every new input quarantined: the dataset is not empty, and version
                    pass                    # N+1 records them (same shards), as every version records its inputs
            known = known.record()
            if store.remote:  # the staged job wrote its shards through a store object of its own
                store.forget_listing()
            staged = expand_quarantine(json.loads(job.store.read_bytes(MANIFEST_NAME)), job.store.read_bytes,
                                       job.store.url)
            refusal = appender.staged_refusal(current, staged) if appender.staged_refusal is not None else None
            if refusal is not None:
                remove_prefix(store, f"{stage}/")
                raise UsageError(f"--append: {refusal}; nothing was changed")
            added = added_records(current["quarantine"], staged["quarantine"])
            if options.strict and added:  # the staged job ran without --strict: refused before anything moves
                remove_prefix(store, f"{stage}/")  # (SOURCE may be mended before the next try: planned again then)
                named = "; ".join(f"{q['source']}: {q['reason']}" for q in added[:3]) + \
                    (f"; and {len(added) - 3} more" if len(added) > 3 else "")
                raise StrictModeError(f"--strict: the append would quarantine {len(added)} new input(s) ({named}); "
                                      f"nothing was published or moved, {store.url} is unchanged; mend them, or "
                                      "re-run without --strict to publish them as quarantined")
            plan = read_plan(job.store)
            refuse_names_in_use(store, current, [appender.rename(shard[key], spec, number) for shard in staged["shards"]
                                                 for key in ("path", "index", "checksums", "source_runs")
                                                 if shard.get(key)], "--append")
            shards = [move_shard(store, f"{stage}/out", shard, lambda rel: appender.rename(rel, spec, number))
                      for shard in staged["shards"]]
            delta = append_delta(job.store, plan, known)
            write_inputs_record(store, number, known, delta)
            replanned = planned_again(plan, known, unpacked, copies)
            body = appender.merge(current, staged, shards, replanned)
            body["totals"] = counted_once(body["totals"], known, replanned, copies)
            if appender.side_files is not None:
                body.update(appender.side_files(store, job.store, f"{stage}/out", current, staged, number))
            change = {"kind": "append", "source": spec.source, "added_samples": staged["totals"]["samples"],
                      "added_shards": [s["path"] for s in shards],
                      "quarantined": len(added_records(current["quarantine"], body["quarantine"])),
                      "removed_skipped": plan.info.get("removed_skipped", 0),
                      **(appender.change_note(current) if appender.change_note is not None else {})}
            data = publish(store, out, current, current_raw, body, change, warner(options.log_json))
            remove_prefix(store, f"{stage}/")
            if store.remote:
                shutil.rmtree(job.store.scratch, ignore_errors=True)  # the staged job's local scratch
            return AppendResult(data, True, staged["totals"]["samples"], time.time() - started,
                                plan.info.get("removed_skipped", 0))
        finally:
            record.close()


def added_records(held: list[dict], records: list[dict]) -> list[dict]:
    """Those of ``records`` (a staged job's quarantine, or version N+1's) that version N's ``held`` records do not
    hold (by source and line): the append's own, whatever N's records it dropped (inputs packed now)."""
    known = {(q["source"], q.get("line")) for q in held}
    return [q for q in records if (q["source"], q.get("line")) not in known]


def without_held(plan: Plan, known: InputColumns) -> Plan:
    """``plan`` less the quarantine records of inputs the dataset holds a sample of (a packed file gone from a list
    file's folder, a hard link made to a packed copy of the same bytes, a packed file replaced by a FIFO): the
    dataset keeps its sample, and such a record beside it would make the next append take the input for one without
    a sample and pack it a second time. A held input's later content is compared as any other's."""
    from repack.lifecycle.input_columns import encode_names

    if not plan.quarantine:
        return plan
    held = known.holds_sample(encode_names([q["source"] for q in plan.quarantine])).tolist()
    if not any(held):
        return plan
    kept = tuple(q for q, has in zip(plan.quarantine, held) if not has)
    info = {**plan.info, "inputs": plan.info["inputs"] - sum(held)} if "inputs" in plan.info else plan.info
    return dataclasses.replace(plan, quarantine=kept, info=info)


def move_shard(store, staged: str, shard: dict, rename: Callable[[str], str]) -> dict:
    """Rename a staged shard (and its side files: index, checksums, source runs) into the dataset
    (``rename``: its name there); its manifest entry."""
    renamed = dict(shard)
    for key in ("path", "index", "checksums", "source_runs"):
        if shard.get(key):
            name = rename(shard[key])
            source = f"{staged}/{shard[key]}"
            if store.size(source) is not None:
                move(store, source, name)
            elif store.size(name) is None:
                raise UsageError(f"staged {source} is gone and {name} is not in {store.url}: remove "
                                 f"{store.url}/{staged.rpartition('/')[0]} and append again")
            renamed[key] = name
    if "prefix" in shard:  # text: the Megatron prefix of the renamed .bin/.idx
        renamed["prefix"] = renamed["path"][:-len(".bin")]
    return renamed


def planned_again(plan: Plan, record: InputColumns, quarantined: list[str], dropped: Iterable[str] = ()) -> frozenset:
    """The inputs of version N that the staged job's ``plan`` planned again: inputs without a sample that changed
    (a fixed file; the selection refuses any other known input), ``quarantined`` (quarantined while planning
    too: never in ``record``) or in the record (a text file that gave no document), and ``dropped`` copies
    (--dedup) whose content changed, packed now or left out again as a copy of another sample. Their old
    quarantine records go; the staged job counts and records them now."""
    import numpy as np

    from repack.lifecycle.first_record import plan_inputs
    from repack.lifecycle.input_columns import decode_names, encode_names

    names = plan_inputs(plan, 0).names
    dropped = set(dropped)
    dropped_again = {rel for group in plan.info.get("dedup", ()) for rel in group["paths"][1:] if rel in dropped}
    if not len(names):
        return frozenset(dropped_again)
    found = record.find(names)[1] if len(record) else np.zeros(len(names), bool)
    if quarantined or dropped:
        found |= np.isin(names, encode_names([*quarantined, *dropped]))
    return frozenset(decode_names(names[found])) | dropped_again


def counted_once(totals: dict, record: InputColumns, replanned: frozenset, dropped: Iterable[str] = ()) -> dict:
    """``totals`` of version N+1 without version N's count of the inputs the staged job planned again: a text
    dataset's ``files`` and ``input_bytes`` (their recorded sizes; none recorded for one quarantined while
    planning) and the ``dropped`` copies among them in ``duplicates_dropped`` count each file once, as a fresh
    pack's do (``inputs``: ``merged_totals``)."""
    if not replanned:
        return totals
    from repack.lifecycle.input_columns import encode_names

    rows, found = record.find(encode_names(sorted(replanned)))  # one quarantined while planning has no row
    counted = dict(totals)
    if "duplicates_dropped" in counted:
        counted["duplicates_dropped"] -= len(replanned & set(dropped))
    if "files" in counted:  # a file read for documents has a row; one quarantined unread was not a file read
        counted["files"] -= int(found.sum()) if len(record) else 0
    if "input_bytes" in counted:
        counted["input_bytes"] -= int(record.size[rows[found]].sum()) if len(record) else 0
    return counted


def merged_totals(current: dict, staged: dict, shards: list[dict], quarantine: list[dict], again: int) -> dict:
    """Every count of both versions summed; samples, shards and quarantined recounted."""
    totals = dict(current["totals"])
    for key, value in staged["totals"].items():
        if isinstance(value, int) and isinstance(totals.get(key, 0), int):
            totals[key] = totals.get(key, 0) + value
    totals["inputs"] = totals.get("inputs", 0) - again
    totals.update(samples=sum(s["samples"] for s in shards), quarantined=len(quarantine))
    if "shards" in totals:
        totals["shards"] = len(shards)
    if "parts" in totals:
        totals["parts"] = len(shards)
    return totals


def merged_manifest(current: dict, staged: dict, shards: list[dict], replanned: frozenset = frozenset()) -> dict:
    """Version N+1: N's shards then the new ones; totals, quarantine and the simple statistics summed
    (the new inputs' full statistics kept under stats.appended). ``replanned``: N's quarantined sources that
    the staged job planned again; their records are the staged job's now (none where it packed them)."""
    renamed = {copy_base(q["source"]) for q in staged["quarantine"]} - {None}  # copies named apart now: an
    kept = [q for q in current["quarantine"] if q["source"] not in replanned  # older repack's record of one goes
            and not (q["source"] in renamed and names_a_copy(q))]
    kept_sources = {q["source"] for q in kept}
    new_quarantine = [q for q in staged["quarantine"] if q["source"] not in kept_sources]
    # inputs both versions counted: quarantined before and again, or planned again (packed or not)
    again = len(({q["source"] for q in staged["quarantine"]} & {q["source"] for q in current["quarantine"]})
                | replanned)
    all_shards = current["shards"] + shards
    quarantine = kept + new_quarantine
    body = {key: value for key, value in current.items() if key not in ("run", "dataset_version")}
    body.update(shards=all_shards, quarantine=quarantine,
                fields=dict(sorted({**current.get("fields", {}), **staged.get("fields", {})}.items())),
                totals=merged_totals(current, staged, all_shards, quarantine, again))
    if "classes" in staged:
        body["classes"] = staged["classes"]
    stats = dict(current.get("stats", {}))
    for key in ("formats", "class_counts", "dali_misreads"):
        if key in stats or key in staged.get("stats", {}):
            merged = dict(stats.get(key, {}))
            for name, count in staged.get("stats", {}).get(key, {}).items():
                merged[name] = merged.get(name, 0) + count
            stats[key] = dict(sorted(merged.items()))
    stats["appended"] = [*stats.get("appended", []), staged.get("stats", {})]
    body["stats"] = stats
    body["run"] = staged.get("run", {})
    return body


def text_staged_refusal(current: dict, staged: dict) -> str | None:
    """Why staged tokens cannot join a text dataset: another tokenizer or token dtype, or documents that would
    start or end otherwise (the EOS/BOS ids and flags: every document of a dataset ends alike)."""
    if staged["tokenizer"].get("sha256") != current.get("tokenizer", {}).get("sha256") or \
            staged.get("dtype") != current.get("dtype"):
        return ("the new inputs were tokenized with another tokenizer or token dtype than the dataset's; append "
                "with the dataset's tokenizer")
    ends = {key: (current.get("tokenizer", {}).get(key), staged["tokenizer"].get(key))
            for key in ("append_eos", "add_bos", "eos_id", "bos_id", "template_special_tokens")}
    differ = [f"{key} {new!r} (the dataset: {old!r})" for key, (old, new) in ends.items() if old != new]
    if differ:
        return (f"the new documents would start or end otherwise than the dataset's: {', '.join(differ)}; append "
                "with the dataset's --eos-token/--bos-token")
    return None


def merged_text_manifest(current: dict, staged: dict, shards: list[dict], replanned: frozenset = frozenset()) -> dict:
    """A text version N+1: the shards' prefixes listed after N's, Megatron's weighted --data-path too."""
    body = merged_manifest(current, staged, shards, replanned)
    body["prefixes"] = [s["prefix"] for s in body["shards"]]
    body["data_path"] = " ".join(f"{s['tokens']} {s['prefix']}" for s in body["shards"])
    return body


def _images_accepts(current: dict, spec) -> str | None:
    if current["modality"] != "images" or current["format"] != "webdataset" or spec.to != "webdataset":
        return (f"holds {current['modality']} in {current['format']}; --append adds webdataset shards to a "
                "webdataset images dataset")
    held = (current.get("created_by") or {}).get("options") or {}
    # what a sample's bytes are (normalized or as found, their size and quality), whether a content is packed
    # once, and what an input must pass to be packed (the check, the size caps, where a link may point): the new
    # samples are the dataset's kind (a mix of 16 px and 32 px images was published, the manifest saying 16; an
    # undecodable JPEG was packed by --verify none into a dataset whose manifest says decode), and how the new
    # samples are ordered (--shuffle, --seed: the manifest names the dataset's); a dataset of older
    # manifests without these options is not compared
    compared = ["normalize", "dedup", "verify", "max_pixels", "max_file_size", "allow_outside_source",
                "follow_symlinks", "shuffle"] + (["max_side", "quality"] if spec.normalize or held.get("normalize") else [])
    if spec.shuffle and held.get("shuffle"):  # the order of the new samples (the manifest says the dataset's seed)
        compared.append("seed")
    differ = _options_differ(held, spec, compared)
    return f"was packed with other options: {', '.join(differ)}; append with the dataset's" if differ else None


SIZE_OPTIONS = ("max_file_size", "max_doc_bytes")  # options given as sizes: shown in bytes


def _flag(name: str, value) -> str:
    """An option's value as its flag reads."""
    if name == "follow_symlinks":  # its flag is the negation
        return "without --no-follow-symlinks" if value else "--no-follow-symlinks"
    flag = f"--{name.replace('_', '-')}"
    if name in SIZE_OPTIONS and isinstance(value, int):
        return f"{flag} {value}B"
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}" if value is not None else f"no {flag}"


def _options_differ(held: dict, spec, names: list[str]) -> list[str]:
    """Each of ``names`` whose value in ``spec`` is not the dataset's (``held``, its first run's options), in words;
    an option an older manifest does not record is not compared."""
    held = {**held, "seed": abs(held["seed"])} if isinstance(held.get("seed"), int) else held  # Python's shuffle
    return [f"{_flag(name, getattr(spec, name))} (the dataset: {_flag(name, held[name])})"  # seeds with |seed|:
            for name in names if name in held and held[name] != getattr(spec, name)]  # -1 packed as 1 (--seed >= 0)


def _images_job(spec, out: str, known_file: Path, current: dict):
    from repack.jobs.images import ImagesJob

    classes = current.get("classes") or {}
    return ImagesJob(dataclasses.replace(
        spec, out=out, known_inputs=str(known_file), known_classes=tuple(sorted(classes.items(), key=lambda kv: kv[1])),
        cls_width=len(str(max(classes.values(), default=0))) if classes else None,
        sample_json="json" in current.get("fields", {}), duplicates_file=groups_file_name(number_of(current) + 1)))


def _images_side_files(store, staged_store, staged: str, current: dict, new: dict, number: int) -> dict:
    """The staged job's file of duplicate groups (``duplicates-vN.groups``, when its report lists fewer groups
    than it found) moved into the dataset beside N's; the manifest's ``files`` and ``file_digests`` name both."""
    if not new.get("files"):
        return {}
    for name in new["files"].values():
        if store.size(f"{staged}/{name}") is not None:
            move(store, f"{staged}/{name}", name)
        elif store.size(name) is None:  # moved by a run killed before it published, else lost
            raise UsageError(f"staged {staged}/{name} is gone and {name} is not in {store.url}: remove "
                             f"{store.url}/{staged.rpartition('/')[0]} and append again")
    return {"files": {**current.get("files", {}), **new["files"]},
            "file_digests": {**current.get("file_digests", {}), **new.get("file_digests", {})}}


def _text_accepts(current: dict, spec) -> str | None:
    if current["modality"] != "text" or current["format"] != "memmap":
        return f"holds {current['modality']} in {current['format']}, not a text memmap dataset"
    held = (current.get("created_by") or {}).get("options") or {}
    flags = {"append_eos": ("--append-eos", "--no-append-eos"), "add_bos": ("--add-bos", "no --add-bos"),
             "special_tokens": ("the template's special tokens", "--no-special-tokens")}
    differ = [f"{flags[name][0] if getattr(spec, name) else flags[name][1]} (the dataset: "
              f"{flags[name][0] if held[name] else flags[name][1]})"
              for name in flags if name in held and bool(held[name]) != bool(getattr(spec, name))]
    # what a document is and which files are read (a dataset of one document per file took each line of the new
    # files as a document, its manifest still saying file)
    differ += _options_differ(held, spec, ["doc_per", "field", "max_doc_bytes", "follow_symlinks",
                                           "allow_outside_source"])
    # every document of a dataset starts and ends the same way (its readers and verify rely on it)
    return f"was tokenized with other options: {', '.join(differ)}" if differ else None


def _text_sampleless(store, out: Path, current: dict) -> Callable[[list[str]], set[str]]:
    """Which of some recorded files gave the text dataset no document (read from its source runs when asked)."""
    from repack.lifecycle.remove_tokens import files_without_documents

    return lambda rels: files_without_documents(store, out, current, rels)


def _text_job(spec, out: str, known_file: Path, current: dict):
    from repack.jobs.text import TextJob

    return TextJob(dataclasses.replace(spec, out=out, known_inputs=str(known_file)))


def _video_accepts(current: dict, spec) -> str | None:
    if current["modality"] != "video" or current.get("mode") != "transcode":
        return (f"holds {current['modality']} ({current.get('mode', current['format'])}); --append adds prepared "
                "videos to a video dataset made with --transcode")
    asked = {"--to": spec.to, "--target": spec.target, "--dali-reader": spec.dali_reader, "--transcode": spec.mode}
    held = {"--to": current["format"], "--target": current["target"], "--dali-reader": current["dali_reader"],
            "--transcode": current["mode"]}
    differ = [f"{flag} {asked[flag]} (the dataset: {held[flag]})" for flag in asked if asked[flag] != held[flag]]
    # where a link may point: a video packed through a link the append may not follow would be quarantined while
    # it holds a sample, and packed a second time by a later append
    differ += _options_differ((current.get("created_by") or {}).get("options") or {}, spec,
                              ["allow_outside_source", "follow_symlinks"])
    return f"was prepared with other options: {', '.join(differ)}" if differ else None


def _video_job(spec, out: str, known_file: Path, current: dict):
    from repack.jobs.video import VideoJob

    classes = current.get("classes") or {}
    return VideoJob(dataclasses.replace(
        spec, out=out, known_inputs=str(known_file), known_classes=tuple(sorted(classes.items(), key=lambda kv: kv[1])),
        cls_width=len(str(max(classes.values(), default=0))), known_codec=current["codec"],
        videos_dir=f"videos-v{number_of(current) + 1}"))


def merged_video_manifest(current: dict, staged: dict, shards: list[dict], replanned: frozenset = frozenset()) -> dict:
    """A video version N+1: N's entries then the new ones; the probe decisions, reasons and codecs summed;
    the dataset's one codec kept."""
    body = merged_manifest(current, staged, shards, replanned)
    for key in ("decisions", "reasons", "codecs"):
        merged = dict(current["stats"].get(key, {}))
        for name, count in staged["stats"].get(key, {}).items():
            merged[name] = merged.get(name, 0) + count
        body["stats"][key] = dict(sorted(merged.items()))
    return body


def _video_side_files(store, staged_store, staged: str, current: dict, new: dict, number: int) -> dict:
    """Version N's probe.jsonl and file_list.txt (N - 1's lines, then the new videos'), as new files; with
    --to webdataset the new video files too (moved under their own names) and the merged ``videos`` list."""
    files, digests = {}, {}
    for role, name in new["files"].items():
        stem, dot, ext = name.rpartition(".")
        files[role] = f"{stem}-v{number}{dot}{ext}"
        old = store.read_bytes(current["files"][role]) if role in current.get("files", {}) else b""
        data = (old or b"") + staged_store.read_bytes(name)
        store.put_bytes(files[role], data)
        digests[role] = bytes_digest(data)
    body: dict = {"files": files, "file_digests": digests}
    if "videos" in new:
        body["videos"] = current.get("videos", []) + [move_shard(store, staged, v, lambda rel: rel)
                                                      for v in new["videos"]]
    return body


def _video_note(current: dict) -> dict:
    return {"codec": current["codec"], "codec_from": "the dataset's recorded decision (not decided again)"}


APPENDERS = {
    "ImagesSpec": Appender(_images_accepts, _images_job,
                           lambda rel, spec, n: rel.replace("shard-", f"shard-v{n}-", 1), merged_manifest,
                           side_files=_images_side_files),
    "TextSpec": Appender(_text_accepts, _text_job,  # text_document.bin -> text_document-v2.bin (parts alike)
                         lambda rel, spec, n: f"{spec.name}-v{n}{rel[len(spec.name):]}", merged_text_manifest,
                         staged_refusal=text_staged_refusal, sampleless=_text_sampleless),
    "VideoSpec": Appender(_video_accepts, _video_job,  # the videos sit in videos-vN/ already; shards renamed
                          lambda rel, spec, n: rel.replace("shard-", f"shard-v{n}-", 1) if rel.startswith("shard-")
                          else rel, merged_video_manifest, _video_side_files, _video_note),
}
