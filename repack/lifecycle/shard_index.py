"""A tar shard's DALI index (``repack.sinks.tar_format``) as arrays: one row per member, samples as
ranges of rows. Parsed with a few C-speed calls (no Python object per member), for `repack remove`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from repack.sinks.tar_format import BLOCK, INDEX_VERSION


@dataclass(frozen=True)
class ShardIndex:
    """``tokens``: the index's tokens (4 per member: ext, data offset, size, name); ``offset``/``size``:
    int64 per member; ``first``: the first member row of each sample, then the member count."""

    tokens: list[str]
    offset: np.ndarray
    size: np.ndarray
    first: np.ndarray

    @property
    def samples(self) -> int:
        return len(self.first) - 1

    def key(self, sample: int) -> str:
        return self.tokens[4 * int(self.first[sample]) + 3].partition(".")[0]

    def keys(self) -> list[str]:
        names = self.tokens[3::4]
        return [names[row].partition(".")[0] for row in self.first[:-1].tolist()]

    def members(self, sample: int) -> list[tuple[str, int, int, str]]:
        """(ext, data offset, size, name) of the sample's members."""
        rows = range(int(self.first[sample]), int(self.first[sample + 1]))
        return [(self.tokens[4 * r], int(self.offset[r]), int(self.size[r]), self.tokens[4 * r + 3]) for r in rows]

    def padded_end(self) -> np.ndarray:
        """Per member: the end of its data's padding."""
        return self.offset + self.size + (-self.size % BLOCK)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start of the first header, end of the last member's padding) per sample."""
        return self.offset[self.first[:-1]] - BLOCK, self.padded_end()[self.first[1:] - 1]

    def adjacent(self) -> bool:
        """Whether each member's header follows the previous member of its sample."""
        inner = np.ones(len(self.offset), bool)
        inner[self.first[:-1]] = False  # a sample's first member follows nothing of its own
        ends = self.padded_end()
        return bool(np.all(self.offset[1:][inner[1:]] == ends[:-1][inner[1:]] + BLOCK))


def parse_index(raw: bytes, recorded_sha256: str | None = None) -> ShardIndex | None:
    """The index in ``raw``; None when it is not the one the manifest records (``recorded_sha256``) or
    not a well-formed index."""
    if recorded_sha256 and hashlib.sha256(raw).hexdigest() != recorded_sha256:
        return None
    try:
        text = raw.decode("ascii")
        head, _, body = text.partition("\n")
        version, count = head.split(" ")
        lines = body.split("\n")
        if version != INDEX_VERSION or lines[-1] or int(count) != len(lines) - 1:
            return None
        lines.pop()
        words = np.fromiter((line.count(" ") + 1 for line in lines), np.int64, len(lines))
        if len(words) and (words.min() < 4 or np.any(words % 4)):
            return None
        tokens = " ".join(lines).split(" ") if lines else []
        offset = np.array(tokens[1::4], dtype=np.int64) if tokens else np.zeros(0, np.int64)
        size = np.array(tokens[2::4], dtype=np.int64) if tokens else np.zeros(0, np.int64)
        if len(offset) and (offset.min() < BLOCK or size.min() < 0):
            return None
        first = np.concatenate([[0], np.cumsum(words // 4)]).astype(np.int64)
        return ShardIndex(tokens, offset, size, first)
    except (UnicodeDecodeError, ValueError, OverflowError):
        return None
