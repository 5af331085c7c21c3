"""A task's inputs as columns: the compact, JSON-able form of ``payload["inputs"]``.

A task of N inputs carries one column per field instead of N dicts (what a worker receives, and what
plan.json.gz stores); the per-input columns are base64 strings of bytes, so neither the planner nor
JSON handles a Python object per input::

  {"first": P,              sample position of the first input (keys: P, P+1, ...)
   "count": N,
   "rels":  "<base64>",     the paths under the source root, utf-8 (surrogateescape), each followed by a NUL
   "fp24":  "<base64>",     the fingerprints checked before reading, little-endian int64 size, mtime_ns,
                            inode per input (a folder scan's)
   "fp":    [[fingerprint], ...]   or one list per input (other sources: their own length)
   "cls4":  "<base64>",     class index per input, little-endian int32, -1 for none (absent when unlabeled)
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

import numpy as np

from repack.sources.columns import split_names

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


def input_rels(payload: dict) -> list[str]:
    """The rels of a task payload's inputs, in order (either shape)."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return [entry["rel"] for entry in inputs]
    if "rels" in inputs:
        return split_names(base64.b64decode(inputs["rels"]))
    return list(inputs["rel"])


def _ints(packed: str, dtype: str) -> list[int]:
    return np.frombuffer(base64.b64decode(packed), dtype=dtype).tolist()


def task_inputs(payload: dict) -> list[dict]:
    """The entry dicts of a task's inputs (see the module docstring); [] when it has none."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return list(inputs)
    rels, first = input_rels(payload), inputs["first"]
    if "fp24" in inputs:
        flat = _ints(inputs["fp24"], "<i8")
        fps = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    elif "fp3" in inputs:
        flat = inputs["fp3"]
        fps = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    else:
        fps = inputs["fp"]
    classes = [None if c < 0 else c for c in _ints(inputs["cls4"], "<i4")] if "cls4" in inputs else inputs.get("cls")
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
        if extra and str(i) in extra:
            entry.update(extra[str(i)])
        entries.append(entry)
    return entries
