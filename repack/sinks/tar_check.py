"""The cheap structure check of a tar shard against its DALI index: columns, not a member walk.

``check_against_index(tar, index)`` answers one question: is ``tar`` exactly the archive repack writes
for ``index`` (``tar_format``'s byte layout), and is ``index`` exactly the index
``index_from_members`` rebuilds from it? It parses the index into columns (ext, data offset, size,
name per member) with the project's one index parser (``repack.manifest.shard_index``), then checks
every member header at once with numpy over the 512-byte blocks the index points at: the fixed fields,
the name, the octal size and the header checksum; the members lie back to back from byte 0; the
end-of-archive follows the last one; each sample's members share a key and adjacent samples do not;
every sample has the same members after its first. No payload is decoded. A yes is final
(``TarColumns``, with the sample keys and what the per-sample checksums need); anything else (damage,
or a tar another tool wrote with other header bytes) answers None, and the caller walks the archive
member by member (``tar_format.read_archive``) to name what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repack.manifest import ManifestError
from repack.manifest.shard_index import parse_index
from repack.sinks.tar_format import (_HEADER_TEMPLATE, _TEMPLATE_SUM, BLOCK, INDEX_VERSION, MAX_MEMBER_SIZE,
                                     end_of_archive)

_TEMPLATE = np.frombuffer(bytes(_HEADER_TEMPLATE), dtype=np.uint8)
_TEMPLATE64 = _TEMPLATE.view(np.uint64)
_SIZE_SHIFTS = np.arange(30, -1, -3, dtype=np.int64)  # 11 octal digits
_SUM_SHIFTS = np.arange(15, -1, -3, dtype=np.int64)  # 6 octal digits
_ZERO, _DOT, _SLASH = ord("0"), ord("."), ord("/")


@dataclass(frozen=True)
class TarColumns:
    """A tar shard that matches its index: per member data offsets and sizes (archive order), the
    members per sample, and each sample's key as a row of bytes (``keys``: uint8, samples x width,
    NUL padded)."""

    offsets: np.ndarray
    sizes: np.ndarray
    per_sample: int
    keys: np.ndarray


def check_against_index(tar, index: bytes) -> TarColumns | None:
    """``TarColumns`` when ``tar`` (the archive's bytes: bytes, mmap or memoryview) and ``index`` (the
    ``.idx`` file's bytes) are exactly what repack writes for each other; None otherwise (not a verdict:
    walk the archive to find the problem)."""
    parsed = _parse_index(index)
    if parsed is None:
        return None
    offsets, sizes, names, exts, per_sample = parsed
    data = np.frombuffer(tar, dtype=np.uint8)
    if len(data) % BLOCK or not _laid_out(data, offsets, sizes):
        return None
    headers = data.view(np.uint64).reshape(-1, BLOCK // 8)[(offsets - BLOCK) // BLOCK]
    if len(offsets) and not _headers_match(headers, names, sizes):
        return None
    keys = _sample_keys(names, exts, per_sample)
    return None if keys is None else TarColumns(offsets, sizes, per_sample, keys)


def _parse_index(index: bytes):
    """(offsets, sizes, names, exts, members per sample) of a canonical index (what
    ``repack.manifest.shard_index.parse_index`` reads, with the header ``v1.2 <samples>`` exactly, a
    final newline, the same number of members on every line, decimal numbers without leading zeros and
    names and exts of at most 100 bytes), else None. Names and exts are uint8 rows (NUL padded)."""
    first_newline = index.find(b"\n")
    if first_newline < 0 or not index.endswith(b"\n"):
        return None
    try:
        columns = parse_index(bytes(index), "index")
    except ManifestError:
        return None
    count, members = columns.samples, len(columns.ext)
    if index[:first_newline] != f"{INDEX_VERSION} {count}".encode():
        return None
    if not count:
        empty = np.zeros(0, np.int64), np.zeros((0, 1), np.uint8)
        return empty[0], empty[0], empty[1], empty[1], 1
    per_sample = int(columns.first_member[1])
    if np.any(np.diff(columns.first_member.astype(np.int64)) != per_sample):
        return None
    offsets, sizes = columns.offset.astype(np.int64), columns.size.astype(np.int64)
    samples = np.repeat(np.arange(count), per_sample)
    ext_lengths = np.array([len(e) for e in columns.exts], np.int64)[columns.ext]
    keyed, tails = zip(*columns.suffixes)
    key_lengths = np.diff(columns.key_ends.astype(np.int64))[samples]
    name_lengths = np.array([len(t) for t in tails], np.int64)[columns.suffix] + \
        np.where(np.array(keyed)[columns.suffix], key_lengths, 0)
    if int(name_lengths.max()) > 100 or int(ext_lengths.max()) > 100:
        return None
    # every token is followed by one separator; digits-only numbers are canonical when no longer than their value
    canonical = ext_lengths.sum() + name_lengths.sum() + _digits(offsets).sum() + _digits(sizes).sum() + 4 * members
    if len(index) - first_newline - 1 != canonical:
        return None
    names = columns.name_fields(samples, np.arange(members), int(name_lengths.max()))
    ext_width = int(ext_lengths.max())
    table = np.array([list(e.encode("ascii").ljust(ext_width, b"\0")) for e in columns.exts], np.uint8)
    return offsets, sizes, names, table[columns.ext], per_sample


def _digits(values: np.ndarray) -> np.ndarray:
    """How many decimal digits each of ``values`` (below 10**18) is written with."""
    return np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), values, side="right") + 1


def _laid_out(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """The members lie back to back from byte 0 and the file ends with exactly repack's end-of-archive."""
    if len(offsets):
        if (sizes > MAX_MEMBER_SIZE).any() or offsets[0] != BLOCK:
            return False
        padded = sizes + (-sizes % BLOCK)
        if not np.array_equal(offsets[1:], offsets[:-1] + padded[:-1] + BLOCK):
            return False
        end = int(offsets[-1] + padded[-1])
    else:
        end = 0
    return len(data) == end + len(end_of_archive(end)) and not data[end:].any()


def _headers_match(headers: np.ndarray, names: np.ndarray, sizes: np.ndarray) -> bool:
    """Each header (a uint64 row of 64) is repack's template with the member's name, octal size and
    checksum (the template's sum plus the name's and the size field's bytes)."""
    if not (headers[:, 20:] == _TEMPLATE64[20:]).all():  # bytes 160..512
        return False
    raw = headers.view(np.uint8)
    if not ((raw[:, 100:124] == _TEMPLATE[100:124]).all() and (raw[:, 136:148] == _TEMPLATE[136:148]).all()
            and (raw[:, 156:160] == _TEMPLATE[156:160]).all()):
        return False
    width = names.shape[1]
    if not (raw[:, :width] == names).all() or raw[:, width:100].any():
        return False
    size_digits = ((sizes[:, None] >> _SIZE_SHIFTS) & 7) + _ZERO
    if not (raw[:, 124:135] == size_digits).all() or raw[:, 135].any():
        return False
    sums = _TEMPLATE_SUM + names.sum(axis=1, dtype=np.int64) + size_digits.sum(axis=1)
    sum_digits = ((sums[:, None] >> _SUM_SHIFTS) & 7) + _ZERO
    return bool((raw[:, 148:154] == sum_digits).all() and not raw[:, 154].any() and (raw[:, 155] == 32).all())


def _sample_keys(names: np.ndarray, exts: np.ndarray, per_sample: int) -> np.ndarray | None:
    """Each sample's key (rows of bytes) when every name is a flat KEY.EXT with the ext the index gives,
    a sample's members share its key and adjacent samples differ; else None."""
    members, width = names.shape
    if not members:
        return np.zeros((0, 1), np.uint8)
    if (names == _SLASH).any():
        return None
    dots = names == _DOT
    first_dot = dots.argmax(axis=1)
    lengths = (names != 0).sum(axis=1)
    if not dots.any(axis=1).all() or (first_dot == 0).any() or (lengths <= first_dot + 1).any():
        return None  # no key, no ext, or a hidden name
    padded = np.zeros((members, 2 * width), np.uint8)
    padded[:, :width] = names
    after_dot = np.take_along_axis(padded, (first_dot + 1)[:, None] + np.arange(width), axis=1)
    ext_rows = np.zeros((members, width), np.uint8)
    ext_rows[:, :min(width, exts.shape[1])] = exts[:, :width]
    if exts.shape[1] > width or not (after_dot == ext_rows).all():
        return None
    keys = np.where(np.arange(width) < first_dot[:, None], names, 0).reshape(-1, per_sample, width)
    first = keys[:, 0]
    if not (keys == first[:, None]).all() or not (first[1:] != first[:-1]).any(axis=1).all():
        return None
    layout = exts.reshape(-1, per_sample, exts.shape[1])[:, 1:]
    if not (layout == layout[:1]).all():
        return None
    return first
