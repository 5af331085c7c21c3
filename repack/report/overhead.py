"""Shard bytes over payload bytes for `repack inspect`: what the tar format costs per sample.

The payload is the sum of the sample members' data sizes, read from the DALI ``.idx`` files of a
local webdataset (``repack.manifest.shard_index``). Every tar member also
costs a 512-byte header and padding of its data to 512 bytes, so tiny samples of several members
weigh several times their data."""

from __future__ import annotations

import os
from pathlib import Path

from repack.manifest.io import open_regular
from repack.manifest.paths import join_under_real
from repack.manifest.shard_index import CHUNK_BYTES, parse_index_set

HINT_RATIO = 2.0  # over this, the per-member cost dominates the shards
FILES_AT_ONCE = 256  # index files read, then parsed, at a time (small ones together: shard_index.index_jobs)


def overhead_lines(root: Path, data: dict) -> list[str]:
    """The ratio line (and a hint when the ratio is over ``HINT_RATIO``) of a local webdataset's manifest
    ``data`` rooted at ``root``; [] when no shard has samples."""
    shards = data["shards"]
    root_real = Path(os.path.realpath(root))

    def read(i: int) -> bytes:
        with open_regular(join_under_real(root_real, shards[i]["index"])) as fh:  # a FIFO in its place: refused
            return fh.read()

    columns = parse_index_set(read, [s["index"] for s in shards], [s["samples"] for s in shards], CHUNK_BYTES,
                              FILES_AT_ONCE)  # each index's lines counted and laid out as its tar
    samples, members, payload = columns.samples, len(columns.size), int(columns.size.sum())
    shard_bytes = sum(shard["bytes"] for shard in shards)
    if not samples or not payload:
        return []
    ratio = shard_bytes / payload
    per_sample = members / samples
    lines = [f"shard bytes / payload bytes: {ratio:.1f}x (tar headers and padding: {per_sample:.3g} member(s) "
             f"of >= 1 KB per sample)"]
    if ratio > HINT_RATIO and "json" in data.get("fields", {}) and data.get("modality") == "images":
        lines.append("hint: the samples are tiny next to their tar members; `repack images --no-sample-json` "
                     "drops the per-sample .json member (1 KB or more per sample), see docs/images.md "
                     "'Tiny samples'.")
    elif ratio > HINT_RATIO:
        lines.append("hint: the samples are tiny next to their tar members (1 KB or more each); fewer members "
                     "per sample cut the overhead, see docs/images.md 'Tiny samples'.")
    return lines
