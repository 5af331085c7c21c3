"""`repack text SRC OUT --tokenize memmap`: tokenize a corpus once into Megatron MMIDIDX prefixes.

Plan: list the text files (sorted), load and identify the tokenizer (sha256 in the plan, so a
changed tokenizer is a changed plan), pick the token dtype from the largest id it can produce
(uint16 if < 65536, else int32), and cut the corpus into about-equal chunks that never split
a document (sources/text_docs.py). One task = one chunk = one part prefix, tokenized in a
worker process with ``encode_batch_fast`` on the worker's share of the pool's CPUs in Rust threads
(processes x threads <= cores: one thread each when the pool has a process per core; the settings
that override it: ``repack.transforms.tokenizer_threads``) and written atomically.

Finalize: quarantine lines are turned into file lines (1-based) from each segment's line
count; then, unless ``--no-merge``, the parts are concatenated in input order into
``OUT/<name>.bin/.idx`` (byte-identical for any worker count, executor or interruption), a
marker ``.repack/merged.json`` is written and the parts are removed. With ``--no-merge`` the
parts stay as prefixes ``OUT/<name>_part-NNNNNN`` and the manifest (and summary) give
Megatron's weighted ``--data-path`` list. The tokenizer is copied to ``OUT/tokenizer.json``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repack.config import JobSpec
from repack.errors import UsageError
from repack.jobs.base import STATE_DIR, Job, Plan, Task
from repack.exec.cpus import available_cpus, worker_cpus
from repack.jobs.text_plan import chunk_bytes_of, pack_table, plan_chunk_columns, table_names, table_segments
from repack.lifecycle.input_record import file_sha256, load_known, select_new_rows
from repack.jobs.run_guard import in_pool_worker
from repack.jobs.record_columns import digest_rows_name, pack_digest_rows, pack_ints, unpack_ints
from repack.jobs.summary import quarantine_lines
from repack.jobs.token_stats import file_table, token_stats
from repack.manifest import atomic_write_bytes, dumps_canonical
from repack.manifest.source_runs import SUFFIX as RUNS_SUFFIX
from repack.manifest.source_runs import encode_columns, side_entry
from repack.sinks.megatron import CODE_OF, PartWriter, megatron_data_path, merge_parts, read_index, token_dtype
from repack.sources import Confinement
from repack.sources.confine import open_input
from repack.sources.reading import read_inputs
from repack.sources.text_docs import (DEFAULT_MAX_DOC_BYTES, DOC_PER, MAX_DOC_BYTES_LIMIT, TEXT_WORKER_BUDGET,
                                      TOKENIZE_BYTES_PER_BYTE, Segment, SegmentReader, file_document, list_text_files,
                                      preloadable, require_decompressors)
from repack.manifest.quarantine_records import RUN_SUFFIX
from repack.sources.columns import name_ends
from repack.store import is_remote
from repack.transforms.tokenize import planned_tokenizer_bytes, release_free_heap
from repack.transforms.tokenizer_threads import TokenizerThreads, run_on_own_thread, use_tokenizer_threads

_FS = ("utf-8", "surrogateescape")

BATCH_CHARS = 1 << 17  # characters handed to one encode_batch call, at most (a worker holds its Encodings:
# ~24 KB per 750-character document, GPT-2; 128 documents cost the same CPU as 1,024 and 21 MB less)
BATCH_DOCS = 128
MERGED_MARKER = "merged.json"
TOKENIZER_COPY = "tokenizer.json"
PACK_THREADS = 8  # threads compressing the tasks' tables (0.24 s of zlib in one thread at 500,000 files)
PART_REMOVERS = 8  # threads removing the merged parts (unlinks wait on the file system, not the CPU)


@dataclass(frozen=True)
class TextSpec(JobSpec):
    """Options of `repack text` (everything that determines the output)."""

    tokenizer: str = ""
    tokenize: str = "memmap"
    field: str = "text"
    doc_per: str = "line"
    list_file: bool = False
    append_eos: bool = True
    eos_token: str | None = None
    add_bos: bool = False
    bos_token: str | None = None
    special_tokens: bool = True
    name: str = "text_document"
    chunk_bytes: int | None = None  # None: auto (sources.text_docs.auto_chunk_bytes)
    merge: bool = True
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES
    follow_symlinks: bool = True
    allow_outside_source: bool = False
    known_inputs: str | None = None  # set by --append (repack.lifecycle.append): files already tokenized are skipped

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise UsageError("--tokenizer is required (a local tokenizer.json or a folder holding one)")
        if self.doc_per not in DOC_PER:
            raise UsageError(f"--doc-per must be one of {', '.join(DOC_PER)}, got {self.doc_per!r}")
        if not self.field:
            raise UsageError("--field must not be empty")
        if not self.name or "/" in self.name or self.name.startswith(".") or self.name == "tokenizer":
            raise UsageError(f"--name must be a plain file stem, got {self.name!r}")
        if self.chunk_bytes is not None and self.chunk_bytes < 1:
            raise UsageError("--chunk-bytes must be positive")
        if self.max_doc_bytes < 1:
            raise UsageError("--max-doc-bytes must be positive")
        if self.max_doc_bytes > MAX_DOC_BYTES_LIMIT:
            raise UsageError(f"--max-doc-bytes {self.max_doc_bytes} is over the limit of {MAX_DOC_BYTES_LIMIT} bytes "
                             f"(16 MiB): a document is tokenized whole, at about {TOKENIZE_BYTES_PER_BYTE} bytes of "
                             f"memory per byte of text, and a worker must stay under {TEXT_WORKER_BUDGET // 2**30} GiB; "
                             "split longer documents before packing them")


def segment_counts(record: dict) -> tuple[list[int], list[int], list[int]]:
    """A record's per-segment (lines, documents, tokens) columns: its ``segments`` (``pack_ints``), or the
    ``lines``/``documents``/``tokens`` lists of an older repack's record."""
    if "segments" in record:
        return tuple(column.tolist() for column in unpack_ints(record["segments"], 3))
    return record["lines"], record["documents"], record["tokens"]


@dataclass(frozen=True)
class SegmentColumns:
    """Every segment of a job in plan order, as columns: its file's name (``names``: a names blob of
    ``repack.sources.columns``, ``ends``), its counts (``segment_counts``), and where each record's segments
    begin (``starts``, one more than the records). The segments of one file are adjacent (a file is listed
    once, and cut into consecutive chunks; within a chunk each file is one segment)."""

    names: bytes
    ends: np.ndarray
    lines: np.ndarray
    documents: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, plan: Plan, records: list[dict]) -> "SegmentColumns":
        blobs = [table_names(task.payload["table"]) for task in plan.tasks[:len(records)]]
        names = b"".join(blobs)
        ends = name_ends(names)
        columns: list[list[np.ndarray]] = [[], [], []]
        for record in records:
            for column, values in zip(columns, segment_counts(record)):
                column.append(np.asarray(values, dtype=np.int64))
        joined = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in columns]
        sizes = [blob.count(0) for blob in blobs]
        return cls(names, ends, *joined, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    def __len__(self) -> int:
        return len(self.ends)

    def name_starts(self) -> np.ndarray:
        return np.concatenate(([0], self.ends[:-1] + 1)) if len(self.ends) else np.zeros(0, np.int64)

    def rel(self, seg: int) -> str:
        start = int(self.ends[seg - 1]) + 1 if seg else 0
        return self.names[start:int(self.ends[seg])].decode(*_FS)

    def file_starts(self) -> np.ndarray:
        """The first segment of each file: every segment but a record's first when it continues the file of
        the record before."""
        n = len(self)
        if not n:
            return np.zeros(0, np.int64)
        first = np.ones(n, dtype=bool)
        for seg in self.starts[1:-1].tolist():
            if 0 < seg < n and self.rel(seg) == self.rel(seg - 1):
                first[seg] = False
        return np.flatnonzero(first)

    def before_in_file(self, values: np.ndarray) -> np.ndarray:
        """Per segment, the sum of ``values`` over the earlier segments of its file."""
        totals = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        starts = self.file_starts()
        first = np.repeat(starts, np.diff(np.concatenate([starts, [len(self)]])))
        return totals[:-1] - totals[first]

    def of_barren_files(self) -> np.ndarray:
        """Per segment, whether its file gave no document (every line quarantined, empty, or a UTF-16 or
        binary file): a quarantine record of such a file says so, and --append plans the file again once it
        changes, as a file quarantined whole (``repack.lifecycle.append``)."""
        starts, documents, _ = self.per_file()
        return np.repeat(documents == 0, np.diff(np.concatenate([starts, [len(self)]])))

    def per_file(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first segment, documents, tokens) of each file, in plan order."""
        starts = self.file_starts()
        if not len(starts):
            return starts, np.zeros(0, np.int64), np.zeros(0, np.int64)
        return starts, np.add.reduceat(self.documents, starts), np.add.reduceat(self.tokens, starts)

    def merged_runs_bytes(self) -> bytes:
        """The side file (``repack.manifest.source_runs``) of the whole job as one prefix: each file with
        documents, all of them, one run each."""
        segs, documents, _ = self.per_file()
        kept = documents > 0
        return self._runs_bytes(segs[kept], np.zeros(int(kept.sum()), np.int64), documents[kept])

    def part_runs_bytes(self, record: int) -> bytes:
        """The side file of record ``record``'s part alone (``--no-merge``): each of its segments with documents,
        numbered from the documents of its file in the parts before (a file is one segment of a part)."""
        segs = np.arange(int(self.starts[record]), int(self.starts[record + 1]), dtype=np.int64)
        segs = segs[self.documents[segs] > 0]
        return self._runs_bytes(segs, self.before_in_file(self.documents)[segs], self.documents[segs])

    def _runs_bytes(self, segs: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> bytes:
        """``encode_runs`` of one run per segment in ``segs`` (distinct files, ascending), the names cut from the
        names blob with a byte mask (one byte per byte of the blob, not an int64 index per byte: at 500,000
        files 11 MB instead of ~260 MB of transient arrays)."""
        begins = self.name_starts()[segs]
        lengths = self.ends[segs] - begins
        name_end = np.cumsum(lengths, dtype=np.int64)
        chosen = np.zeros(len(self), dtype=bool)
        chosen[segs] = True
        keep = np.repeat(chosen, np.diff(np.concatenate(([-1], self.ends))))  # each name with the NUL after it
        keep[self.ends[chosen]] = False
        blob = np.frombuffer(self.names, np.uint8)[:len(keep)][keep].tobytes()
        blob.decode("utf-8")  # the side file's names are UTF-8 (as encode_runs requires)
        return encode_columns(name_end, blob, np.arange(len(segs), dtype=np.int64), firsts.astype(np.int64),
                              counts.astype(np.int64))


def _file_stats(segments: SegmentColumns) -> dict:
    """Tokens per input file: a half-octave histogram and the largest files (a file may span tasks)."""
    firsts, documents, tokens = segments.per_file()
    return file_table(documents, tokens, lambda i: segments.rel(int(firsts[i])))


def whole_file_sha256(segment: Segment) -> bytes | None:
    """The raw sha256 of a local file a segment covers whole (its task just read it: page-cached), else
    None (a file split over tasks; an s3:// object over PRELOAD_MAX_BYTES, not fetched again: its ETag
    changed alone, it is refused by name rather than compared)."""
    size = segment.fingerprint[0] if segment.fingerprint else None
    if is_remote(segment.path) or segment.start != 0 or (segment.unit == "bytes" and segment.end != size) or \
            segment.unit == "rowgroups":
        return None
    try:
        with open_input(segment.path, list(segment.fingerprint) or None, segment.rel) as fh:
            return hashlib.file_digest(fh, "sha256").digest()
    except OSError:
        return None


class TextJob(Job):
    """Plans, runs and finalizes a text tokenization job."""

    name = "text"
    spec_type = TextSpec
    progress_unit = "B"
    _ahead = None  # this run's MergeAhead (``watch_tasks``), taken over by ``_merge``
    merged_ahead = 0  # parts ``_merge`` took from it: the manifest's run.parts_merged_ahead

    @classmethod
    def fixed_outputs(cls, spec: dict) -> set[str]:
        name = str(spec.get("name") or "")
        prefix = {f"{name}.bin", f"{name}.idx", f"{name}{RUNS_SUFFIX}"} if name and "/" not in name else set()
        return prefix | {TOKENIZER_COPY} | super().fixed_outputs(spec)

    @classmethod
    def written_beside(cls, output: str) -> set[str]:
        return {output[:-len(".bin")] + RUNS_SUFFIX} if output.endswith(".bin") else set()

    # -- planning ------------------------------------------------------------------------

    def check(self) -> None:
        spec = self.spec
        if spec.tokenize not in ("memmap",):
            raise UsageError(f"--tokenize {spec.tokenize!r}: only 'memmap' (Megatron .bin/.idx) is supported")
        if is_remote(spec.source):
            from repack.sources.s3 import check_source

            check_source(spec.source)  # before OUT holds any state
        elif not Path(spec.source).exists():
            raise UsageError(f"source {spec.source!r} does not exist")
        if spec.list_file and not Path(spec.source).is_file():
            raise UsageError(f"--list: {spec.source!r} is not a file")
        TokenizerThreads.choose(os.environ, 1)  # a bad REPACK_TOKENIZER_THREADS fails here, before any work
        self.tokenizer_info()

    def tokenizer_info(self):
        """The tokenizer's identity (loaded once per job object)."""
        from repack.transforms.tokenize import describe_tokenizer

        if getattr(self, "_tokenizer_info", None) is None:
            spec = self.spec
            self._tokenizer_info = describe_tokenizer(spec.tokenizer, eos_token=spec.eos_token,
                                                      bos_token=spec.bos_token, need_eos=spec.append_eos,
                                                      need_bos=spec.add_bos)
        return self._tokenizer_info

    def plan(self) -> Plan:
        spec = self.spec
        info = self.tokenizer_info()
        inputs, quarantine, skipped = list_text_files(spec.source, spec.list_file, Confinement(
            follow_symlinks=spec.follow_symlinks, allow_outside=spec.allow_outside_source), available_cpus())
        selection = None
        if spec.known_inputs:  # --append: only files the dataset does not hold yet (repack.lifecycle.input_record)
            table = inputs.table
            selection = select_new_rows(table.rels, table.sizes, table.mtimes, load_known(spec.known_inputs),
                                        lambda row: file_sha256(table.path(row)))
            inputs = inputs.take(selection.new)
        require_decompressors(inputs)
        chunks, unreadable, unread = plan_chunk_columns(inputs, spec.chunk_bytes, spec.doc_per, spec.field)
        quarantine += unreadable  # inputs, as the listing's quarantined files are, but no file read
        dtype = token_dtype(info.max_token_id)
        common = {"tokenizer": info.path, "tokenizer_sha256": info.sha256, "dtype": dtype,
                  "eos_id": info.eos_id if spec.append_eos else None,
                  "bos_id": info.bos_id if spec.add_bos else None}
        with ThreadPoolExecutor(min(PACK_THREADS, available_cpus())) as pool:  # zlib runs without the GIL
            tables = list(pool.map(lambda index: pack_table(inputs, chunks, index), range(len(chunks))))
        tasks = [Task(f"part-{index:06d}", {"index": index, **common, "bytes": chunk_bytes_of(chunks, index),
                                            "table": table})
                 for index, table in enumerate(tables)]
        del tables
        plan_info = {"tokenizer": info.to_json(), "dtype": dtype, "inputs": len(inputs) + len(quarantine) - len(unread),
                     "files": len(inputs) - len(unread), "skipped_files": skipped,
                     "input_bytes": int(inputs.table.sizes.sum() - inputs.table.sizes[unread].sum())}
        if selection is not None:
            plan_info.update(removed_skipped=selection.removed, same_content=selection.same_content)
        release_free_heap()  # the scan's and the cut's transients, before the workers fork
        return Plan(tuple(tasks), tuple(quarantine), plan_info)

    def task_units(self, task: Task) -> int:
        return max(1, task.payload["bytes"])

    # -- one task ------------------------------------------------------------------------
    def part_folder(self) -> tuple[Path, str]:
        """Where parts go and their path prefix relative to OUT."""
        if self.spec.merge:
            return self.out / STATE_DIR / "parts", f"{STATE_DIR}/parts/"
        return self.out, ""

    def part_stem(self, index: int) -> str:
        return f"part-{index:06d}" if self.spec.merge else f"{self.spec.name}_part-{index:06d}"

    def run_task(self, task: Task) -> dict:
        threads = use_tokenizer_threads(worker_cpus(), own_thread_ok=in_pool_worker())  # before the first encode
        if threads.own_thread:  # a pool worker's share of one thread: the task on a thread of its own
            return run_on_own_thread(lambda: self._tokenize_task(task, threads))
        return self._tokenize_task(task, threads)

    def _tokenize_task(self, task: Task, threads: TokenizerThreads) -> dict:
        """One task's documents tokenized into its part (``run_task``)."""
        from repack.transforms.tokenize import BatchEncoder, load_tokenizer

        p = task.payload
        tokenizer, _ = load_tokenizer(p["tokenizer"], p["tokenizer_sha256"])
        encoder = BatchEncoder(tokenizer, special_tokens=self.spec.special_tokens, bos_id=p["bos_id"],
                               eos_id=p["eos_id"])
        folder, rel_prefix = self.part_folder()
        folder.mkdir(parents=True, exist_ok=True)
        writer = PartWriter(folder, self.part_stem(p["index"]), p["dtype"])
        quarantine: list[dict] = []
        lines: list[int] = []  # per segment: lines (rows) read
        counts = {"empty_documents": 0, "blank_lines": 0, "characters": 0}
        plan_segments = table_segments(p["table"])
        seg_documents = np.zeros(len(plan_segments), np.int64)  # per segment: documents kept, their tokens
        seg_tokens = np.zeros(len(plan_segments), np.int64)
        digests: list[bytes | None] = []  # per segment: sha256 of a file read whole (repack.lifecycle.input_record)
        batch: list[str] = []
        batch_segs: list[int] = []  # segment number and line of each document in the batch
        batch_lines: list[int] = []
        chars = 0
        tokenize_s = 0.0
        batches = 0  # encode_batch calls

        def flush() -> None:
            nonlocal chars, tokenize_s, batches
            if not batch:
                return
            t0 = time.perf_counter()
            flat, lengths, errors = encoder.encode_arrays(batch)
            tokenize_s += time.perf_counter() - t0
            batches += 1
            for i, reason in errors.items():
                quarantine.append({"seg": batch_segs[i], "line": batch_lines[i], "reason": reason})
            kept = lengths > 0
            if errors:
                kept[list(errors)] = False
            counts["empty_documents"] += len(batch) - len(errors) - int(kept.sum())
            segs = np.asarray(batch_segs, dtype=np.int64)[kept]
            np.add.at(seg_documents, segs, 1)
            np.add.at(seg_tokens, segs, lengths[kept])
            if kept.any():  # ids beyond the dtype cannot occur (dtype from the tokenizer); PartWriter re-checks
                writer.add_documents(flat, lengths[kept])  # rejected and empty documents hold no ids
            batch.clear()
            batch_segs.clear()
            batch_lines.clear()
            chars = 0

        try:
            preload = {n for n, s in enumerate(plan_segments) if preloadable(s)}
            read = read_inputs([{"path": s.path, "rel": s.rel, "fingerprint": list(s.fingerprint) or None}
                                for n, s in enumerate(plan_segments) if n in preload])  # lazily: one read per file
            whole_files = self.spec.doc_per == "file"  # a plain .txt file read whole: file_document, no reader
            for number, segment in enumerate(plan_segments):
                data = next(read) if number in preload else None
                whole = file_document(data, self.spec.max_doc_bytes) if (
                    whole_files and segment.kind == "txt" and not segment.compression) else None
                if whole is not None:
                    text, count = whole
                    if not text or text.isspace():
                        counts["empty_documents"] += 1
                    else:
                        batch.append(text)
                        batch_segs.append(number)
                        batch_lines.append(1)
                        chars += len(text)
                        counts["characters"] += len(text)
                        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                            flush()
                    lines.append(count)
                    digests.append(hashlib.sha256(data).digest())
                    continue
                reader = SegmentReader(segment, self.spec.field, self.spec.doc_per, self.spec.max_doc_bytes, data)
                for doc in reader:
                    if doc.reason is not None:
                        quarantine.append({"seg": number, "line": doc.line, "reason": doc.reason})
                        continue
                    if not doc.text or doc.text.isspace():
                        counts["empty_documents"] += 1
                        continue
                    batch.append(doc.text)
                    batch_segs.append(number)
                    batch_lines.append(doc.line)
                    chars += len(doc.text)
                    counts["characters"] += len(doc.text)
                    if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                        flush()  # a batch spans files: one encode_batch call for many small documents
                counts["blank_lines"] += reader.blank_lines
                lines.append(reader.lines)
                digests.append(hashlib.sha256(data).digest() if isinstance(data, bytes)
                               else None if data is not None else whole_file_sha256(segment))
            flush()
            part = writer.commit()
        except BaseException:
            writer.abort()
            raise
        part.update(bin=rel_prefix + part["bin"], idx=rel_prefix + part["idx"])
        rows_rel = digest_rows_name(task.task_id)
        rows = pack_digest_rows(digests)
        atomic_write_bytes(self.out / rows_rel, rows)
        return {"part": part, "outputs": [{"path": part["bin"], "bytes": part["bytes"]},
                                          {"path": part["idx"], "bytes": part["index_bytes"]},
                                          {"path": rows_rel, "bytes": len(rows)}],
                "segments": pack_ints(lines, seg_documents, seg_tokens),
                "digest_rows": len(digests), "quarantine": quarantine, **counts,
                "tokenize_seconds": round(tokenize_s, 4), "tokenize_batches": batches,
                "tokenizer_threads": threads.threads, "tokenizer_own_thread": threads.own_thread}

    # -- resume ---------------------------------------------------------------------------
    def _marker(self) -> dict | None:
        try:
            return json.loads(self.store.read_bytes(f"{STATE_DIR}/{MERGED_MARKER}") or b"null")
        except ValueError:
            return None

    def record_outputs(self, record: dict) -> list[dict]:
        """With --no-merge an empty part is deleted at finalize (not listed): its only output is its digest
        file."""
        outputs = super().record_outputs(record)
        if not self.spec.merge and not record.get("part", {}).get("documents"):
            part = record.get("part", {})
            return [o for o in outputs if o["path"] not in (part.get("bin"), part.get("idx"))]
        return outputs

    def outputs_intact(self, record: dict) -> bool:
        """A part is intact on disk, or already merged into the final prefix (parts removed); its digest
        file is intact either way."""
        if super().outputs_intact(record):
            return True
        marker = self._marker()
        if not self.spec.merge or not marker or record.get("plan_digest") != marker.get("plan_digest"):
            return False
        if marker["parts"].get(record.get("task_id")) != record["part"]["sha256"]:
            return False
        part = record["part"]
        others = [o for o in self.record_outputs(record) if o["path"] not in (part["bin"], part["idx"])]
        return all(self.store.size(o["path"]) == o["bytes"] for o in others) and self._final_intact(marker["entry"])

    def _final_intact(self, entry: dict) -> bool:
        return (self.store.size(entry["path"]) == entry["bytes"]
                and self.store.size(entry["index"]) == entry["index_bytes"])

    def watch_tasks(self, plan: Plan, records: dict[str, dict | None]):
        """A merge ahead of finalize (``repack.jobs.text_merge_ahead``) for a merged prefix in a local OUT, unless
        the parts were merged already (the marker of a run stopped after its merge)."""
        from repack.jobs.text_merge_ahead import MergeAhead

        self._ahead, self.merged_ahead = None, 0
        if not self.spec.merge or self.store.remote or len(plan.tasks) < 2:
            return None
        marker = self._marker()
        if marker and marker.get("plan_digest") == plan.digest:
            return None
        self._sweep_merge_temps()
        self._ahead = MergeAhead(self.out, self.out / f"{self.spec.name}.bin", [t.task_id for t in plan.tasks],
                                 records)
        return self._ahead

    def _sweep_merge_temps(self) -> None:
        """The merged prefix's temp files left by a killed run (this run holds OUT's lock)."""
        for stale in self.out.glob(f".{glob.escape(self.spec.name)}.*.tmp-*"):  # a name may hold [ ] * ?
            stale.unlink(missing_ok=True)

    # -- finalize -------------------------------------------------------------------------
    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        quarantine = [dict(q) for q in plan.quarantine]
        segments = SegmentColumns.of(plan, records)
        lines_before = segments.before_in_file(segments.lines)  # a segment's first line within its file
        barren = segments.of_barren_files()
        for number, record in enumerate(records):
            first, end = int(segments.starts[number]), int(segments.starts[number + 1])
            for q in sorted(record["quarantine"], key=lambda q: (q["seg"], q["line"])):
                seg = first + q["seg"] if q["seg"] < end - first else None
                rel = segments.rel(seg) if seg is not None else segments.rel(end - 1) if end > first else "?"
                quarantine.append({"source": rel, "line": int(lines_before[seg]) + q["line"] if seg is not None
                                   else q["line"], "reason": q["reason"],
                                   **({"no_documents": True} if seg is not None and barren[seg] else {})})
        removals: list = []  # the merged parts' removal, beside the rest of finalize
        with ThreadPoolExecutor(PART_REMOVERS) as remover:
            body = self._finalize_body(plan, records, quarantine, segments, lambda: removals.extend(
                self._drop_parts(records, remover)))
        for removal in removals:
            removal.result()  # an unlink that failed fails the job, as before
        if self.spec.merge:
            shutil.rmtree(self.out / STATE_DIR / "parts", ignore_errors=True)
        return body

    def _finalize_body(self, plan: Plan, records: list[dict], quarantine: list[dict], segments: SegmentColumns,
                       drop_parts) -> dict:
        """The manifest's body (``finalize``); ``drop_parts()`` starts removing the parts once merged."""
        spec = self.spec
        info = plan.info
        dtype = info["dtype"]
        parts = [r["part"] for r in records]
        if spec.merge:
            with ThreadPoolExecutor(1) as side:  # zlib and the part copies release the GIL: the two overlap
                runs = side.submit(segments.merged_runs_bytes)
                merged = self._merge(plan, records, dtype)
                drop_parts()
                entries = [self._with_side_file(merged, runs.result())]
            lengths = read_index(self.out / entries[0]["index"]).lengths
            if not entries[0]["samples"]:  # no document (every input quarantined or empty): no prefix, as without
                for key in ("path", "index", "source_runs"):  # --merge (Megatron cannot map an empty .bin)
                    if entries[0].get(key):
                        (self.out / entries[0][key]).unlink(missing_ok=True)
                entries = []
        else:
            entries = [{"path": pt["bin"], "index": pt["idx"], "prefix": pt["bin"][:-4], "samples": pt["documents"],
                        "tokens": pt["tokens"], "bytes": pt["bytes"], "sha256": pt["sha256"],
                        "index_bytes": pt["index_bytes"], "index_sha256": pt["index_sha256"], "dtype": dtype,
                        "max_token_id": pt["max_token_id"]}
                       for pt in parts if pt["documents"]]
            entries = [self._with_side_file(entry, segments.part_runs_bytes(number)) for entry, number in
                       zip(entries, [n for n, pt in enumerate(parts) if pt["documents"]])]
            for pt in parts:  # an empty part is not a prefix: remove it (its record lists no outputs)
                if not pt["documents"]:
                    for key in ("bin", "idx"):
                        (self.out / pt[key]).unlink(missing_ok=True)
            arrays = [np.asarray(read_index(self.out / e["index"]).lengths) for e in entries]
            lengths = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        doc_stats, histogram = token_stats(np.asarray(lengths))
        tok = dict(info["tokenizer"])
        tokenizer_src = Path(tok.pop("path"))
        atomic_write_bytes(self.out / TOKENIZER_COPY, planned_tokenizer_bytes(tokenizer_src, tok.get("sha256")))
        documents = sum(pt["documents"] for pt in parts)
        tokens = sum(pt["tokens"] for pt in parts)
        weights = " ".join(f"{e['tokens']} {e['prefix']}" for e in entries)
        return {
            "format": "memmap",
            "layout": "megatron-mmidx-v1",
            "fields": {"tokens": dtype},
            "dtype": dtype,
            "prefixes": [e["prefix"] for e in entries],
            "data_path": weights,
            "files": {"tokenizer": TOKENIZER_COPY},
            "tokenizer": {**tok, "append_eos": spec.append_eos, "add_bos": spec.add_bos,
                          "template_special_tokens": spec.special_tokens, "file": TOKENIZER_COPY},
            "shards": entries,
            "totals": {"inputs": info["inputs"], "files": info["files"], "documents": documents, "samples": documents,
                       "tokens": tokens, "quarantined": len(quarantine),
                       "empty_documents": sum(r["empty_documents"] for r in records),
                       "blank_lines": sum(r["blank_lines"] for r in records),
                       "bytes": sum(e["bytes"] + e["index_bytes"] for e in entries),
                       "input_bytes": info["input_bytes"], "skipped_files": info["skipped_files"],
                       "parts": len(parts)},
            "quarantine": quarantine,
            "stats": {"document_tokens": doc_stats, "document_tokens_histogram": histogram,
                      "characters": sum(r["characters"] for r in records),
                      "parts": [{"part": r["task_id"], "documents": r["part"]["documents"],
                                 "tokens": r["part"]["tokens"], "sha256": r["part"]["sha256"],
                                 "index_sha256": r["part"]["index_sha256"],
                                 "lines": int(segments.lines[segments.starts[n]:segments.starts[n + 1]].sum())}
                                for n, r in enumerate(records)],
                      "files": _file_stats(segments)},
            "run_stats": {"tokenize_seconds": round(sum(r.get("tokenize_seconds", 0.0) for r in records), 3),
                          "tokenize_batches": sum(r.get("tokenize_batches", 0) for r in records),
                          "tokenizer_threads": sorted({r["tokenizer_threads"] for r in records
                                                       if r.get("tokenizer_threads") is not None}),
                          "tokenizer_own_thread": any(r.get("tokenizer_own_thread") for r in records),
                          "parts_merged_ahead": self.merged_ahead},
        }

    def _with_side_file(self, entry: dict, data: bytes) -> dict:
        """``entry`` naming its side file ``<prefix>.sources`` holding ``data`` (written here): where its documents
        come from (``repack.manifest.source_runs``), so the manifest's size does not grow with the input files."""
        rel = entry["prefix"] + RUNS_SUFFIX
        atomic_write_bytes(self.out / rel, data)
        return {**entry, **side_entry(rel, data)}

    def _merge(self, plan: Plan, records: list[dict], dtype: str) -> dict:
        """Concatenate the parts in plan order into OUT/<name>.bin/.idx (once), then drop them."""
        name = self.spec.name
        digest = plan.digest
        marker = self._marker()
        wanted = {r["task_id"]: r["part"]["sha256"] for r in records}
        if marker and marker.get("plan_digest") == digest and marker.get("parts") == wanted \
                and self._final_intact(marker["entry"]):
            entry = marker["entry"]
            for rel in (entry["path"], entry["index"]):  # object store, scratch lost: finalize reads them
                if not (self.out / rel).is_file():
                    self.store.fetch(rel, self.out / rel)
        else:
            appended = self._ahead.take(records) if self._ahead is not None else None  # the parts merged while tasks ran
            self.merged_ahead = appended.parts if appended is not None else 0
            if appended is None:
                self._sweep_merge_temps()
            merged = merge_parts([(self.out / r["part"]["bin"], self.out / r["part"]["idx"]) for r in records],
                                 CODE_OF[dtype], self.out / f"{name}.bin", self.out / f"{name}.idx", appended)
            entry = {"path": f"{name}.bin", "index": f"{name}.idx", "prefix": name, "samples": merged["documents"],
                     "tokens": merged["tokens"], "bytes": merged["bytes"], "sha256": merged["sha256"],
                     "index_bytes": merged["index_bytes"], "index_sha256": merged["index_sha256"], "dtype": dtype,
                     "max_token_id": max((r["part"]["max_token_id"] for r in records), default=-1)}
            for rel in (entry["path"], entry["index"]):  # object store: uploaded (checked) before the marker
                self.store.publish(rel, self.out / rel)
            self.store.put_bytes(f"{STATE_DIR}/{MERGED_MARKER}",
                                 dumps_canonical({"plan_digest": digest, "parts": wanted, "entry": entry}))
        return entry

    def _drop_parts(self, records: list[dict], remover: ThreadPoolExecutor) -> list:
        """Remove the merged parts (after the marker) on ``remover``'s threads, beside the rest of finalize:
        an unlink waits on the file system (freeing the part's blocks), hardly on the CPU; the futures."""
        def drop(paths: list[Path]) -> None:
            for path in paths:
                path.unlink(missing_ok=True)

        paths = [self.out / r["part"][key] for r in records for key in ("bin", "idx")]
        step = max(1, -(-len(paths) // PART_REMOVERS))
        return [remover.submit(drop, paths[i:i + step]) for i in range(0, len(paths), step)]

    def summary_lines(self, manifest: dict) -> list[str]:
        t = manifest["totals"]
        stats = manifest["stats"].get("document_tokens", {})
        lines = [f"{t['documents']} documents, {t['tokens']} tokens ({manifest['dtype']}) from {t['files']} file(s) "
                 f"in {t['parts']} part(s); {t['empty_documents']} empty skipped; {t['quarantined']} quarantined"]
        if t.get("skipped_files"):  # hidden files, and names no text input takes (a README, a .csv)
            lines.append(f"{t['skipped_files']} other file(s) of SOURCE not read (hidden, or no .jsonl/.json/"
                         ".ndjson/.txt/.parquet name, optionally .gz/.zst/.zstd)")
        if stats:
            lines.append(f"tokens per document: p50 {stats['p50']} p90 {stats['p90']} p99 {stats['p99']} "
                         f"max {stats['max']}")
        if manifest["prefixes"]:
            root = self.store.url if self.store.remote else str(Path(self.store.url).absolute())  # as reports show it
            lines.append(f"Megatron --data-path {megatron_data_path(manifest, root)}")
        return lines + quarantine_lines(manifest["quarantine"],
                                        lambda reason: reason.split(RUN_SUFFIX, 1)[0].split(":")[0])
