"""Which webdataset shards can hold the samples `repack remove` names, found without reading shards.

A sample's key starts with its position (``%08d_<stem>``, unique in the dataset, ascending within each
shard: the plan cuts shards from consecutive positions, an append's shards start at the next free one,
a remove keeps the order). Named by key, the position is in the name; named by source, the record of
the inputs (``repack.lifecycle.input_columns``) gives it. Each shard's first and last index lines give
the span of positions it holds; only the shards whose span holds a wanted position are read. Where a
position cannot be had (an older record without positions, a key without a numeric prefix), None:
the caller reads every shard.
"""

from __future__ import annotations

import numpy as np

from repack.distinct import distinct
from repack.errors import UsageError
from repack.lifecycle.input_columns import encode_names
from repack.lifecycle.record_layers import RecordLayers
from repack.manifest import ManifestError
from repack.manifest.shard_index import parse_index
from repack.sinks.tar_format import INDEX_VERSION

EDGE_BYTES = 1 << 16  # read from each end of an index for its first and last sample line


def key_position(key: str) -> int | None:
    """The position a sample key starts with (None when it has no numeric prefix): its digits before the
    first ``_``, or the whole key where it is only digits (a source name without an ASCII letter or digit
    has no slug: ``repack.jobs.task_inputs.sample_key``)."""
    head, _, _ = key.partition("_")
    return int(head) if head.isdigit() and head.isascii() else None


def wanted_positions(by: str, names, known: RecordLayers | None) -> np.ndarray | None:
    """The sorted positions of the named samples (``by``: "keys" or "sources"); names the record does not
    hold have no sample and are left out. None when some position cannot be had."""
    if by == "keys":
        positions = [key_position(name) for name in names]
        if any(p is None for p in positions):
            return None
        return distinct(np.array(positions, np.int64))
    if known is None:
        return None
    try:
        positions, recorded = known.positions_of(distinct(encode_names(sorted(set(names)))))
    except UsageError:  # a layer whose names cannot be decoded (an empty planned name): every shard is read
        return None
    positions = positions[recorded]
    if (positions < 0).any():
        return None
    return distinct(positions)


def position_span(store, entry: dict) -> tuple[int, int] | None:
    """(first, last) sample position of a shard, from its index's first and last lines (a local
    dataset: only both ends of the file are read); None when they do not say."""
    index = entry.get("index")
    if not index:
        return None
    if store.remote:
        raw = store.read_bytes(index)
        if raw is None:
            return None
        head, tail = raw[:EDGE_BYTES], raw[-EDGE_BYTES:]
    else:
        try:
            with open(store.path(index), "rb") as fh:
                head = fh.read(EDGE_BYTES)
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - EDGE_BYTES))
                tail = fh.read(EDGE_BYTES)
        except OSError:
            return None
    lines = head.split(b"\n")
    last_lines = tail.rstrip(b"\n").split(b"\n")
    if len(lines) < 3 or len(last_lines) < 2:
        return None
    first, last = (_line_position(lines[1]), _line_position(last_lines[-1]))
    if first is None or last is None or last < first:
        return None
    return first, last


def _line_position(line: bytes) -> int | None:
    """The position of the sample on one index line (None when the line is not a well-formed one)."""
    try:
        return key_position(parse_index(f"{INDEX_VERSION} 1\n".encode() + line + b"\n", "index line",
                                        layout=False).key(0))
    except ManifestError:
        return None


def shard_spans(store, shards: list[dict]) -> list[tuple[int, int] | None]:
    """``position_span`` of each of ``shards`` (None: a shard whose span cannot be read, to be read whole)."""
    return [position_span(store, entry) for entry in shards]
