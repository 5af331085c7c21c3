"""``--to lmdb``: one LMDB environment per dataset, ``OUT/data.lmdb`` (a single file, no lock file).

How it is written (a single writer, fed by parallel workers)
  1. Each task (worker) writes its samples to a *part*: a tar + DALI index under
     ``OUT/.repack/parts/<task>.tar|.idx`` (``tar_format`` layout, written to a temp name and
     renamed whole).
  2. The driver process imports finished parts strictly in plan (task) order, each in ONE
     write transaction together with the task's record ``t/<task>``, then deletes the part.
     Sample indices are therefore contiguous ``0..N-1`` in plan order, whatever order the
     workers finish in and however many inputs were quarantined. kill -9 at any point leaves
     either the whole task in the database or none of it (its part stays for the re-run).
     The map grows by doubling on MapFullError (the transaction is retried).
  3. Finalize imports what is left (``repack merge`` of static partitions), then rebuilds the
     database into a fresh environment in key order (append mode, fixed batches): no free
     pages, and byte-identical files for the same content whatever the history (resumes, map
     growth). It replaces ``data.lmdb`` by rename.

Key layout (all keys ASCII, sortable; values raw bytes, ASCII integers or JSON, never pickle)::

  __meta__              JSON {"layout": "repack-lmdb/1", "count": N, "classes": {name: index},
                        "labeled": bool, "fields": {...}, "key_width": 10}
  s/<index:010d>/img    the image file's bytes (type from content; JPEG with --normalize)
  s/<index:010d>/cls    class index as ASCII decimal digits (labeled datasets only)
  s/<index:010d>/json   JSON metadata {path, class, width, height, bytes, format, ...}
  t/<task id>           JSON {"task_id", "start", "samples", "part_sha256"}: resume bookkeeping

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
from repack.sinks.checks import check_file, sha256_file
from repack.sinks.webdataset import TarShardWriter

LAYOUT = "repack-lmdb/1"
DB_NAME = "data.lmdb"
PARTS_DIR = ".repack/parts"
KEY_WIDTH = 10
META_KEY = b"__meta__"
INITIAL_MAP = 64 << 20
REBUILD_BATCH = 2000
REBUILD_BATCH_BYTES = 8 << 20  # ... or this many bytes per write transaction (its dirty pages live in memory)
REBUILD_WINDOW = 32 << 20  # bytes copied per opening of the source (bounds mapped memory)


def sample_key(index: int, field: str) -> bytes:
    """``s/0000000042/img``."""
    return b"s/%010d/%s" % (index, field.encode("ascii"))


def task_key(task_id: str) -> bytes:
    return b"t/" + task_id.encode("ascii")


def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _open(path: Path, readonly: bool, map_size: int = INITIAL_MAP):
    import lmdb

    # lock=False: the job engine's flock already guarantees one writer per OUT; readers get
    # the finished file only after the manifest exists.
    return lmdb.open(str(path), subdir=False, lock=False, readonly=readonly, map_size=map_size,
                     readahead=False, max_dbs=0, meminit=True)


class PartWriter(TarShardWriter):
    """A task's samples as a tar part under ``OUT/.repack/parts``; commit() gives the record's part entry."""

    def __init__(self, out: Path, stem: str) -> None:
        self.root = Path(out)
        parts = self.root / PARTS_DIR
        parts.mkdir(parents=True, exist_ok=True)
        super().__init__(parts, stem)

    def commit(self) -> dict | None:
        shard = super().commit()
        if shard is None:
            return None
        shard["path"] = f"{PARTS_DIR}/{shard['path']}"
        shard["index"] = f"{PARTS_DIR}/{shard['index']}"
        return shard


def _read_part(root: Path, part: dict):
    """Yield each sample of a part as {field: bytes} (fields: img, cls, json), in order."""
    index = (root / part["index"]).read_text(encoding="ascii").splitlines()
    with open(root / part["path"], "rb") as fh:
        for line in index[1:]:
            tokens = line.split(" ")
            sample = {}
            for i in range(0, len(tokens), 4):
                ext, off, size = tokens[i], int(tokens[i + 1]), int(tokens[i + 2])
                sample[ext] = os.pread(fh.fileno(), size, off)
            yield sample


class LmdbCollector:
    """Driver-side single writer: imports parts in plan order, rebuilds and describes the final file."""

    def __init__(self, out: Path, initial_map: int = INITIAL_MAP) -> None:
        self.out = Path(out)
        self.path = self.out / DB_NAME
        self.initial_map = initial_map
        self._env = None
        self._done: dict[str, dict] | None = None  # task id -> its t/ record in the database
        self._pending: dict[str, dict] = {}
        self._next = 0
        self._count = 0

    # -- state ---------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict]:
        if self._done is None:
            self._done = {}
            if self.path.exists():
                env = self._writer() if self._env is not None else _open(self.path, readonly=True)
                try:
                    with env.begin() as txn:
                        cursor = txn.cursor()
                        if cursor.set_range(b"t/"):
                            for key, value in cursor:
                                if not key.startswith(b"t/"):
                                    break
                                rec = json.loads(value)
                                self._done[rec["task_id"]] = rec
                        meta = txn.get(META_KEY)
                        self._count = json.loads(meta)["count"] if meta else 0
                finally:
                    if env is not self._env:
                        env.close()
        return self._done

    def _writer(self):
        if self._env is None:
            size = self.path.stat().st_size if self.path.exists() else 0
            self._env = _open(self.path, readonly=False, map_size=max(self.initial_map, 2 * size))
        return self._env

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def intact(self, record: dict) -> bool:
        """True when the task is in the database, or its part is on disk whole (to be imported)."""
        part = record.get("part")
        done = self._load().get(record["task_id"])
        if done is not None:
            return done.get("part_sha256") == (part or {}).get("sha256")
        if part is None:
            return True
        try:
            return (os.path.getsize(self.out / part["path"]) == part["bytes"]
                    and os.path.getsize(self.out / part["index"]) == part["index_bytes"])
        except OSError:
            return False

    # -- import --------------------------------------------------------------------------------
    def absorb(self, record: dict, order: list[str]) -> None:
        """Take a finished task's record; import every part that is next in plan order."""
        done = self._load()
        self._pending[record["task_id"]] = record
        while self._next < len(order):
            task_id = order[self._next]
            if task_id in done:
                self._drop_part(self._pending.pop(task_id, None))
            elif task_id in self._pending:
                self._import(self._pending.pop(task_id))
            else:
                break
            self._next += 1

    def _import(self, record: dict) -> None:
        """Stream one part into ONE write transaction (memory: one sample at a time, not the part)."""
        import lmdb

        part = record.get("part")
        start = self._count
        env = self._writer()
        while True:
            count = 0
            try:
                with env.begin(write=True) as txn:
                    for sample in _read_part(self.out, part) if part else ():
                        for field, value in sample.items():
                            if field == "cls":
                                value = b"%d" % int(value)
                            txn.put(sample_key(start + count, field), value)
                        count += 1
                    entry = {"task_id": record["task_id"], "start": start, "samples": count,
                             "part_sha256": part["sha256"] if part else None}
                    txn.put(task_key(record["task_id"]), _json(entry))
                    txn.put(META_KEY, _json({"layout": LAYOUT, "count": start + count}))
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
        self._count = start + count
        self._done[record["task_id"]] = entry
        self._drop_part(record)

    def _drop_part(self, record: dict | None) -> None:
        part = (record or {}).get("part")
        if part:
            (self.out / part["path"]).unlink(missing_ok=True)
            (self.out / part["index"]).unlink(missing_ok=True)

    # -- finish --------------------------------------------------------------------------------
    def finish(self, records: list[dict], meta: dict) -> dict:
        """Import what is left, write the metadata, rebuild deterministically; the manifest's shard entry."""
        order = [r["task_id"] for r in records]
        done = self._load()
        for record in records:
            if record["task_id"] not in done:
                part = record.get("part")
                if part and not (self.out / part["path"]).exists():
                    raise RepackError(f"task {record['task_id']}: part {part['path']} is missing; re-run the job")
            self.absorb(record, order)
        if self._next < len(order):
            raise RepackError(f"lmdb: task {order[self._next]} was not imported")
        full_meta = {**meta, "layout": LAYOUT, "count": self._count, "key_width": KEY_WIDTH}
        env = self._writer()
        with env.begin(write=True) as txn:
            txn.put(META_KEY, _json(full_meta))
        self.close()
        self._rebuild()
        shutil.rmtree(self.out / PARTS_DIR, ignore_errors=True)
        return {"path": DB_NAME, "samples": self._count, "bytes": self.path.stat().st_size,
                "sha256": sha256_file(self.path), "layout": LAYOUT}

    def _rebuild(self) -> None:
        """Copy every key, in order, into a fresh environment; rename it over data.lmdb.

        The map size (stored in the file) is derived from the content only, so equal content
        gives equal bytes whatever the working database's history was.
        """
        import lmdb

        tmp = self.out / f".{DB_NAME}.tmp-rebuild"
        src = _open(self.path, readonly=True)
        stat = src.stat()  # live entries and their overflow pages: set by the content, not the history
        src.close()
        content = stat["overflow_pages"] * stat["psize"] + stat["entries"] * 4096
        map_size = max(INITIAL_MAP, 1 << (2 * content).bit_length())
        while True:
            tmp.unlink(missing_ok=True)
            try:
                after, more = None, True
                while more:
                    after, more = self._copy_window(tmp, map_size, after)
                break
            except lmdb.MapFullError:
                map_size *= 2
        fd = os.open(tmp, os.O_RDONLY)  # the copy commits without fsync; one fsync before the rename
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.out)

    def _copy_window(self, tmp: Path, map_size: int, after: bytes | None) -> tuple[bytes | None, bool]:
        """Copy the keys after ``after`` (from the first when None), in order, into ``tmp`` until about
        REBUILD_WINDOW bytes; (last key copied, whether keys remain). Both environments are open
        for this window only: closing them unmaps the pages touched, so memory stays flat."""
        import lmdb

        src = _open(self.path, readonly=True)
        dst = lmdb.open(str(tmp), subdir=False, lock=False, map_size=map_size, readahead=False, max_dbs=0,
                        meminit=True, sync=False)
        copied = 0
        try:
            with src.begin() as rtxn:
                cursor = rtxn.cursor()
                if after is None:
                    more = cursor.first()
                else:
                    more = cursor.set_range(after)
                    if more and cursor.key() == after:
                        more = cursor.next()
                while more and copied < REBUILD_WINDOW:
                    with dst.begin(write=True) as wtxn:  # a batch: REBUILD_BATCH keys or REBUILD_BATCH_BYTES
                        batch_end = copied + REBUILD_BATCH_BYTES
                        for _ in range(REBUILD_BATCH):
                            key, value = cursor.key(), cursor.value()
                            wtxn.put(key, value, append=True)
                            copied += len(key) + len(value)
                            after = key
                            more = cursor.next()
                            if not more or copied >= batch_end:
                                break
        finally:
            dst.close()
            src.close()
        return after, more


class LmdbSink:
    """The ``--to lmdb`` plugin: workers write parts, the driver's collector owns the database."""

    name = "lmdb"

    @staticmethod
    def open_shard(out: Path, stem: str) -> PartWriter:
        return PartWriter(out, stem)

    @staticmethod
    def outputs(part: dict) -> list[dict]:
        """Files a task's record stands for (``--overwrite`` removes them); data.lmdb is shared."""
        return [{"path": part["path"], "bytes": part["bytes"]}, {"path": part["index"], "bytes": part["index_bytes"]},
                {"path": DB_NAME, "bytes": -1}]

    @staticmethod
    def collector(out: Path) -> LmdbCollector:
        return LmdbCollector(out)

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Size, sha256, metadata count and the contiguous s/ keys of the database."""
        path = Path(root) / shard["path"]
        if not check_file(root, shard["path"], shard["bytes"], shard["sha256"], check):
            return
        check(shard.get("layout") == LAYOUT, f"{shard['path']}: unknown layout {shard.get('layout')!r}")
        try:
            env = _open(path, readonly=True)
        except Exception as exc:  # noqa: BLE001 - lmdb.Error and OSError: not a database
            check(False, f"{shard['path']}: not a readable LMDB ({exc})")
            return
        try:
            with env.begin() as txn:
                raw = txn.get(META_KEY)
                meta = json.loads(raw) if raw else {}
                check(meta.get("count") == shard["samples"],
                      f"{shard['path']}: metadata count {meta.get('count')}, manifest says {shard['samples']}")
                expected, bad, has_img = 0, 0, False
                cursor = txn.cursor()
                if cursor.set_range(b"s/"):
                    for key in cursor.iternext(keys=True, values=False):
                        if not key.startswith(b"s/"):
                            break
                        _, index, field = key.split(b"/")
                        if int(index) == expected:  # first key of the next sample
                            if expected and not has_img:
                                bad += 1
                            expected, has_img = expected + 1, False
                        elif int(index) != expected - 1:
                            bad += 1
                        has_img = has_img or field == b"img"
                if expected and not has_img:
                    bad += 1
                check(bad == 0 and expected == shard["samples"],
                      f"{shard['path']}: sample keys are not s/0..{shard['samples'] - 1} each with an image "
                      f"({expected} found in order, {bad} out of place or without an image)")
        finally:
            env.close()
