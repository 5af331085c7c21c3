"""A batch of samples of local shards, read and checked with array operations: the raw-bytes batch
path of ``ImageShardDataset`` (``batch_size=``, no decode, no transform, local files).

The samples' index columns (``repack.manifest.shard_index``) give each sample's span in its tar (from its
first member's header to its last member's padding); runs of adjacent spans are one ``pread`` each,
straight into the batch's buffer, and every member's tar header is checked against the index for all
members at once (``tar_blocks.headers_match``), ``.cls`` labels parsed as a column. Any irregularity
(a short read, a header that is not the index's, a missing or repeated member, a label that is not
digits, a checksum mismatch) returns None: the caller reads that batch sample by sample, which names
the shard, key and reason. So the fast path never accepts what the exact one refuses.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from repack.manifest.shard_index import IndexColumns
from pipelines.tar_blocks import TAR_BLOCK, ShardFiles, headers_match

_NO_IMAGE = 1 << 30
_MAX_LABEL_DIGITS = 18


@dataclass(frozen=True)
class BatchRules:
    """What a sample must hold: ``image_rank`` (per ext code: its rank among the image extensions, the
    first present wins; ``_NO_IMAGE`` for other members), ``label`` (the ``.cls`` ext code, or None),
    ``labeled`` (every sample must have one), ``checksums`` (shard -> per-sample crc32s) when verifying."""

    image_rank: np.ndarray
    label: int | None
    labeled: bool
    checksums: Callable[[int], np.ndarray] | None = None

    @classmethod
    def of(cls, index: IndexColumns, image_order: list[str], labeled: bool,
           checksums: Callable[[int], np.ndarray] | None = None) -> "BatchRules":
        rank = np.array([image_order.index(e) if e in image_order else _NO_IMAGE for e in index.exts] or [_NO_IMAGE],
                        dtype=np.int64)
        label = index.exts.index("cls") if "cls" in index.exts else None
        return cls(rank, label, labeled, checksums)


@dataclass(frozen=True)
class RawBatch:
    """A batch read into ``buffer`` (its ``claim`` from a BufferRing, or None): the image member of
    sample ``i`` (in the order asked for) is ``buffer[starts[i]:ends[i]]``; ``labels`` (int64, -1: none)
    is a view of ``buffer`` too (its tail), so the whole batch is one buffer; ``nbytes``: shard bytes read."""

    buffer: torch.Tensor
    claim: tuple | None
    starts: np.ndarray
    ends: np.ndarray
    labels: torch.Tensor
    nbytes: int


def read_batch(index: IndexColumns, paths: list[str], files: ShardFiles, samples: np.ndarray,
               take: Callable[[int], tuple], rules: BatchRules) -> RawBatch | None:
    """Global samples ``samples`` (in delivery order) as one RawBatch, or None when any of them needs
    the exact, sample-by-sample path (the buffer taken, one ``take`` call, is then the caller's to reuse)."""
    order = np.argsort(samples, kind="stable")  # global numbers run in (shard, byte) order
    wanted = samples[order].astype(np.int64)
    members, counts = index.members_of(wanted)
    first = np.zeros(len(wanted), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    offset, size = index.offset[members].astype(np.int64), index.size[members].astype(np.int64)
    if np.any(offset % TAR_BLOCK):
        return None  # not where a tar puts member data
    lo = np.minimum.reduceat(offset, first) - TAR_BLOCK
    end = np.maximum.reduceat(offset + size, first)
    hi = end + (-end % TAR_BLOCK)
    shard = index.shard_of(wanted)
    new_run = np.ones(len(wanted), dtype=bool)
    new_run[1:] = (shard[1:] != shard[:-1]) | (lo[1:] != hi[:-1])
    run_first = np.flatnonzero(new_run)
    run_lo, run_hi = lo[run_first], hi[np.append(run_first[1:], len(wanted)) - 1]
    run_at = np.zeros(len(run_first), dtype=np.int64)
    np.cumsum((run_hi - run_lo)[:-1], out=run_at[1:])
    total = int((run_hi - run_lo).sum())
    labels_at = total + (-total % 8)
    buffer, claim = take(labels_at + 8 * len(wanted))
    data = buffer.numpy()[:total]
    view = memoryview(data)
    blocks = data.reshape(-1, TAR_BLOCK)  # every span starts and ends on a tar block: so do the runs
    for s, a, b, at in zip(shard[run_first].tolist(), run_lo.tolist(), run_hi.tolist(), run_at.tolist()):
        if files.read_into(paths[s], a, view[at:at + b - a]) != b - a:
            return None  # the shard ends early
    run_of = np.cumsum(new_run) - 1
    sample_at = run_at[run_of] + lo - run_lo[run_of]
    owner = np.repeat(np.arange(len(wanted)), counts)
    data_at = sample_at[owner] + offset - lo[owner]
    header = data_at // TAR_BLOCK - 1
    if not headers_match(blocks, header, index.name_fields(wanted[owner], members), size).all():
        return None
    ext = index.ext[members].astype(np.int64)
    if _repeats(ext, first):
        return None  # an extension twice in a sample
    rank = rules.image_rank[ext]
    best = np.minimum.reduceat(rank, first)
    if np.any(best == _NO_IMAGE):
        return None
    image = np.flatnonzero(rank == best[owner])  # one per sample: no extension repeats
    labels = np.full(len(wanted), -1, dtype=np.int64)
    if rules.label is not None:
        is_label = ext == rules.label
        has = np.add.reduceat(is_label.astype(np.int64), first).astype(bool)
        if rules.labeled and not has.all():
            return None
        values = _labels(blocks, header[is_label] + 1, size[is_label])
        if values is None:
            return None
        labels[has] = values
    elif rules.labeled:
        return None
    if rules.checksums is not None and not _crcs_match(index, rules.checksums, view, wanted, shard, counts,
                                                       data_at, size):
        return None
    starts, ends = np.empty_like(wanted), np.empty_like(wanted)
    starts[order], ends[order] = data_at[image], data_at[image] + size[image]
    out_labels = buffer[labels_at:].view(torch.int64)
    out_labels.numpy()[order] = labels
    return RawBatch(buffer, claim, starts, ends, out_labels, total)


def _repeats(ext: np.ndarray, first: np.ndarray) -> bool:
    """Whether a sample (members from ``first``) holds an extension twice: a sum of distinct powers of
    two equals their OR, a repeat carries."""
    if int(ext.max(initial=0)) >= 62:
        owner = np.repeat(np.arange(len(first)), np.diff(np.append(first, len(ext))))
        return len(np.unique(owner * (int(ext.max()) + 1) + ext)) != len(ext)
    bits = np.left_shift(1, ext)
    return bool(np.any(np.add.reduceat(bits, first) != np.bitwise_or.reduceat(bits, first)))


def _labels(blocks: np.ndarray, which: np.ndarray, size: np.ndarray) -> np.ndarray | None:
    """The ``.cls`` members starting at ``blocks[which]`` (ASCII decimal digits) as int64, or None if any is not."""
    if not len(which):
        return np.zeros(0, dtype=np.int64)
    width = int(size.max())
    if size.min() < 1 or width > _MAX_LABEL_DIGITS:
        return None
    rows = blocks[which, :width]
    live = np.arange(width) < size[:, None]
    digits = rows - np.uint8(48)  # a byte that is not a digit wraps above 9
    if np.any(live & (digits > 9)):
        return None
    digits[~live] = 0
    return digits.astype(np.int64) @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64)) // 10 ** (width - size)


def _crcs_match(index: IndexColumns, checksums: Callable[[int], np.ndarray], view: memoryview, wanted: np.ndarray,
                shard: np.ndarray, counts: np.ndarray, data_at: np.ndarray, size: np.ndarray) -> bool:
    """Whether each sample's members (in index order) hash to the crc32 recorded beside its index."""
    numbers = wanted - index.shard_starts[shard]
    want = np.empty(len(wanted), dtype=np.int64)
    for s in np.unique(shard).tolist():
        mine = shard == s
        want[mine] = checksums(s)[numbers[mine]]
    at, n, m = data_at.tolist(), size.tolist(), 0
    for count, expected in zip(counts.tolist(), want.tolist()):
        crc = 0
        for j in range(m, m + count):
            crc = zlib.crc32(view[at[j]:at[j] + n[j]], crc)
        m += count
        if crc != expected:
            return False
    return True
