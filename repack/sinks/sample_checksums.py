"""Per-sample checksums of a tar shard: the side file ``<stem>.crc`` beside ``<stem>.tar`` and its
``<stem>.idx``, so a reader can check each sample's payload as it reads it (``ImageShardDataset(...,
verify_samples=True)``), without hashing whole shards.

Byte layout (little-endian)::

  offset  size   field
  0       8      magic b"RPKCRC1\\n"
  8       8      uint64: N, the number of samples (the index's count)
  16      4 * N  uint32 per sample, in index order: zlib.crc32 over the data bytes of the sample's
                 members (no tar header, no padding), the members in the order of the sample's index
                 line, chained (crc32(b, crc32(a)))

The manifest's shard entry names it: ``checksums`` (path), ``checksums_bytes``, ``checksums_sha256``.
The shard writers build it from the bytes they write (``checksums_header`` + ``checksums_column``);
``sample_checksums`` reads a tar back (verify, a segment record of an older repack).
"""

from __future__ import annotations

import mmap
import struct
import zlib
from array import array
from pathlib import Path

import numpy as np

from repack.read_at import read_at

MAGIC = b"RPKCRC1\n"
HEADER = struct.Struct("<8sQ")


def checksums_size(samples: int) -> int:
    """Bytes of the side file of a shard of ``samples`` samples."""
    return HEADER.size + 4 * samples


def checksums_header(samples: int) -> bytes:
    """The first bytes of a ``.crc`` side file of ``samples`` samples (see ``sample_checksums``)."""
    return HEADER.pack(MAGIC, samples)


def checksums_column(crcs: array) -> bytes:
    """The little-endian bytes of a uint32 column (``sample_checksums``' per-sample values)."""
    if crcs.itemsize != 4:
        raise OSError("array('I') is not 4 bytes on this platform")
    if struct.pack("=I", 1) != struct.pack("<I", 1):
        crcs = array("I", crcs)
        crcs.byteswap()
    return crcs.tobytes()


def sample_checksums(tar: str | Path, index: str) -> bytes:
    """The side file's bytes for the tar at ``tar`` and its DALI index text ``index``."""
    lines = index.splitlines()[1:]
    sums = array("I")
    with open(tar, "rb", buffering=0) as fh:
        fd = fh.fileno()
        for line in lines:
            tokens = line.split(" ")
            crc = 0
            for i in range(0, len(tokens), 4):
                offset, size = int(tokens[i + 1]), int(tokens[i + 2])
                data = read_at(fd, size, offset)
                if len(data) != size:
                    raise OSError(f"{tar}: ends before member {tokens[i + 3]} (bytes {offset}..{offset + size})")
                crc = zlib.crc32(data, crc)
            sums.append(crc)
    return checksums_header(len(lines)) + checksums_column(sums)


def checksums_from_columns(tar, offsets: np.ndarray, sizes: np.ndarray, per_sample: int) -> bytes:
    """The side file's bytes for a tar given as a buffer (bytes, mmap) whose members' data offsets and
    sizes are known (archive order, ``per_sample`` members a sample, as ``tar_check`` finds them): the
    same bytes as ``sample_checksums``."""
    crcs = sample_crcs(tar, offsets, sizes, per_sample)
    return HEADER.pack(MAGIC, len(crcs)) + crcs.astype("<u4").tobytes()


def sample_crcs(tar, offsets: np.ndarray, sizes: np.ndarray, per_sample: int) -> np.ndarray:
    """Each sample's chained crc32 (uint32) over the members at ``offsets`` / ``sizes`` of the buffer
    ``tar`` (archive order, ``per_sample`` members a sample), the crc32 calls driven by C-level iteration
    (``map``; slices of bytes or an mmap are copies, ~15% faster for tiny members than memoryviews)."""
    view = tar if isinstance(tar, (bytes, mmap.mmap)) else memoryview(tar).cast("B")
    starts, ends = offsets.reshape(-1, per_sample), (offsets + sizes).reshape(-1, per_sample)
    crcs = [0] * len(starts)
    for column in range(per_sample):
        pieces = map(view.__getitem__, map(slice, starts[:, column].tolist(), ends[:, column].tolist()))
        crcs = list(map(zlib.crc32, pieces, crcs))
    return np.array(crcs, dtype=np.uint32)
