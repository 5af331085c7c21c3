"""`repack images`: an image tree or list file -> checked samples in shards of the chosen format.

Plan: scan (sorted), optional seeded shuffle, then cut into shards by count and/or stat()
bytes before any decoding, and each shard into chunks of at most ``--chunk-size`` inputs and
about ``CHUNK_BYTES`` (fixed: never derived from the worker count). A shard of one chunk is one
task that reads, checks and writes the shard. A larger shard is a group of chunk tasks: each
writes a tar segment (the same members, no end-of-archive), and the engine's driver appends the
segments in plan order into the shard as they finish (``ShardAssembly``), so the shard's bytes do
not depend on the chunking, the worker count or the order tasks finish in. Bad inputs become
quarantine records.

Where the plan can predict a sample's bytes (the image stored as read: its size is known from
the scan; the other members' sizes are fixed or nearly so), each chunk gets a slot, an offset and
a size in the shard's shared file under ``OUT/.repack/segments``, and on the local pool it writes
its members straight into it: the shard is written once, and the driver only hashes it. A chunk
that does not fit its slot (a quarantined input, an unusual header) is a file of its own, and the
driver copies from there on (see ``repack.sinks.webdataset``). Chunks on Ray, and with
``--normalize``, always write files of their own.

Each sample's members (WebDataset naming, key = zero-padded global position + a sanitized
short stem, ASCII, dot-free, unique): ``<key>.<jpg|png|...>`` (type from content),
``<key>.cls`` (class index as zero-padded ASCII digits, fixed width per dataset, so DALI
reads equal-length label bytes) when labeled, and ``<key>.json`` (path, class, width,
height, bytes, format).

``--to lmdb`` (a single-writer sink): each chunk is a task of its own that writes a part; the
driver's collector writes the database from the parts, in plan order, in finalize (see
``repack.sinks.lmdb_sink``).

``--normalize`` (see ``repack.transforms.normalize``): non-conforming images become baseline
4:2:0 RGB JPEGs; the manifest's ``stats.normalize`` counts conversions and their reasons.

Duplicates (equal content sha256) are only possible among inputs of equal size (known from the
scan, no I/O). Without ``--dedup`` workers hash those candidates while packing and the manifest
reports the groups. With ``--dedup`` the plan hashes the candidates (a thread pool; files of a
unique size are never read) and drops every copy after the first in plan order *before* the
shards are cut: deterministic, parallel-safe, and the shards never need rewriting. The
manifest's ``stats.duplicates`` lists the groups with their paths either way.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import time
from array import array
from pathlib import Path

import numpy as np

from repack.config import ImagesSpec, format_size
from repack.errors import UsageError, stable_reason
from repack.exec.ahead import read_ahead
from repack.exec.cpus import available_cpus
from repack.jobs.base import STATE_DIR, Job, Plan, Task
from repack.jobs.image_plan import InputColumns, PayloadWriter, cut_runs, sample_bounds, sample_expected
from repack.jobs.task_inputs import sample_key, task_inputs  # noqa: F401 - sample_key: imported from here by the video job
from repack.lifecycle.input_columns import encode_names, names_of_blob
from repack.lifecycle.input_record import NO_MTIME, load_known, select_new, select_new_rows
from repack.manifest.duplicate_groups import (encode as encode_groups, file_name as groups_file_name, listed_groups,
                                             role_of)
from repack.manifest.io import atomic_write_bytes
from repack.jobs.record_columns import pack_digests, pack_times, packed_rels, unpack_times
from repack.jobs.stats import bucket_edges, histogram, merge_counts, merge_slowest, percentiles
from repack.jobs.summary import quarantine_lines
from repack.sinks import get_sink
from repack.sinks.checks import bytes_digest
from repack.sources import InputItem, scan_foreign, scan_source
from repack.sources.base import FieldChoice
from repack.sources.reading import open_input, read_inputs, unreadable_reason
from repack.store import is_remote
from repack.transforms.image_check import BadImage, dali_misread, inspect_image, preload

SLOWEST_N = 10
CHUNK_BYTES = 16 * 10**6  # a chunk task's inputs: at most --chunk-size inputs and about this many bytes
SEGMENTS_DIR = f"{STATE_DIR}/segments"
SEGMENT_SUMMARY = ("name", "bytes", "count", "at", "slot")  # what a shard's record keeps of each chunk's piece
_JSON_STR = json.encoder.encode_basestring_ascii


def sample_json(path: str, label: str | None, width: int, height: int, size: int, ext: str) -> bytes:
    """A sample's metadata member: exactly ``json.dumps(meta, sort_keys=True)``, built directly (hot path)."""
    cls = "null" if label is None else _JSON_STR(label)
    return (f'{{"bytes": {size}, "class": {cls}, "format": "{ext}", "height": {height}, '
            f'"path": {_JSON_STR(path)}, "width": {width}}}').encode()


def source_root(source: str) -> str:
    """The folder prefix of a folder scan's paths (a task's input gives ``rel`` only when path = root + rel)."""
    return os.path.abspath(source) + "/"


def job_classes(known: tuple[tuple[str, int], ...], scan, appending: bool) -> dict[str, int]:
    """A job's class map: the scan's; an --append's (``appending``): the dataset's ``known`` classes plus the scan's
    new ones (``extend_classes``), refused where SOURCE is laid out otherwise than when the dataset was packed (class
    folders now and none then, or the reverse: its samples would be quarantined as outside the class folders, or
    packed without a class beside classed ones)."""
    if appending and scan.labeled != bool(known):
        raise UsageError("--append: " + ("SOURCE has class folders now, and the dataset's samples have no class "
                                         "(SOURCE was a flat folder when they were packed)" if scan.labeled else
                                         "the dataset's samples have classes, and SOURCE has no class folders now")
                         + ": repack without --append, or append from SOURCE laid out as the dataset was")
    return extend_classes(dict(known), scan) if known else scan.classes


def extend_classes(known: dict[str, int], scan) -> dict[str, int]:
    """The dataset's class map plus the scan's new classes, in sorted order, at the next indices (a source
    with its own indices, e.g. integer labels: a new class keeps its own where no class holds it)."""
    classes = dict(known)
    own = dict(scan.class_index)
    for name in sorted(set(scan.classes) - set(known)):
        index = own.get(name)
        classes[name] = index if index is not None and index not in classes.values() else \
            max(classes.values(), default=-1) + 1
    return classes


def size_collision_mask(sizes: np.ndarray) -> np.ndarray:
    """True for each input whose size equals another input's: the only possible duplicates."""
    if not len(sizes):
        return np.zeros(0, dtype=bool)
    _, inverse, counts = np.unique(sizes, return_inverse=True, return_counts=True)
    return counts[inverse] > 1


def _taken(items, rows: list[int]):
    """``items`` (an ``InputTable`` or a list) reduced to ``rows``, in that order."""
    return items.take(rows) if hasattr(items, "take") else [items[row] for row in rows]


def content_sha256(item: InputItem) -> str | None:
    """sha256 of an input's bytes (None when unreadable: the task will quarantine it)."""
    try:
        if item.entry_fields():  # stored inside another file (a tar member, a parquet row)
            data = next(read_inputs([{"path": item.path, "rel": item.rel, "fingerprint": item.fingerprint,
                                      **item.entry_fields()}]))
            return None if isinstance(data, OSError) else hashlib.sha256(data).hexdigest()
        with open_input(item.path) as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def hash_threads() -> int:
    """Threads that hash inputs for --dedup (reading is most of it: more than the CPUs)."""
    return min(32, 4 * (os.cpu_count() or 1))


def find_duplicates(items: list[InputItem], hashed: dict[int, str | None] | None = None
                    ) -> list[tuple[str, list[int]]]:
    """(sha256, positions) of inputs with equal content, positions sorted; ordered by first position.
    ``hashed``: filled with position -> sha256 (None: unreadable) of every input read here."""
    sizes = items.sizes if hasattr(items, "sizes") else np.array([item.size for item in items], dtype=np.int64)
    candidates = np.flatnonzero(size_collision_mask(sizes)).tolist()
    threads = hash_threads()
    digests = list(read_ahead(candidates, lambda p: content_sha256(items[p]), threads, 4 * threads))
    if hashed is not None:
        hashed.update(zip(candidates, digests))
    groups: dict[str, list[int]] = {}
    for position, digest in zip(candidates, digests):
        if digest is not None:
            groups.setdefault(digest, []).append(position)
    return sorted(((d, g) for d, g in groups.items() if len(g) > 1), key=lambda dg: dg[1][0])


def held_copies(items, known, skip: set[int], hashed: dict[int, str | None] | None = None
                ) -> dict[int, tuple[str, str]]:
    """--append --dedup: position -> (sha256, the dataset's source of that content) of each of ``items`` (new
    inputs; not ``skip``) whose content a sample of ``known`` (the dataset's record) holds. Only rows of the
    record whose size a new input has are read for their digests (``InputColumns.digested``' rows), and only
    new inputs of a size such a sample has are hashed (``hashed``: digests ``find_duplicates`` read already)."""
    from repack.lifecycle.input_columns import decode_names

    sizes = items.sizes if hasattr(items, "sizes") else np.array([item.size for item in items], dtype=np.int64)
    new = [p for p in range(len(items)) if p not in skip]
    rows = np.flatnonzero(np.isin(known.size, sizes[new]) & known.holds_sample(known.names))
    if not len(rows) or not new:
        return {}
    known = known.digested(rows)
    rows = rows[known.has_sha256[rows]]
    digests = np.ascontiguousarray(known.sha256[rows]).view("S32").ravel()
    order = np.argsort(digests)
    digests, rows = digests[order], rows[order]
    new = [p for p, same_size in zip(new, np.isin(sizes[new], known.size[rows]).tolist()) if same_size]
    hashed = hashed or {}
    threads = hash_threads()
    found = list(read_ahead(new, lambda p: hashed[p] if p in hashed else content_sha256(items[p]), threads,
                            4 * threads))
    held: dict[int, tuple[str, str]] = {}
    for position, digest in zip(new, found):
        if digest is None:
            continue
        at = int(np.searchsorted(digests, np.frombuffer(bytes.fromhex(digest), "S32")[0]))
        if at < len(digests) and bytes(digests[at]) == bytes.fromhex(digest).rstrip(b"\0"):
            held[position] = (digest, decode_names(known.names[rows[at]:rows[at] + 1])[0])
    return held


def copy_print(item: InputItem) -> list[int]:
    """What a dropped copy's group records of it (``prints``, one per path after the first): its size and mtime
    (s3://: ETag value), as the selection compares any input's; a later --append takes a copy of the same print
    for the same content without reading it."""
    fingerprint = item.fingerprint
    return [int(fingerprint[0]), int(fingerprint[1])] if len(fingerprint) > 1 else [int(fingerprint[0])]


def duplicate_report(groups: list[dict], dropped: int, out: Path, name: str) -> tuple[dict, dict]:
    """The manifest's stats.duplicates: counts and the first ``listed_groups()`` groups' paths (first = kept); and
    where that is not all of them, the side file of every group (``repack.manifest.duplicate_groups``, written to
    ``out/name`` and named in ``file``) as the manifest's ``files`` and ``file_digests`` entries."""
    report = {"groups": len(groups), "extra_copies": sum(len(g["paths"]) - 1 for g in groups), "dropped": dropped}
    listed = listed_groups()
    if len(groups) <= listed:
        return {**report, "list": groups}, {}
    data = encode_groups(groups)
    atomic_write_bytes(out / name, data)
    role = role_of(name)
    return {**report, "list": groups[:listed], "file": name}, {"files": {role: name},
                                                               "file_digests": {role: bytes_digest(data)}}


class CombinedRecord:
    """A shard's record built from its chunks' records as they arrive, in plan order (``add``), so that
    neither a chunk record nor its per-sample columns outlive its turn: the digests and times are joined
    into growing columns, the counts summed, the slowest merged; ``record`` encodes the result."""

    def __init__(self) -> None:
        self.formats: dict[str, int] = {}
        self.slowest: list[dict] = []
        self.quarantine: list[dict] = []
        self.inputs = 0
        self.chunks = 0
        self.digests = bytearray()  # raw sha256 of the packed inputs, in plan order
        self.times = (array("q"), array("q"))  # read and check microseconds
        self.profile: dict[str, dict[str, int]] = {name: {} for name in PROFILE_COUNTS}
        self.normalize: dict | None = None
        self.dali_misreads: dict[str, int] = {}

    def add(self, record: dict) -> None:
        """Fold one chunk record in (the next in plan order)."""
        _add_counts(self.formats, record["formats"])
        self.slowest = merge_slowest(self.slowest, record["timing"]["slowest"], SLOWEST_N)
        self.quarantine.extend(record["quarantine"])
        self.inputs += record["inputs"]
        self.chunks += 1
        self.digests += base64.b64decode(record["sha256"])
        for column, values in zip(self.times, unpack_times(record["timing"]["us"], 2)):
            column.frombytes(values.tobytes())  # int64 already
        for name, counts in self.profile.items():
            _add_counts(counts, record["profile"][name])
        if "normalize" in record:
            if self.normalize is None:
                self.normalize = {"converted": 0, "reasons": {}}
            self.normalize["converted"] += record["normalize"]["converted"]
            _add_counts(self.normalize["reasons"], record["normalize"]["reasons"])
        _add_counts(self.dali_misreads, record.get("dali_misreads", {}))

    def record(self, shard: dict | None, outputs: list[dict]) -> dict:
        """The shard's record: the chunk records' fields joined (columns), summed (counts) or merged."""
        combined = {"shard": shard, "outputs": outputs, "quarantine": self.quarantine, "inputs": self.inputs,
                    "formats": self.formats, "sha256": base64.b64encode(self.digests).decode("ascii"),
                    "profile": self.profile,
                    "timing": {"us": pack_times(*self.times), "slowest": self.slowest},
                    "chunks": self.chunks}
        if self.normalize is not None:
            combined["normalize"] = self.normalize
        if self.dali_misreads:
            combined["dali_misreads"] = self.dali_misreads
        return combined


PROFILE_COUNTS = ("bytes", "width", "height", "classes")  # a record's profile histograms, summed over chunks


def _add_counts(total: dict[str, int], counts: dict[str, int]) -> None:
    for key, n in counts.items():
        total[key] = total.get(key, 0) + n


class PackedColumns:
    """Per packed input of a task, as columns: its row among the task's inputs, source bytes, width,
    height, read and check microseconds; the record's profile histograms and slowest list from them."""

    def __init__(self) -> None:
        self.rows, self.sizes, self.widths, self.heights = array("q"), array("q"), array("q"), array("q")
        self.read_us, self.check_us = array("q"), array("q")

    def add(self, row: int, size: int, width: int, height: int, read_us: int, check_us: int) -> None:
        self.rows.append(row)
        self.sizes.append(size)
        self.widths.append(width)
        self.heights.append(height)
        self.read_us.append(read_us)
        self.check_us.append(check_us)

    def profile(self) -> dict[str, dict[str, int]]:
        """{"bytes", "width", "height": {str(half-octave lower edge): count}} (``stats.count_into``'s form)."""
        return {name: _bucket_counts(column) for name, column in
                (("bytes", self.sizes), ("width", self.widths), ("height", self.heights))}

    def slowest(self, rels: list[str]) -> list[dict]:
        """The SLOWEST_N inputs by read + check time (ties: by source), ``rels``: the task's inputs."""
        total = np.asarray(self.read_us, dtype=np.int64) + np.asarray(self.check_us, dtype=np.int64)
        candidates = range(len(total))
        if len(total) > SLOWEST_N:
            candidates = np.flatnonzero(total >= np.partition(total, -SLOWEST_N)[-SLOWEST_N]).tolist()
        chosen = sorted(candidates, key=lambda at: (-int(total[at]), rels[self.rows[at]]))[:SLOWEST_N]
        return [{"source": rels[self.rows[at]], "us": int(total[at]), "bytes": self.sizes[at],
                 "width": self.widths[at], "height": self.heights[at]} for at in chosen]


def _bucket_counts(values: array) -> dict[str, int]:
    edges, counts = np.unique(bucket_edges(np.asarray(values, dtype=np.int64)), return_counts=True)
    return {str(edge): count for edge, count in zip(edges.tolist(), counts.tolist())}


class ShardAssembly:
    """The engine's assembly of one shard: appends its chunks' segments in plan order (see module doc)."""

    def __init__(self, job: "ImagesJob", group: str) -> None:
        self.job = job
        self.builder = job.sink.open_assembler(job.out, group, job.shared_shard(group))
        self.pieces = job.out / SEGMENTS_DIR  # where a chunk's piece of its own lies
        self.combined = CombinedRecord()
        self.segments: dict[str, dict] = {}  # where each chunk went

    def add(self, record: dict) -> None:
        """Append the next chunk's segment and fold its record in; nothing of the record is kept beyond
        its summary (its index lines and checksums are in the builder's columns)."""
        piece = record["segment"]
        self.builder.add_segment(self.pieces / piece["name"], piece)
        self.combined.add(record)
        self.segments[record["task_id"]] = {k: v for k, v in piece.items() if k in SEGMENT_SUMMARY}

    def finish(self) -> dict:
        shard = self.builder.commit()
        combined = self.combined.record(shard, self.job.sink.outputs(shard) if shard else [])
        combined["segments"] = self.segments
        return combined

    def abort(self) -> None:
        self.builder.abort()


class ImagesJob(Job):
    """Plans, runs and finalizes an image repack."""

    name = "images"
    spec_type = ImagesSpec
    progress_unit = "img"

    def __init__(self, spec: ImagesSpec) -> None:
        super().__init__(spec)
        self.sink = get_sink(spec.to)
        if not (hasattr(self.sink, "open_shard") or hasattr(self.sink, "collector")):
            raise UsageError(f"--to {spec.to} cannot hold images; use webdataset or lmdb")
        make_collector = getattr(self.sink, "collector", None)  # single-writer sinks (lmdb)
        self.collector = make_collector(self.out) if make_collector else None

    @classmethod
    def fixed_outputs(cls, spec: dict) -> set[str]:
        from repack.sinks.lmdb_sink import BUILD_TMP, DB_NAME

        groups = {spec.get("duplicates_file") or groups_file_name()}  # when it lists more groups than the manifest
        return groups | ({DB_NAME, BUILD_TMP} if spec.get("to") == "lmdb" else set()) | super().fixed_outputs(spec)

    def check(self) -> None:
        listed_groups()  # REPACK_DUPLICATES_LISTED refused now, not after the last task
        src = Path(self.spec.source)
        if is_remote(self.spec.source):
            from repack.sources.s3 import check_source

            check_source(self.spec.source)  # before OUT holds any state
        elif not src.exists():
            raise UsageError(f"source {self.spec.source!r} does not exist")

    def plan(self) -> Plan:
        spec = self.spec
        confinement = spec.confinement()
        if spec.source_format == "folder":  # the driver's own work runs while the folders are walked on the pool
            scan = scan_source(spec.source, list_file=spec.list_file, confinement=confinement, workers=available_cpus(),
                               meanwhile=self._before_tasks, prefer=self._holds_sample if spec.known_inputs else None)
        else:
            self._before_tasks()
            scan = scan_foreign(spec.source, spec.source_format, FieldChoice(spec.image_field, spec.label_field),
                                confinement, available_cpus())
        return self.plan_scan(scan)

    def _holds_sample(self, rels: list[str]) -> list[bool]:
        """--append: which of ``rels`` (the paths of one file) the dataset holds a sample of."""
        return load_known(self.spec.known_inputs).holds_sample(encode_names(rels)).tolist()

    def _before_tasks(self) -> None:
        """What the driver prepares before the tasks' pool forks: the imports the checks use (the workers
        fork with them) and, for --append, the dataset's record (``load_known``)."""
        preload(self.spec.verify)
        if self.spec.normalize:
            import repack.transforms.normalize  # noqa: F401 - numpy and the encoder, likewise
        if self.spec.known_inputs:
            load_known(self.spec.known_inputs)

    def plan_scan(self, scan) -> Plan:
        """The plan of a scan's inputs: --append's selection, --shuffle, --dedup, then shards and chunks."""
        spec = self.spec
        items = scan.items if hasattr(scan.items, "take") else list(scan.items)
        key_offset = 0
        selection = None
        if spec.known_inputs:  # --append: only what the dataset does not hold yet (repack.lifecycle.input_record)
            known = load_known(spec.known_inputs)
            key_offset = known.next_position
            if hasattr(items, "mtimes"):  # a scan's InputTable: rels and fingerprints without an object per input
                if spec.list_file:  # a row spelled otherwise than the dataset holds it (./a.jpg for a.jpg): known
                    from repack.sources.listfile import respell_held

                    items = respell_held(items, known, os.path.dirname(os.path.abspath(spec.source)))
                selection = select_new_rows(names_of_blob(items.names, items.ends), items.sizes, items.mtimes, known,
                                            lambda row: content_sha256(items[row]))
            elif hasattr(items, "shard_ids"):  # tar members as columns: the fingerprint is the shard's
                size, mtime = items.shard_prints(NO_MTIME)
                selection = select_new_rows(names_of_blob(items.names, items.ends), size, mtime, known,
                                            lambda row: content_sha256(items[row]), size_is_content=False)
            else:
                selection = select_new(range(len(items)), known, lambda row: items[row].rel,
                                       lambda row: items[row].fingerprint, lambda row: content_sha256(items[row]),
                                       size_is_content=spec.source_format == "folder")
            items = _taken(items, selection.new)
        if spec.shuffle:  # the permutation shuffle() makes of len(items) items (the same RNG calls)
            order = list(range(len(items)))
            random.Random(spec.seed).shuffle(order)
            items = _taken(items, order)
        classes = job_classes(spec.known_classes, scan, bool(spec.known_inputs))
        width = spec.cls_width or len(str(max(classes.values(), default=0)))
        if len(str(max(classes.values(), default=0))) > width:
            raise UsageError(f"class index {max(classes.values())} needs more digits than the dataset's cls members "
                             f"({width}): repack the dataset (without --append) to widen them")
        inputs_total = len(items) + len(scan.quarantine)
        dup_groups: list[dict] = []
        if spec.dedup:
            hashed: dict[int, str | None] = {}
            groups = find_duplicates(items, hashed)
            dup_groups = [{"sha256": digest, "paths": [items[p].rel for p in g],
                           "prints": [copy_print(items[p]) for p in g[1:]]} for digest, g in groups]
            drop = {p for _, g in groups for p in g[1:]}
            if spec.known_inputs:  # --append: a copy of a sample the dataset holds is a duplicate too
                held = held_copies(items, load_known(spec.known_inputs), drop, hashed)
                firsts = {g[0]: n for n, (_, g) in enumerate(groups)}
                for p, (digest, rel) in held.items():  # the held sample first: the kept one of its group
                    if p in firsts:  # the group's first scanned copy is dropped now too
                        group = dup_groups[firsts[p]]
                        group["paths"].insert(0, rel)
                        group["prints"].insert(0, copy_print(items[p]))
                    else:
                        dup_groups.append({"sha256": digest, "paths": [rel, items[p].rel],
                                           "prints": [copy_print(items[p])]})
                drop |= set(held)
            if drop:
                items = _taken(items, [p for p in range(len(items)) if p not in drop])
        root = (None if spec.list_file or spec.source_format != "folder" or is_remote(spec.source)
                else source_root(spec.source))
        cols = InputColumns.of(items, root)

        tasks = []
        bounds = sample_bounds(cols, spec.sample_json)
        slotted = self.collector is None and not spec.normalize
        expected = sample_expected(cols, spec.sample_json) if slotted else None
        shard_inputs, shard_bytes = spec.shard_limits()
        payloads = PayloadWriter(cols, classes)
        for index, (start, end) in enumerate(cut_runs(bounds, 0, len(cols), shard_inputs, shard_bytes)):
            stem = f"shard-{index:06d}"
            chunks = cut_runs(bounds, start, end, spec.chunk_size, CHUNK_BYTES)
            at = 0
            for number, (first, last) in enumerate(chunks):
                inputs = payloads.inputs(first, last, key_offset + first)
                payload = {"index": index, "inputs": inputs, "cls_width": width}
                if len(chunks) == 1:
                    tasks.append(Task(stem, payload))
                    continue
                payload["chunk"] = number
                if slotted:  # [offset, bytes] in the shard's shared file
                    slot = int(expected[first:last].sum())
                    payload["slot"], at = [at, slot], at + slot
                # a single-writer sink (lmdb) reads chunk parts at finalize: no assembly
                tasks.append(Task(f"{stem}-c{number:04d}", payload, group="" if self.collector is not None else stem))
        info = {"classes": classes, "labeled": scan.labeled, "inputs": inputs_total,
                "skipped_junk": scan.skipped}
        if scan.not_carried:
            info["not_carried"] = dict(scan.not_carried)
        if spec.dedup:
            info["dedup"] = dup_groups
        if selection is not None:
            info.update(removed_skipped=selection.removed, same_content=selection.same_content)
        return Plan(tuple(tasks), scan.quarantine, info)

    def run_task(self, task: Task) -> dict:
        spec = self.spec
        if task.group:
            slot = task.payload.get("slot") if self.place_segments else None
            place = (self.shared_shard(task.group), *slot) if slot else None
            writer = self.sink.open_segment(self.out / SEGMENTS_DIR, task.task_id, place)
        else:
            writer = self.sink.open_shard(self.out, task.task_id)
        quarantine: list[dict] = []
        packed = PackedColumns()
        formats: dict[str, int] = {}
        classes: dict[str, int] = {}
        digests: list[bytes] = []  # sha256 of every packed input, in plan order
        converted: dict[str, int] = {}
        misreads: dict[str, int] = {}  # images DALI decodes otherwise than Pillow (stats.dali_misreads)
        normalized = 0
        norm = None
        if spec.normalize:  # imported here: numpy and the encoder cost ~0.1 s of start-up otherwise
            from repack.transforms.normalize import NormalizeOptions, normalize_image

            norm = NormalizeOptions(spec.quality, spec.max_side, spec.max_pixels)
        width = task.payload["cls_width"]
        root = source_root(spec.source)
        entries = task_inputs(task.payload)
        reads = read_inputs(entries, root)
        try:
            for row, entry in enumerate(entries):
                t0 = time.perf_counter()
                data = next(reads)
                if isinstance(data, OSError):
                    quarantine.append({"source": entry["rel"], "reason": unreadable_reason(data)})
                    continue
                t1 = time.perf_counter()
                source_bytes = len(data)
                digest = hashlib.sha256(data).digest()  # the content: --append (input_record), duplicates
                try:
                    if norm is not None:
                        result = normalize_image(data, norm)
                        ext, img_w, img_h, data = result.ext, result.width, result.height, result.data
                        src_w, src_h = result.source_size
                        for reason in result.reasons:
                            converted[reason] = converted.get(reason, 0) + 1
                        normalized += bool(result.reasons)
                    else:
                        info = inspect_image(data, spec.verify, spec.max_pixels)
                        ext, img_w, img_h = info.ext, info.width, info.height
                        src_w, src_h = img_w, img_h
                        misread = dali_misread(info)
                        if misread is not None:
                            misreads[misread] = misreads.get(misread, 0) + 1
                except Exception as exc:  # noqa: BLE001 - one bad record never fails the task
                    reason = str(exc) if isinstance(exc, BadImage) else stable_reason(exc, "cannot check: ")
                    quarantine.append({"source": entry["rel"], "reason": reason})
                    continue
                t2 = time.perf_counter()
                members = [(ext if self.collector is None else "img", data)]
                if entry["cls"] is not None:
                    members.append(("cls", b"%0*d" % (width, entry["cls"])))
                if spec.sample_json and ((norm is not None and result.reasons) or "meta" in entry):
                    meta = {"path": entry["rel"], "class": entry["label"], "width": img_w, "height": img_h,
                            "bytes": len(data), "format": ext, **entry.get("meta", {})}
                    if norm is not None and result.reasons:
                        meta.update(source_bytes=source_bytes, source_width=src_w, source_height=src_h,
                                    normalized=list(result.reasons))
                    members.append(("json", json.dumps(meta, sort_keys=True).encode()))
                elif spec.sample_json:
                    members.append(("json", sample_json(entry["rel"], entry["label"], img_w, img_h, len(data), ext)))
                writer.add_sample(entry["key"], members)
                digests.append(digest)
                formats[ext] = formats.get(ext, 0) + 1
                label = entry["label"] if entry["label"] is not None else ""
                classes[label] = classes.get(label, 0) + 1
                packed.add(row, source_bytes, src_w, src_h, round((t1 - t0) * 1e6), round((t2 - t1) * 1e6))
            shard = writer.commit()
        except BaseException:
            writer.abort()
            raise
        record = {"shard": shard, "quarantine": quarantine, "inputs": len(entries), "formats": formats,
                  "sha256": pack_digests(digests), "profile": {**packed.profile(), "classes": classes},
                  "timing": {"us": pack_times(packed.read_us, packed.check_us),
                             "slowest": packed.slowest([entry["rel"] for entry in entries])}}
        if task.group:  # a segment of the group's shard (see ShardAssembly); placed: no file of its own
            record.update(shard=None, segment=shard, outputs=[] if "at" in shard else
                          [{"path": f"{SEGMENTS_DIR}/{shard['name']}", "bytes": shard["bytes"]}])
        else:
            record["outputs"] = self.sink.outputs(shard) if shard else []
        if norm is not None:
            record["normalize"] = {"converted": normalized, "reasons": converted}
        if misreads:
            record["dali_misreads"] = misreads
        if self.collector is not None:  # the part is imported by the driver; no shard of its own
            record["part"], record["shard"] = shard, None
        return record

    def open_assembly(self, group: str) -> "ShardAssembly":
        return ShardAssembly(self, group)

    def shared_shard(self, group: str) -> Path:
        """The file a group's placed segments are written into (it becomes the shard; a temp name:
        removed with the group's temps when a run starts)."""
        return self.out / SEGMENTS_DIR / f".{group}.tar.tmp-shared"

    def record_kept(self, record: dict) -> bool:
        return "at" not in (record.get("segment") or {})  # a placed segment is never trusted (outputs_intact)

    def outputs_intact(self, record: dict) -> bool:
        if self.collector is not None:  # single-writer sinks (lmdb)
            return self.collector.intact(record)
        if "at" in (record.get("segment") or {}):
            return False  # a placed segment: its slot is rewritten with the group's unfinished chunks
        return super().outputs_intact(record)

    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        quarantine = list(plan.quarantine) + [q for r in records for q in r["quarantine"]]
        formats: dict[str, int] = {}
        for r in records:
            for ext, n in r["formats"].items():
                formats[ext] = formats.get(ext, 0) + n
        fields = {ext: "image" for ext in sorted(formats)} if self.collector is None else {"img": "image"}
        if plan.info["labeled"]:
            fields["cls"] = "int"
        if self.spec.sample_json:
            fields["json"] = "metadata"
        if self.collector is not None:
            shards = [self.collector.finish(records, {"classes": plan.info["classes"], "fields": fields,
                                                      "labeled": plan.info["labeled"]})]
        else:
            shards = [r["shard"] for r in records if r["shard"]]
        samples = sum(s["samples"] for s in shards)
        stats: dict = {"formats": formats, **_profile_stats([r.get("profile", {}) for r in records])}
        misreads: dict[str, int] = {}
        for r in records:
            _add_counts(misreads, r.get("dali_misreads", {}))
        if misreads:  # what DALI's loaders refuse (pipelines.manifest_access.dali_misread_refusal)
            stats["dali_misreads"] = dict(sorted(misreads.items()))
        if "not_carried" in plan.info:  # --from: the source's other members/columns, not packed
            stats["source_not_carried"] = plan.info["not_carried"]
        if self.spec.normalize:
            reasons: dict[str, int] = {}
            for r in records:
                for reason, n in r.get("normalize", {}).get("reasons", {}).items():
                    reasons[reason] = reasons.get(reason, 0) + n
            converted = sum(r.get("normalize", {}).get("converted", 0) for r in records)
            stats["normalize"] = {"converted": converted, "passed_through": samples - converted,
                                  "reasons": dict(sorted(reasons.items()))}
        groups = plan.info.get("dedup", []) if self.spec.dedup else _packed_duplicates(plan, records)
        stats["duplicates"], side_files = duplicate_report(
            groups, sum(len(g["paths"]) - 1 for g in groups) if self.spec.dedup else 0, self.out,
            self.spec.duplicates_file)
        del groups
        if not side_files and self.store.size(self.spec.duplicates_file) is not None:
            self.store.delete(self.spec.duplicates_file)  # a run killed before its manifest, re-run with a higher limit
        times = [unpack_times(r["timing"]["us"], 2) for r in records]
        read_us = np.concatenate([t[0] for t in times] or [np.zeros(0, dtype=np.int64)])
        check_us = np.concatenate([t[1] for t in times] or [np.zeros(0, dtype=np.int64)])
        del times
        slowest: list[dict] = []
        for r in records:
            slowest = merge_slowest(slowest, r["timing"]["slowest"], SLOWEST_N)
        return {
            "format": self.spec.to,
            "fields": fields,
            "classes": plan.info["classes"],
            "shards": shards,
            "totals": {"inputs": plan.info["inputs"], "samples": samples, "quarantined": len(quarantine),
                       "bytes": sum(s["bytes"] for s in shards), "shards": len(shards),
                       "skipped_junk": plan.info["skipped_junk"],
                       **({"duplicates_dropped": stats["duplicates"]["dropped"]} if self.spec.dedup else {})},
            "quarantine": quarantine,
            "stats": stats,
            **side_files,
            "run_stats": {"timing": {"read_ms": percentiles(read_us, 1e-3), "check_ms": percentiles(check_us, 1e-3),
                                     "sample_us_histogram": _time_histogram(read_us, check_us),
                                     "slowest": slowest}},
        }

    def summary_lines(self, manifest: dict) -> list[str]:
        t = manifest["totals"]
        lines = [f"{t['samples']} of {t['inputs']} inputs packed into {t['shards']} {manifest['format']} shard(s), "
                 f"{format_size(t['bytes'])}; {t['quarantined']} quarantined"]
        return lines + quarantine_lines(manifest["quarantine"])


def _profile_stats(profiles: list[dict]) -> dict:
    """Source file size and dimension histograms and samples per class (label "" = unlabeled)."""
    merged = {name: merge_counts(p.get(name, {}) for p in profiles) for name in ("bytes", "width", "height")}
    classes = merge_counts(p.get("classes", {}) for p in profiles)
    return {"histograms": {"source_bytes": histogram(merged["bytes"]), "width": histogram(merged["width"]),
                           "height": histogram(merged["height"])},
            "class_counts": dict(sorted(classes.items()))}


def _time_histogram(read_us: np.ndarray, check_us: np.ndarray) -> list[dict]:
    """Read + decode/check time per sample (microseconds), half-octave buckets."""
    edges, counts = np.unique(bucket_edges(read_us + check_us), return_counts=True)
    return histogram({str(edge): count for edge, count in zip(edges.tolist(), counts.tolist())})


def _packed_duplicates(plan: Plan, records: list[dict]) -> list[dict]:
    """Groups of packed inputs with equal content (sha256; first = kept), from the records' digest columns:
    candidates are the digests whose first 8 bytes repeat (one uint64 column sorted, not the 32-byte
    digests: a quarter of the memory and a fraction of the sort on the tail of the job), paired with rels
    only for the units that hold one; a candidate whose full digest is unique drops out."""
    raws = [base64.b64decode(r.get("sha256", "")) for r in records]
    prefixes = np.concatenate([np.frombuffer(raw, dtype="<u8")[::DIGEST_WORDS] for raw in raws] or
                              [np.zeros(0, "<u8")])
    if len(prefixes) < 2:
        return []
    values, counts = np.unique(prefixes, return_counts=True)
    repeated = values[counts > 1]
    if not len(repeated):
        return []
    hits = np.flatnonzero(np.isin(prefixes, repeated))  # one pass over every unit (a pass per unit sorted
    del prefixes, values, counts                        # the repeated prefixes once per shard)
    starts = np.cumsum([0] + [len(raw) // 32 for raw in raws])
    unit_of = np.searchsorted(starts, hits, side="right") - 1
    units, firsts = np.unique(unit_of, return_index=True)  # unit_of is sorted: each unit's hits are a run
    lasts = np.append(firsts[1:], len(unit_of))
    groups: dict[bytes, list[str]] = {}
    for unit, first, last in zip(units.tolist(), firsts.tolist(), lasts.tolist()):
        (_, tasks), record, raw = plan.units[unit], records[unit], raws[unit]
        rels = packed_rels(tasks, record)
        for at in (hits[first:last] - starts[unit]).tolist():
            groups.setdefault(raw[at * 32:(at + 1) * 32], []).append(rels[at])
    return [{"sha256": digest.hex(), "paths": paths} for digest, paths in groups.items() if len(paths) > 1]


DIGEST_WORDS = 4  # uint64 words per sha256 digest
