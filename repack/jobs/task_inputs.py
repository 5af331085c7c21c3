"""A task's inputs as columns: the compact, JSON-able form of ``payload["inputs"]``.

A task of N inputs carries one column per field instead of N dicts (what a worker receives, and what
plan.json.gz stores); the per-input columns are bytes, zlib'd and base64'd into one JSON string each
(``pack_column``), so neither the planner nor JSON handles a Python object per input::

  {"first": P,              sample position of the first input (keys: P, P+1, ...)
   "count": N,
   "relz":  "<packed>",     the paths under the source root, utf-8 (surrogateescape), each followed by a NUL
   "fpz":   "<packed>",     the fingerprints checked before reading: little-endian int64 columns of size,
                            then mtime_ns, then inode, each as its first value then differences
                            (``delta_columns``; a folder scan's)
   "fp":    [[fingerprint], ...]   or one list per input (other sources: their own length)
   "shards": [[path, fingerprint, rel], ...]   or, for tar members or parquet rows (a ``MemberTable``), the files
                            they lie in (parquet: [path, fingerprint, rel, image column]),
   "memz":  "<packed>",     and int64 columns of the index into "shards", the member's data offset (parquet: the
                            row) and size (``delta_columns``): path and fingerprint are the file's, "member" and
                            "meta" from them
   "keyz":  "<packed>",     the inputs' sample keys (``meta``'s source_key), each followed by a NUL
   "spathz": "<packed>",    parquet: each row's Image path (``meta``'s source_path; "" for none): the lengths
                            (little-endian int64), then the paths one after the other (a path may hold a NUL)
   "clsz":  "<packed>",     class index per input, little-endian int32, -1 for none (absent when unlabeled)
   "names": {index: name},  the class names of those indices
   "root":  "/src/",        path = root + rel, except the inputs in "path"
   "path":  {i: path},      inputs opened elsewhere (list files, s3, a symlinked folder)
   "extra": {i: {...}}}     inputs stored inside another file: member/meta fields

An older plan's columns ("rel": [rel, ...], "fp3": flat ints, "cls": [index or null, ...]) read the same.
``task_inputs`` turns either shape (columns, or a list of entry dicts as other jobs hold) into the entry
dicts the readers use: rel, label, fingerprint, key, cls, path, hash, member, meta.
"""

from __future__ import annotations

import base64
import re
import zlib

import numpy as np

from repack.sources.columns import join_names, split_names

_NOT_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def sample_key(position: int, rel: str) -> str:
    """Unique, short, ASCII, dot-free key: ``00000042_cat_001``."""
    stem = rel[rel.rfind("/") + 1:]
    if not stem.startswith("."):
        stem = stem.partition(".")[0]
    if not stem.isascii():
        stem = stem.encode("ascii", "ignore").decode()
    slug = _NOT_SLUG.sub("_", stem)[:40].strip("_")
    return f"{position:08d}_{slug}" if slug else f"{position:08d}"


def input_count(payload: dict) -> int:
    """How many inputs a task payload holds (either shape)."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return len(inputs)
    return inputs["count"] if "count" in inputs else len(inputs["rel"])


def pack_column(raw: bytes) -> str:
    """A column's bytes as a JSON-able string: zlib (level 1), then base64."""
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def unpack_column(packed: str) -> bytes:
    return zlib.decompress(base64.b64decode(packed))


def delta_columns(columns: list[np.ndarray]) -> bytes:
    """Equal-length int64 columns as the "fpz" bytes: little-endian, one after the other, each its first value
    then the differences (fingerprints of files made together differ little: the zlib'd column is small)."""
    stacked = np.array(columns, dtype="<i8")
    stacked[:, 1:] = np.diff(stacked, axis=1)
    return stacked.tobytes()


def undelta_columns(raw: bytes, count: int) -> np.ndarray:
    """The (count, K) int64 rows of ``delta_columns``' K columns."""
    if not count:
        return np.zeros((0, 0), dtype=np.int64)
    return np.cumsum(np.frombuffer(raw, dtype="<i8").reshape(-1, count), axis=1).T


def input_rels(payload: dict) -> list[str]:
    """The rels of a task payload's inputs, in order (either shape)."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return [entry["rel"] for entry in inputs]
    if "relz" in inputs:
        return split_names(unpack_column(inputs["relz"]))
    return list(inputs["rel"])


def input_names_blob(payload: dict) -> bytes:
    """The rels of a task payload's inputs as one names blob (each followed by a NUL), in order: a column
    payload's ``relz`` as it is stored, without a str per input."""
    inputs = payload.get("inputs", ())
    if isinstance(inputs, dict) and "relz" in inputs:
        return unpack_column(inputs["relz"])
    return join_names(input_rels(payload))


def fingerprint_rows(payload: dict) -> np.ndarray | None:
    """The (N, K) int64 fingerprint rows (size, mtime_ns, inode) of a column-shaped payload whose
    fingerprints are columns ("fpz", or an older plan's "fp3"); None for any other shape."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return None
    if "fpz" in inputs:
        count = input_count(payload)
        return undelta_columns(unpack_column(inputs["fpz"]), count) if count else np.zeros((0, 3), np.int64)
    if "fp3" in inputs:
        return np.asarray(inputs["fp3"], np.int64).reshape(-1, 3)
    return None


def _spans(raw: bytes, count: int) -> list[str]:
    """``count`` values packed as their lengths (little-endian int64) then their bytes one after the other."""
    lengths = np.frombuffer(raw[:8 * count], "<i8")
    ends = np.cumsum(lengths).tolist()
    blob = raw[8 * count:]
    if len(lengths) != count or (ends and ends[-1] != len(blob)):
        raise ValueError("a task's input columns differ in length")
    return [blob[a:b].decode("utf-8", "surrogateescape") for a, b in zip([0] + ends[:-1], ends)]


def task_inputs(payload: dict) -> list[dict]:
    """The entry dicts of a task's inputs (see the module docstring); [] when it has none."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return list(inputs)
    rels, first = input_rels(payload), inputs["first"]
    members = None
    if "memz" in inputs:  # tar members: the fingerprint is their shard's
        members = undelta_columns(unpack_column(inputs["memz"]), len(rels)).tolist() if rels else []
        shards, keys = inputs["shards"], split_names(unpack_column(inputs["keyz"]))
        source_paths = _spans(unpack_column(inputs["spathz"]), len(rels)) if "spathz" in inputs else None
        fps = [shards[shard][1] for shard, _, _ in members]
        if len(keys) != len(rels) or (source_paths is not None and len(source_paths) != len(rels)):
            raise ValueError("a task's input columns differ in length")
    elif "fpz" in inputs:
        fps = undelta_columns(unpack_column(inputs["fpz"]), len(rels)).tolist()
    elif "fp3" in inputs:
        flat = inputs["fp3"]
        fps = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    else:
        fps = inputs["fp"]
    classes = [None if c < 0 else c for c in np.frombuffer(unpack_column(inputs["clsz"]), "<i4").tolist()] \
        if "clsz" in inputs else inputs.get("cls")
    names = inputs.get("names", {})
    root = inputs.get("root")
    paths, extra = inputs.get("path", {}), inputs.get("extra", {})
    if len(rels) != len(fps) or (classes is not None and len(classes) != len(rels)):
        raise ValueError("a task's input columns differ in length")
    entries = []
    for i, rel in enumerate(rels):
        cls = classes[i] if classes is not None else None
        entry = {"rel": rel, "label": names[str(cls)] if cls is not None else None, "fingerprint": fps[i],
                 "key": sample_key(first + i, rel), "cls": cls}
        path = paths.get(str(i)) if paths else None
        if path is not None:
            entry["path"] = path
        elif root is not None:
            entry["path"] = root + rel
        if members is not None:
            shard, offset, size = members[i]
            entry["path"] = shards[shard][0]
            entry["meta"] = {"source_file": shards[shard][2], "source_key": keys[i]}
            if source_paths is None:
                entry["member"] = {"offset": offset, "size": size}
            else:  # a parquet row: its number, its file's image column
                entry["member"] = {"row": offset, "column": shards[shard][3]}
                if source_paths[i]:
                    entry["meta"]["source_path"] = source_paths[i]
        if extra and str(i) in extra:
            entry.update(extra[str(i)])
        entries.append(entry)
    return entries
