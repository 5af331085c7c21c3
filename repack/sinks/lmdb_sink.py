"""``--to lmdb``: one LMDB environment per dataset, ``OUT/data.lmdb`` (a single file, no lock file).

How it is written (a single writer, fed by parallel workers)
  1. Each task (worker) writes its samples to a *part*: tar members (``tar_format`` layout, no
     end-of-archive) under ``OUT/.repack/parts/<task>.seg``, renamed into place whole, and beside it
     ``<task>.seg.idx``, the part's index (a DALI index line per sample: each member's extension, offset,
     size and name), renamed into place whole too; the task's record names both (their sizes and the
     sample count: nothing per sample, so neither the job state nor the driver holds an object per
     sample; a record of an older repack listed each sample's members, and is read as it is).
  2. Finalize (the driver; ``repack merge`` for static partitions) writes the database ONCE,
     into a fresh environment, in key order (append mode, fixed batches of at most
     BUILD_BATCH keys or BUILD_BATCH_BYTES): ``__meta__``, then every part's samples in plan
     order, then the ``t/`` records. Sample indices are therefore contiguous ``0..N-1`` in plan
     order, whatever order the workers finished in and however many inputs were quarantined,
     and the file is byte-identical for the same content and options whatever the history (resumes,
     workers, executors, partitions; ``--chunk-size`` sets the tasks, hence the ``t/`` records). The map size comes from the parts' bytes and doubles on
     MapFullError (the build restarts). The environment is reopened every BUILD_WINDOW bytes
     so memory stays flat; the copy is fsynced, renamed over ``data.lmdb``, then the parts go.

Key layout (all keys ASCII, sortable; values raw bytes, ASCII integers or JSON, never pickle)::

  __meta__              JSON {"layout": "repack-lmdb/1", "count": N, "classes": {name: index},
                        "labeled": bool, "fields": {...}, "key_width": 10}
  s/<index:010d>/img    the image file's bytes (type from content; JPEG with --normalize)
  s/<index:010d>/cls    class index as ASCII decimal digits (labeled datasets only)
  s/<index:010d>/json   JSON metadata {path, class, width, height, bytes, format, ...}
  t/<task id>           JSON {"task_id", "start", "samples", "part_bytes"}: resume bookkeeping (a
                        run killed after the rename and before the manifest trusts these)

The manifest holds one shard entry: ``{"path": "data.lmdb", "samples", "bytes", "sha256",
"layout": "repack-lmdb/1"}``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from repack.errors import RepackError
from repack.manifest.io import fsync_dir
from repack.manifest.lmdb_meta import lmdb_file_problem
from repack.read_at import read_at
from repack.sinks.checks import check_file, sha256_file
from repack.sinks.webdataset import TarSegmentWriter

LAYOUT = "repack-lmdb/1"
DB_NAME = "data.lmdb"
PARTS_DIR = ".repack/parts"
KEY_WIDTH = 10
META_KEY = b"__meta__"
INITIAL_MAP = 64 << 20
BUILD_BATCH = 2000
BUILD_BATCH_BYTES = 8 << 20  # ... or this many bytes per write transaction (its dirty pages live in memory)
BUILD_WINDOW = 32 << 20  # bytes written per opening of the environment (bounds mapped memory)


def sample_key(index: int, field: str) -> bytes:
    """``s/0000000042/img``."""
    return b"s/%010d/%s" % (index, field.encode("ascii"))


def task_key(task_id: str) -> bytes:
    return b"t/" + task_id.encode("ascii")


def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()




def _open(path: Path):
    """A finished database, read-only."""
    import lmdb

    # lock=False: the job engine's flock already guarantees one writer per OUT; readers get
    # the finished file only after the manifest exists.
    return lmdb.open(str(path), subdir=False, lock=False, readonly=True, readahead=False, max_dbs=0)


class PartWriter(TarSegmentWriter):
    """A task's samples as a part under ``OUT/.repack/parts``; commit() gives the record's part entry."""

    def __init__(self, out: Path, stem: str) -> None:
        super().__init__(Path(out) / PARTS_DIR, stem)

    def commit(self) -> dict | None:
        piece = super().commit()
        if not piece["count"]:
            (self.folder / piece["name"]).unlink()
            return None
        index = piece["index"].encode("ascii") + b"\n"  # what the collector reads back: a line per sample
        name = f"{piece['name']}.idx"
        tmp = self.folder / f".{name}.tmp-{os.getpid()}"
        tmp.write_bytes(index)
        os.replace(tmp, self.folder / name)
        return {"path": f"{PARTS_DIR}/{piece['name']}", "bytes": piece["bytes"], "count": piece["count"],
                "idx": f"{PARTS_DIR}/{name}", "idx_bytes": len(index)}


def part_samples(part: dict) -> int:
    """The samples of a task's part (a record of an older repack lists them)."""
    return int(part["count"]) if "count" in part else len(part["samples"])


def _members(root: Path, part: dict):
    """Each sample of a part as its members' [(ext, offset, size)]: from the part's index file, a line at a time
    (an older repack's record lists them); a line of another shape is a damaged part, named."""
    if "samples" in part:
        for _, members in part["samples"]:
            yield members
        return
    with open(root / part["idx"], "rb") as fh:
        for line in fh:
            fields = line.split()
            if not fields or len(fields) % 4:
                raise OSError(f"{part['idx']}: not an index line: {line[:80]!r}")
            yield [(ext.decode("ascii"), int(off), int(size)) for ext, off, size in
                   zip(fields[::4], fields[1::4], fields[2::4])]


def _read_part(root: Path, part: dict):
    """Yield each sample of a part as [(field, bytes)] in key order (cls, img, json)."""
    with open(root / part["path"], "rb") as fh:
        for members in _members(root, part):
            yield sorted((ext, _whole(fh, size, off, part)) for ext, off, size in members)


def _whole(fh, size: int, offset: int, part: dict) -> bytes:
    """A member's bytes in a part file (a short read fails the task: never a cut value in the database)."""
    data = read_at(fh.fileno(), size, offset)
    if len(data) != size:
        raise OSError(f"{part['path']}: ends inside a member (bytes {offset}..{offset + size})")
    return data


def _open_for_write(path: Path, map_size: int):
    import lmdb

    # sync=False: the finished copy is fsynced once, before its rename.
    return lmdb.open(str(path), subdir=False, lock=False, map_size=map_size, readahead=False, max_dbs=0,
                     meminit=True, sync=False)


BUILD_TMP = f".{DB_NAME}.tmp-build"  # the database while it is built (renamed over DB_NAME when whole)


def _task_entries(records: list[dict]) -> dict[str, dict]:
    """task id -> the ``t/`` record a database built from ``records`` holds (``LmdbCollector._items``)."""
    entries, start = {}, 0
    for record in records:
        part = record.get("part")
        samples = part_samples(part) if part else 0
        entries[record["task_id"]] = {"task_id": record["task_id"], "start": start, "samples": samples,
                                      "part_bytes": part["bytes"] if part else None}
        start += samples
    return entries


class LmdbCollector:
    """Driver-side single writer: builds the database from the parts, in plan order, at finalize."""

    def __init__(self, out: Path, initial_map: int | None = None) -> None:
        self.out = Path(out)
        self.path = self.out / DB_NAME
        self.initial_map = initial_map  # None: from the parts' bytes
        self._built_tasks: dict[str, dict] | None = None

    def built(self) -> dict[str, dict]:
        """task id -> its ``t/`` record in a finished ``data.lmdb`` (empty when there is none)."""
        if self._built_tasks is None:
            self._built_tasks = {}
            if self.path.exists():
                env = _open(self.path)
                try:
                    with env.begin() as txn:
                        cursor = txn.cursor()
                        if cursor.set_range(b"t/"):
                            for key, value in cursor:
                                if not key.startswith(b"t/"):
                                    break
                                rec = json.loads(value)
                                self._built_tasks[rec["task_id"]] = rec
                finally:
                    env.close()
        return self._built_tasks

    def intact(self, record: dict) -> bool:
        """True when the task's part is on disk whole, or the finished database holds the task."""
        part = record.get("part")
        done = self.built().get(record["task_id"])
        if done is not None:
            return done.get("part_bytes") == (part or {}).get("bytes")
        if part is None:
            return True
        try:
            return os.path.getsize(self.out / part["path"]) == part["bytes"] and \
                ("idx" not in part or os.path.getsize(self.out / part["idx"]) == part["idx_bytes"])
        except (OSError, KeyError):
            return False

    def finish(self, records: list[dict], meta: dict) -> dict:
        """Write the database (unless a finished one already holds exactly these tasks: their ids, sample ranges
        and part sizes); its manifest entry."""
        built = self.built()
        if not built or built != _task_entries(records):
            missing = [r["task_id"] for r in records if r.get("part") and
                       not all((self.out / r["part"][key]).exists() for key in ("path", "idx") if key in r["part"])]
            if missing:
                raise RepackError(f"lmdb: the part of task {missing[0]} is missing; re-run the job "
                                  "(--overwrite if OUT was changed by hand)")
            self._build(records, meta)
        shutil.rmtree(self.out / PARTS_DIR, ignore_errors=True)
        env = _open(self.path)
        try:
            with env.begin() as txn:
                count = json.loads(txn.get(META_KEY))["count"]
        finally:
            env.close()
        return {"path": DB_NAME, "samples": count, "bytes": self.path.stat().st_size,
                "sha256": sha256_file(self.path), "layout": LAYOUT}

    def _items(self, records: list[dict], meta: dict):
        """Every (key, value) of the database, in key order."""
        count = sum(part_samples(r["part"]) for r in records if r.get("part"))
        yield META_KEY, _json({**meta, "layout": LAYOUT, "count": count, "key_width": KEY_WIDTH})
        tasks = []
        index = 0
        for record in records:
            part = record.get("part")
            start = index
            for sample in _read_part(self.out, part) if part else ():
                for field, value in sample:
                    yield sample_key(index, field), b"%d" % int(value) if field == "cls" else value
                index += 1
            tasks.append((record["task_id"], {"task_id": record["task_id"], "start": start, "samples": index - start,
                                              "part_bytes": part["bytes"] if part else None}))
        for task_id, entry in sorted(tasks):
            yield task_key(task_id), _json(entry)

    def _build(self, records: list[dict], meta: dict) -> None:
        """Write every key, in order, into a fresh environment; fsync it and rename it over data.lmdb.

        The map size (stored in the file) is derived from the content only, so equal content
        gives equal bytes.
        """
        import lmdb

        tmp = self.out / BUILD_TMP
        content = sum(r["part"]["bytes"] + 4096 * 3 * part_samples(r["part"]) for r in records if r.get("part"))
        map_size = self.initial_map or max(INITIAL_MAP, 1 << (2 * content).bit_length())
        while True:
            tmp.unlink(missing_ok=True)
            try:
                self._write_sorted(tmp, map_size, self._items(records, meta))
                break
            except lmdb.MapFullError:
                map_size *= 2
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.out)
        self._built_tasks = None

    @staticmethod
    def _write_sorted(tmp: Path, map_size: int, items) -> None:
        """Put ``items`` (sorted) with append=True in batches of BUILD_BATCH keys or BUILD_BATCH_BYTES,
        reopening the environment every BUILD_WINDOW bytes: closing it unmaps the pages the kernel
        mapped around the ones touched, so memory stays flat."""
        pending = next(items, None)
        copied = 0
        while pending is not None:
            env = _open_for_write(tmp, map_size)
            try:
                window_end = copied + BUILD_WINDOW
                while pending is not None and copied < window_end:
                    with env.begin(write=True) as txn:
                        batch_end = copied + BUILD_BATCH_BYTES
                        for _ in range(BUILD_BATCH):
                            key, value = pending
                            txn.put(key, value, append=True)
                            copied += len(key) + len(value)
                            pending = next(items, None)
                            if pending is None or copied >= batch_end:
                                break
            finally:
                env.close()


class LmdbSink:
    """The ``--to lmdb`` plugin: workers write parts, the driver's collector owns the database."""

    name = "lmdb"

    @staticmethod
    def open_shard(out: Path, stem: str) -> PartWriter:
        return PartWriter(out, stem)

    @staticmethod
    def outputs(part: dict) -> list[dict]:
        """Files a task's record stands for (``--overwrite`` removes them); data.lmdb is shared."""
        return [{"path": part["path"], "bytes": part["bytes"]},
                *([{"path": part["idx"], "bytes": part["idx_bytes"]}] if "idx" in part else []),
                {"path": DB_NAME, "bytes": -1}]

    @staticmethod
    def collector(out: Path) -> LmdbCollector:
        return LmdbCollector(out)

    @staticmethod
    def verify_facts(data: dict) -> dict:
        """Whether the dataset is labeled (its fields name ``cls``): then every sample holds a class; and its class
        map, which the database's own metadata must hold."""
        return {"labeled": "cls" in (data.get("fields") or {}), "classes": data.get("classes") or {}}

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Size, sha256, metadata count and the contiguous s/ keys of the database, each sample with its
        image (and its class, in a labeled dataset: ``verify_facts``)."""
        path = Path(root) / shard["path"]
        if not check_file(root, shard["path"], shard["bytes"], shard["sha256"], check):
            return
        check(shard.get("layout") == LAYOUT, f"{shard['path']}: unknown layout {shard.get('layout')!r}")
        problem = lmdb_file_problem(path) if path.stat().st_size == shard["bytes"] else "size differs from the manifest"
        if problem:  # never mapped: a read past the end of a short file is SIGBUS, not an exception
            check(False, f"{shard['path']}: not opened as LMDB ({problem})")
            return
        try:
            env = _open(path)
        except Exception as exc:  # noqa: BLE001 - lmdb.Error and OSError: not a database
            check(False, f"{shard['path']}: not a readable LMDB ({exc})")
            return
        try:
            with env.begin() as txn:
                raw = txn.get(META_KEY)
                try:
                    meta = json.loads(raw) if raw else {}
                except ValueError:
                    meta = None
                if not isinstance(meta, dict):
                    check(False, f"{shard['path']}: the {META_KEY.decode()} record is not a JSON object")
                    meta = {}
                check(meta.get("count") == shard["samples"],
                      f"{shard['path']}: metadata count {meta.get('count')}, manifest says {shard['samples']}")
                labeled = (shard.get("dataset_facts") or {}).get("labeled")
                if labeled is not None:
                    check(meta.get("labeled", labeled) == labeled,
                          f"{shard['path']}: its metadata says labeled={meta.get('labeled')}, the manifest's fields "
                          f"{'name' if labeled else 'do not name'} cls")
                facts = shard.get("dataset_facts") or {}
                if "classes" in facts and isinstance(meta.get("classes"), dict):
                    check(meta["classes"] == facts["classes"],
                          f"{shard['path']}: its metadata's class map differs from the manifest's classes (a label "
                          "would name another class)")
                expected, bad, has_img, has_cls = 0, 0, False, not labeled  # an unlabeled sample needs no class
                known = set(facts["classes"].values()) if isinstance(facts.get("classes"), dict) \
                    else None  # a class must be one the map names: the readers refuse any other
                unknown: list[bytes] = []
                cursor = txn.cursor()
                if cursor.set_range(b"s/"):
                    for key in cursor.iternext(keys=True, values=False):
                        if not key.startswith(b"s/"):
                            break
                        _, index, field = key.split(b"/")
                        if int(index) == expected:  # first key of the next sample
                            if expected and not (has_img and has_cls):
                                bad += 1
                            expected, has_img, has_cls = expected + 1, False, not labeled
                        elif int(index) != expected - 1:
                            bad += 1
                        if field == b"img":
                            has_img = True
                        elif field == b"cls":
                            has_cls = True
                            if labeled and known is not None:
                                value = cursor.value()  # ASCII digits, as the readers parse them
                                if not (value.isdigit() and int(value) in known):
                                    unknown.append(key)
                if expected and not (has_img and has_cls):
                    bad += 1
                check(not unknown, f"{shard['path']}: {len(unknown)} sample(s) hold a class the class map does not name "
                                   f"(first: {b', '.join(unknown[:3]).decode(errors='replace')})")
                what = "an image and a class" if labeled else "an image"
                check(bad == 0 and expected == shard["samples"],
                      f"{shard['path']}: sample keys are not s/0..{shard['samples'] - 1} each with {what} "
                      f"({expected} found in order, {bad} out of place or without {what})")
        except Exception as exc:  # noqa: BLE001 - lmdb.Error (a damaged page), a key of another shape: named
            check(False, f"{shard['path']}: its records cannot be read ({type(exc).__name__}: {exc})")
        finally:
            env.close()
