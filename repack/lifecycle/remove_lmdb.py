"""`repack remove` for an LMDB image dataset: the database rewritten without the named samples.

A sample is named by its source (the ``path`` of its ``s/<index>/json`` record; LMDB samples have no
keys, so ``--keys`` is refused). The kept samples are copied, values untouched and in order, into a
fresh database ``data-vN.lmdb`` (indices renumbered ``0..M-1``, ``__meta__``'s count updated; the
build's ``t/`` resume records are not copied): a new name, so a reader that opened version N - 1
keeps reading its ``data.lmdb`` until ``repack gc`` deletes it. The file is written as the job
writes one (``repack.sinks.lmdb_sink``: sorted keys, a map size from the content only), to a temp
name, fsynced and renamed: a re-run after kill -9 writes the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from repack.errors import UsageError, VerificationError
from repack.lifecycle.publish import refuse_names_in_use
from repack.lifecycle.rewrite import Rewrite, refuse_unrecorded
from repack.manifest import Manifest
from repack.manifest.lmdb_meta import lmdb_file_problem
from repack.sinks.checks import sha256_file
from repack.sinks.lmdb_sink import INITIAL_MAP, META_KEY, LmdbCollector, _json, _open, sample_key
from repack.transforms.image_check import dali_misread_of


def rewrite_lmdb(store, out: Path, current: dict, spec, number: int):
    """The version's database without the named samples (see the module docstring)."""
    import lmdb


    if spec.by == "keys":
        raise UsageError(f"{out}: the samples of an LMDB dataset have no keys (they are numbered 0..N-1): name "
                         "them by source with --sources")
    entry = current["shards"][0]
    path = Manifest(out, current).path(entry["path"])
    wanted = set(spec.names)
    names_by_index = {index: name for name, index in (current.get("classes") or {}).items()}
    refuse_unrecorded(out, entry["path"], entry["bytes"], entry["sha256"])
    pages = lmdb_file_problem(path)  # a manifest whose size and sha256 were recorded again: never mapped past its end
    if pages is not None:
        raise VerificationError(f"{path}: {pages}: run `repack verify`; nothing removed")
    env = _open(path)
    try:
        with env.begin(buffers=False) as txn:
            meta = json.loads(txn.get(META_KEY) or b"null")
            count = meta.get("count") if isinstance(meta, dict) else None
            if count != entry["samples"]:
                raise VerificationError(f"{path}: the database's metadata counts {count!r} samples, the manifest "
                                        f"{entry['samples']}: run `repack verify`; nothing removed")
            kept, found, removed_classes, removed_formats, removed_misreads = [], set(), {}, {}, {}
            misreads = bool((current.get("stats") or {}).get("dali_misreads"))
            for index in range(meta["count"]):
                raw = txn.get(sample_key(index, "json"))
                sample = json.loads(raw) if raw is not None else {}
                source = sample.get("path")
                if source not in wanted:
                    kept.append(index)
                    continue
                found.add(source)
                if isinstance(sample.get("format"), str):  # the samples' image formats (stats.formats)
                    removed_formats[sample["format"]] = removed_formats.get(sample["format"], 0) + 1
                    kind = dali_misread_of(txn.get(sample_key(index, "img")) or b"") \
                        if misreads and sample["format"] == "tiff" else None
                    if kind is not None:  # stats.dali_misreads goes down with it
                        removed_misreads[kind] = removed_misreads.get(kind, 0) + 1
                cls = txn.get(sample_key(index, "cls"))
                name = names_by_index.get(int(cls)) if cls is not None else ""
                removed_classes[name] = removed_classes.get(name, 0) + 1
    finally:
        env.close()
    if not found:
        return Rewrite(current["shards"], frozenset(), {}, {}, {})
    name = re.sub(r"(-v\d+)?\.lmdb$", f"-v{number}.lmdb", entry["path"])
    refuse_names_in_use(store, current, [name], "remove")  # a database renamed by hand: its own name, or another's
    target = Manifest(out, current).path(name)
    tmp = target.parent / f".{target.name}.tmp-remove"
    map_size = max(INITIAL_MAP, 1 << (2 * path.stat().st_size).bit_length())
    while True:
        tmp.unlink(missing_ok=True)
        env = _open(path)
        try:
            LmdbCollector._write_sorted(tmp, map_size, _kept_items(env, meta, kept))
            break
        except lmdb.MapFullError:
            map_size *= 2
        finally:
            env.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    shard = {**entry, "path": name, "samples": len(kept), "bytes": target.stat().st_size,
             "sha256": sha256_file(target)}
    return Rewrite([shard], frozenset(found), {entry["path"]: name}, removed_classes, {"totals": {"bytes": shard["bytes"]}},
                   removed_formats=removed_formats, removed_misreads=removed_misreads)


def _kept_items(env, meta: dict, kept: list[int]):
    """(key, value) of the new database in key order: ``__meta__``, then each kept sample renumbered."""
    yield META_KEY, _json({**meta, "count": len(kept)})
    with env.begin(buffers=False) as txn:
        cursor = txn.cursor()
        for new, old in enumerate(kept):
            prefix = b"s/%010d/" % old
            if not cursor.set_range(prefix):
                continue
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                yield sample_key(new, key[len(prefix):].decode("ascii")), value
