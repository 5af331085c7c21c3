"""A task's inputs as columns: the compact, JSON-able form of ``payload["inputs"]``.

A task of N inputs carries one list per field instead of N dicts (what a Ray worker receives, and
what plan.json stores)::

  {"first": P,              sample position of the first input (keys: P, P+1, ...)
   "rel":   [rel, ...],     path under the source root
   "fp3":   [size, mtime_ns, inode, size, ...]   the fingerprint checked before reading (a folder scan's)
   "fp":    [[fingerprint], ...]               or one list per input (other sources: their own length)
   "cls":   [index, ...],   class index per input (absent when unlabeled)
   "names": {index: name},  the class names of those indices
   "root":  "/src/",        path = root + rel, except the inputs in "path"
   "path":  {i: path},      inputs opened elsewhere (list files, s3, a symlinked folder)
   "extra": {i: {...}}}     inputs stored inside another file: member/meta fields

``task_inputs`` turns either shape (columns, or a list of entry dicts as other jobs and older plans
hold) into the entry dicts the readers use: rel, label, fingerprint, key, cls, path, hash, member, meta.
"""

from __future__ import annotations

import re

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
    return len(inputs["rel"]) if isinstance(inputs, dict) else len(inputs)


def task_inputs(payload: dict) -> list[dict]:
    """The entry dicts of a task's inputs (see the module docstring); [] when it has none."""
    inputs = payload.get("inputs", ())
    if not isinstance(inputs, dict):
        return list(inputs)
    rels, first = inputs["rel"], inputs["first"]
    flat = inputs.get("fp3")
    fps = inputs["fp"] if flat is None else [flat[i:i + 3] for i in range(0, len(flat), 3)]
    classes = inputs.get("cls")
    names = inputs.get("names", {})
    root = inputs.get("root")
    paths, extra = inputs.get("path", {}), inputs.get("extra", {})
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
