"""Labels that are class indices: the rule, and its bound.

A source's labels (a list's column, a tar shard's ``.cls`` member, a parquet column) that are all written as
class indices ("0", "17", "017") keep those values as the dataset's class indices, as a converted dataset's
should; otherwise labels are names, indexed in sorted order. An index over ``MAX_CLASS_INDEX`` cannot be a
class (the readers' int32 labels): its input is quarantined. The ``*_table`` helpers apply the rules to columns
(an ``InputTable`` or a ``MemberTable``: label ids into label names)."""

from __future__ import annotations

import dataclasses

import numpy as np

from repack.sources.base import quarantine_record
from repack.sources.columns import NO_LABEL

MAX_CLASS_INDEX = 999_999_999  # an integer label kept as the class index: 9 digits (DALI's int32 label sum)


def is_index_label(label: str) -> bool:
    """A label written as a class index: ASCII digits ("0", "17", and zero-padded "017", as repack's own
    ``.cls`` members are; not "+1", "1.0")."""
    return label.isascii() and label.isdigit()


def index_labels(labels: set[str]) -> bool:
    """Whether ``labels`` are the source's class indices: every one an index label, no two of one value
    ("01" beside "1" makes every label a name)."""
    return bool(labels) and all(is_index_label(label) for label in labels) and \
        len({label.lstrip("0") for label in labels}) == len(labels)


def numeric_class_index(labels: set[str]) -> tuple[tuple[str, int], ...]:
    """The source's own indices when ``labels`` are class indices (``index_labels``), else () (sorted
    names). Indices over MAX_CLASS_INDEX are the caller's to quarantine first (``index_refusal``), and no class:
    a set-aside input's label (a row listed twice, a file gone) over the bound made the class map hold a class
    1,000,000,000 (and the ``cls`` members 10 digits wide) though no sample had it."""
    if index_labels(labels):
        return tuple(sorted(((label, int(label)) for label in labels if index_refusal(label) is None),
                            key=lambda kv: kv[1]))
    return ()


def index_refusal(label: str) -> str | None:
    """Why an index label cannot be a class index (over MAX_CLASS_INDEX), else None."""
    digits = label.lstrip("0") or "0"
    if len(digits) > len(str(MAX_CLASS_INDEX)) or int(digits) > MAX_CLASS_INDEX:
        shown = label if len(label) <= 40 else f"{label[:20]}...({len(label)} digits)"
        return f"label {shown} is over the largest class index {MAX_CLASS_INDEX} (the readers' int32 labels)"
    return None


def sorted_labels(table):
    """``table`` with the label names its rows carry, in sorted order (as a planner of items indexes them: a
    label only a set-aside row had is no class of the plan's)."""
    names = tuple(sorted(table.label_set()))
    if names == table.label_names:
        return table
    index = {label: at for at, label in enumerate(names)}
    remap = np.array([index.get(label, NO_LABEL) for label in table.label_names] + [NO_LABEL], dtype=np.int32)
    return dataclasses.replace(table, label_ids=remap[table.label_ids], label_names=names)


def bound_table_labels(table, indices: bool | None = None) -> tuple[object, list[dict]]:
    """``table`` (an ``InputTable`` or a ``MemberTable``) with the rows whose label is an index over the bound taken
    out, when its rows' labels are class indices, and their quarantine records, in row order (a label name only a row set aside earlier had is not looked at: "cat"
    of a missing file beside kept rows of "0" and "1"). ``indices``: whether the labels are indices, where the
    caller decided it from more labels than the rows' (a list: the set-aside rows' too); else from the rows'."""
    used = table.label_set()
    if not (index_labels(used) if indices is None else indices and used):
        return table, []
    refused = np.array([label in used and index_refusal(label) is not None for label in table.label_names] + [False])
    rows = np.flatnonzero(refused[table.label_ids])
    if not len(rows):
        return table, []
    over = [quarantine_record(table.rel(row), index_refusal(table.label(row)), table.label(row))
            for row in rows.tolist()]
    return table.take(np.flatnonzero(~refused[table.label_ids])), over
