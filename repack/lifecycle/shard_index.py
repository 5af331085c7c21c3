"""A tar shard's DALI index (``repack.sinks.tar_format``) as ``repack remove`` uses it: one row per
member, samples as ranges of rows. Parsed by the project's one ``.idx`` parser
(``repack.manifest.shard_index``); this module adds the byte-layout questions remove asks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from repack.manifest import ManifestError
from repack.manifest.shard_index import IndexColumns
from repack.manifest.shard_index import parse_index as parse_columns
from repack.sinks.tar_format import BLOCK, INDEX_VERSION


@dataclass(frozen=True)
class ShardIndex:
    """``columns``: the parsed index; ``offset``/``size``: int64 per member; ``first``: the first member
    row of each sample, then the member count."""

    columns: IndexColumns
    offset: np.ndarray
    size: np.ndarray
    first: np.ndarray

    @property
    def samples(self) -> int:
        return len(self.first) - 1

    def key(self, sample: int) -> str:
        return self.columns.key(sample)

    def keys(self) -> list[str]:
        return [self.columns.key(sample) for sample in range(self.samples)]

    def members(self, sample: int) -> list[tuple[str, int, int, str]]:
        """(ext, data offset, size, name) of the sample's members."""
        rows = np.arange(int(self.first[sample]), int(self.first[sample + 1]))
        return list(zip(self.exts(rows), self.offset[rows].tolist(), self.size[rows].tolist(), self.names(rows)))

    def exts(self, rows: np.ndarray) -> list[str]:
        """The ext of each member row in ``rows``."""
        table = self.columns.exts
        return [table[code] for code in self.columns.ext[rows].tolist()]

    def names(self, rows: np.ndarray) -> list[str]:
        """The name of each member row in ``rows``."""
        samples = np.searchsorted(self.first, rows, side="right") - 1
        table = self.columns.suffixes
        out = []
        for sample, code in zip(samples.tolist(), self.columns.suffix[rows].tolist()):
            keyed, tail = table[code]
            out.append((self.columns.key(sample) if keyed else "") + tail.decode("ascii"))
        return out

    def name_fields(self, rows: np.ndarray, width: int) -> np.ndarray:
        """(rows, width) uint8: each member row's name NUL-padded (cut) to ``width`` bytes."""
        samples = np.searchsorted(self.first, rows, side="right") - 1
        return self.columns.name_fields(samples, rows, width)

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
    not a well-formed index (its last line unterminated, or a data offset inside the first header)."""
    if recorded_sha256 and hashlib.sha256(raw).hexdigest() != recorded_sha256:
        return None
    head = raw.partition(b"\n")[0].split(b" ")
    if not raw.endswith(b"\n") or len(head) != 2 or head[0] != INDEX_VERSION.encode():
        return None
    try:
        columns = parse_columns(raw, "index")
    except ManifestError:
        return None
    offset, size = columns.offset.astype(np.int64), columns.size.astype(np.int64)
    if len(offset) and offset.min() < BLOCK:
        return None
    return ShardIndex(columns, offset, size, columns.first_member.astype(np.int64))
