"""Shard bytes over payload bytes for `repack inspect`: what the tar format costs per sample.

The payload is the sum of the sample members' data sizes, read from the DALI ``.idx`` files of a
local webdataset (``repack.manifest.shard_index``). Every tar member also
costs a 512-byte header and padding of its data to 512 bytes, so tiny samples of several members
weigh several times their data."""

from __future__ import annotations

from pathlib import Path

from repack.manifest import safe_join
from repack.manifest.io import open_regular
from repack.manifest.shard_index import parse_index

HINT_RATIO = 2.0  # over this, the per-member cost dominates the shards


def payload_of_index(raw: bytes, where: str) -> tuple[int, int, int]:
    """(samples, members, data bytes) of a DALI index's bytes (through the one ``.idx`` parser)."""
    columns = parse_index(raw, where)
    return len(columns.first_member) - 1, len(columns.size), int(columns.size.sum())


def overhead_lines(root: Path, data: dict) -> list[str]:
    """The ratio line (and a hint when the ratio is over ``HINT_RATIO``) of a local webdataset's manifest
    ``data`` rooted at ``root``; [] when no shard has samples."""
    samples = members = payload = shard_bytes = 0
    for shard in data["shards"]:
        with open_regular(safe_join(root, shard["index"])) as fh:  # a FIFO in its place: refused, not waited on
            n, m, size = payload_of_index(fh.read(), shard["index"])
        samples, members, payload = samples + n, members + m, payload + size
        shard_bytes += shard["bytes"]
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
