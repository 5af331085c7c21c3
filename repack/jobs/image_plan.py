"""The image plan's per-input arithmetic, on columns: byte bounds, slot sizes, cuts, task payloads.

Everything here works on whole columns (numpy arrays, lists of strings) of the inputs in plan
order, so planning a million inputs costs a few vectorized passes rather than a Python object, a
dict and several function calls per input. The results equal the per-input rules they replace
(``sample_bytes_bound``, ``sample_bytes_expected``, ``cut_by_budget`` in ``repack.jobs.images``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from repack.sinks.tar_format import BLOCK, RECORD

ARCHIVE_TAIL_MAX = 2 * BLOCK + RECORD  # end-of-archive blocks + padding to the record size
_JSON_STR = json.encoder.encode_basestring_ascii
_META_FIXED = len('{"bytes": , "class": , "format": "jpg", "height": 1000, "path": , "width": 1000}')


@dataclass(frozen=True)
class InputColumns:
    """The inputs in plan order as the planner needs them."""

    rels: list[str]
    labels: list[str | None]
    sizes: np.ndarray                 # int64
    fingerprints: "Fingerprints"
    paths: dict[int, str]             # row -> path, where not root + rel
    extra: dict[int, dict]            # row -> member/meta fields (inputs stored inside another file)
    root: str | None                  # path = root + rel unless in paths

    @classmethod
    def of(cls, items: Sequence, root: str | None) -> "InputColumns":
        """Columns of ``items``: an ``InputTable`` (read column-wise) or any sequence of ``InputItem``."""
        if hasattr(items, "label_ids"):  # repack.sources.columns.InputTable
            names = list(items.label_names) + [None]  # label id -1 -> None
            labels = [names[i] for i in items.label_ids.tolist()]
            fps = np.stack([items.sizes, items.mtimes, items.inodes], axis=1) if len(items) else \
                np.zeros((0, 3), dtype=np.int64)
            return cls(items.rels, labels, items.sizes, Fingerprints(fps, None), dict(items.real_paths), {},
                       items.root + "/")
        items = list(items)
        paths = {row: item.path for row, item in enumerate(items) if root is None or item.path != root + item.rel}
        extra = {row: fields for row, item in enumerate(items) if (fields := item.entry_fields())}
        return cls([item.rel for item in items], [item.label for item in items],
                   np.array([item.size for item in items], dtype=np.int64),
                   Fingerprints(None, [item.fingerprint for item in items]), paths, extra, root)


@dataclass(frozen=True)
class Fingerprints:
    """Fingerprints as an (N, 3) array (a folder scan) or as lists (other sources: their own length)."""

    array: np.ndarray | None
    lists: list[list[int]] | None

    def payload(self, start: int, end: int) -> dict:
        """Rows [start, end) as a task payload's column: "fp3" (flat: size, mtime_ns, inode per input: no
        list object per input) or "fp" (a list per input)."""
        if self.array is not None:
            return {"fp3": self.array[start:end].ravel().tolist()}
        return {"fp": self.lists[start:end]}


def _blocks(sizes: np.ndarray) -> np.ndarray:
    return -(-sizes // BLOCK) * BLOCK


def _utf8_lengths(texts: list[str]) -> np.ndarray:
    return np.fromiter((len(t) if t.isascii() else len(t.encode("utf-8", "surrogateescape")) for t in texts),
                       dtype=np.int64, count=len(texts))


def _digits(values: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative value."""
    digits = np.ones(len(values), dtype=np.int64)
    for power in range(1, 19):
        digits += values >= 10 ** power
    return digits


def sample_bounds(cols: InputColumns, with_json: bool = True) -> np.ndarray:
    """Upper bound of each sample's bytes in a tar (any label, any metadata escaping): the image, a cls
    and (``with_json``) a json member of at most 256 + 6 x (rel and label bytes), headers and padding."""
    image_and_cls = BLOCK + _blocks(cols.sizes) + 2 * BLOCK
    if not with_json:
        return image_and_cls
    label_bytes = _label_lengths(cols.labels, lambda name: len(name))
    meta = 256 + 6 * _utf8_lengths(cols.rels) + 6 * label_bytes
    return image_and_cls + BLOCK + _blocks(meta)


def sample_expected(cols: InputColumns, with_json: bool = True) -> np.ndarray:
    """Each sample's bytes in a tar when its image is stored as read and (``with_json``) its metadata holds a
    4-digit width and height (``repack.jobs.images.sample_json``'s length; a chunk's slot is the sum)."""
    labeled = np.fromiter((label is not None for label in cols.labels), dtype=bool, count=len(cols.labels))
    image_and_cls = BLOCK + _blocks(cols.sizes) + np.where(labeled, 2 * BLOCK, 0)
    if not with_json:
        return image_and_cls
    rel_json = np.fromiter((len(_JSON_STR(rel)) for rel in cols.rels), dtype=np.int64, count=len(cols.rels))
    class_json = _label_lengths(cols.labels, lambda name: len(_JSON_STR(name)), none=len("null"))
    meta = _META_FIXED + _digits(cols.sizes) + class_json + rel_json
    return image_and_cls + BLOCK + _blocks(meta)


def _label_lengths(labels: list[str | None], length, none: int = 0) -> np.ndarray:
    """length(label) per input, computed once per distinct label."""
    known: dict[str | None, int] = {None: none}
    for label in set(labels):
        if label is not None:
            known[label] = length(label)
    return np.fromiter((known[label] for label in labels), dtype=np.int64, count=len(labels))


def cut_runs(bounds: np.ndarray, start: int, end: int, max_count: int | None,
             max_bytes: int | None) -> list[tuple[int, int]]:
    """Cut rows [start, end) into runs [s, e) of at most ``max_count`` rows and ``max_bytes`` bytes
    (the sum of ``bounds`` plus the end-of-archive once), greedily in order; a run holds at least one row."""
    cum = np.concatenate(([0], np.cumsum(bounds[start:end], dtype=np.int64)))
    runs: list[tuple[int, int]] = []
    s = 0
    n = end - start
    while s < n:
        e = n
        if max_count is not None:
            e = min(e, s + max_count)
        if max_bytes is not None:
            fit = int(np.searchsorted(cum, cum[s] + max_bytes - ARCHIVE_TAIL_MAX, side="right")) - 1
            e = min(e, max(fit, s + 1))
        runs.append((start + s, start + e))
        s = e
    return runs


def inputs_payload(cols: InputColumns, start: int, end: int, first: int, classes: dict[str, int]) -> dict:
    """The columnar ``payload["inputs"]`` of rows [start, end) (``repack.jobs.task_inputs``); ``first``: the
    sample position of row ``start``."""
    inputs: dict = {"first": first, "rel": cols.rels[start:end], **cols.fingerprints.payload(start, end)}
    labels = cols.labels[start:end]
    if any(label is not None for label in labels):
        inputs["cls"] = [classes[label] if label is not None else None for label in labels]
        inputs["names"] = {str(classes[label]): label for label in set(labels) if label is not None}
    if cols.root is not None:
        inputs["root"] = cols.root
    paths = {str(row - start): cols.paths[row] for row in range(start, end) if row in cols.paths} \
        if cols.paths else {}
    if paths:
        inputs["path"] = paths
    extra = {str(row - start): cols.extra[row] for row in range(start, end) if row in cols.extra} \
        if cols.extra else {}
    if extra:
        inputs["extra"] = extra
    return inputs
